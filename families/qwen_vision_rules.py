"""Qwen3.5's vision tower in its multimodal repos (``Qwen3_5ForConditionalGeneration``): the config's
``vision_config`` read into :class:`~waypoint.models.qwen3_5_vision.QwenVisionArgs`, and the converter's rules
between transformers' keys (``model.visual.*`` on disk, ``visual.*`` for the converter: the family's
``hf_prefixes``) and the native model's ``vision.*``. Every tensor is renamed as it is, but the patch embedding's
Conv3d kernel [dim, C, T, P, P], which the native tower holds flat [dim, C*T*P*P] (a Linear)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waypoint.converters.ops import Flatten
from waypoint.converters.table import Rule
from waypoint.models.qwen3_5_vision import QwenVisionArgs

# (transformers' module, ours): each with a weight and a bias
MODULES = [("patch_embed.proj", "patch_embedding"),
           ("blocks.{i}.norm1", "layers.{i}.norm1"), ("blocks.{i}.attn.qkv", "layers.{i}.attn.qkv_proj"),
           ("blocks.{i}.attn.proj", "layers.{i}.attn.o_proj"), ("blocks.{i}.norm2", "layers.{i}.norm2"),
           ("blocks.{i}.mlp.linear_fc1", "layers.{i}.mlp.fc1"), ("blocks.{i}.mlp.linear_fc2", "layers.{i}.mlp.fc2"),
           ("merger.norm", "merger.norm"), ("merger.linear_fc1", "merger.fc1"), ("merger.linear_fc2", "merger.fc2")]
TOWER = "visual."  # the converter's prefix for the tower (model.visual. on disk)


def qwen_vision_rules(args: QwenVisionArgs) -> list[Rule]:
    kernel = Flatten((args.channels, args.temporal_patch_size, args.patch_size, args.patch_size))
    rules = [Rule(TOWER + "pos_embed.weight", "vision.position_embedding.weight")]
    for hf, ours in MODULES:
        weight = Rule(f"{TOWER}{hf}.weight", f"vision.{ours}.weight", *((kernel,) if ours == "patch_embedding" else ()))
        rules += [weight, Rule(f"{TOWER}{hf}.bias", f"vision.{ours}.bias")]
    return rules


def qwen3_5_vision(config: Mapping[str, Any]) -> QwenVisionArgs | None:
    """A Qwen3_5ForConditionalGeneration config.json's tower (``Qwen3_5VisionConfig``'s defaults for what it leaves
    out) and its image token; None for a text model's config."""
    c = config.get("vision_config")
    if not isinstance(c, Mapping):
        return None
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope_type={rope['rope_type']!r}: Qwen3.5's tower has only the axial one")
    patch = c.get("patch_size", 16)
    if isinstance(patch, (list, tuple)):  # the config allows [p, p]; transformers' Conv3d takes one size
        if len(set(patch)) != 1:
            raise ValueError(f"vision_config.patch_size={patch}: only square patches are supported")
        patch = patch[0]
    return QwenVisionArgs(
        dim=c.get("hidden_size", 1152), n_layers=c.get("depth", 27), n_heads=c.get("num_heads", 16),
        hidden_dim=c.get("intermediate_size", 4304), out_dim=c.get("out_hidden_size", 3584),
        n_positions=c.get("num_position_embeddings", 2304), patch_size=patch,
        temporal_patch_size=c.get("temporal_patch_size", 2), merge_size=c.get("spatial_merge_size", 2),
        channels=c.get("in_channels", 3), activation=c.get("hidden_act", "gelu_pytorch_tanh"),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        image_token_id=int(config.get("image_token_id", 248056)))
