"""Rule pieces and config reading for the vision side of multimodal repos: SigLIP's tower and Gemma 3's projector
(native names in :mod:`waypoint.models.siglip` and :mod:`waypoint.models.image_projector`).

The converter sees a tower's keys under ``vision_tower.`` whichever way the files nest them (Google's
``vision_tower.vision_model.``, or transformers 5's ``vision_tower.``): the family's ``hf_prefixes`` map either there,
and back on save. SigLIP's pooling head, which Gemma 3 never runs, is carried untouched (``carried``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waypoint.converters.table import Rule
from waypoint.models.vision_args import VisionArgs

TOWER, LAYER, NATIVE = "vision_tower.", "vision_tower.encoder.layers.{i}.", "vision.layers.{i}."
# the pooling head of a SigLIP tower that has one (vision_use_head): not run by a Gemma 3 model
SIGLIP_HEAD = r"^vision_tower\.head\."


def siglip_rules() -> list[Rule]:
    rules = [Rule(TOWER + "embeddings.patch_embedding." + p, "vision.patch_embedding." + p) for p in ("weight", "bias")]
    rules.append(Rule(TOWER + "embeddings.position_embedding.weight", "vision.position_embedding.weight"))
    for p in ("weight", "bias"):
        rules += [Rule(TOWER + "post_layernorm." + p, "vision.norm." + p),
                  Rule(LAYER + "layer_norm1." + p, NATIVE + "norm1." + p),
                  Rule(LAYER + "layer_norm2." + p, NATIVE + "norm2." + p),
                  Rule(LAYER + "mlp.fc1." + p, NATIVE + "mlp.fc1." + p),
                  Rule(LAYER + "mlp.fc2." + p, NATIVE + "mlp.fc2." + p)]
        rules += [Rule(LAYER + f"self_attn.{hf}_proj." + p, NATIVE + f"attn.{ours}_proj." + p)
                  for hf, ours in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o"))]
    return rules


def gemma3_projector_rules() -> list[Rule]:
    return [Rule("multi_modal_projector.mm_soft_emb_norm.weight", "projector.norm.weight"),
            Rule("multi_modal_projector.mm_input_projection_weight", "projector.weight")]


# where the files keep the tower and the text model: {prefix on disk: the converter's}, the most specific first
# (``disk_key`` maps back by the first converter prefix a key starts with, and the text model's is "")
GEMMA3_PREFIXES = ({"vision_tower.vision_model.": TOWER, "multi_modal_projector.": "multi_modal_projector.", "language_model.": ""},
                   {TOWER: TOWER, "multi_modal_projector.": "multi_modal_projector.", "language_model.": ""})


def gemma3_vision(config: Mapping[str, Any]) -> VisionArgs | None:
    """A Gemma3ForConditionalGeneration config.json's image side (SiglipVisionConfig's defaults for what it leaves
    out); None for a text model's."""
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        return None
    get = lambda key, default: vision.get(key, default) if vision.get(key) is not None else default  # noqa: E731
    return VisionArgs(tower="siglip", dim=get("hidden_size", 768), n_layers=get("num_hidden_layers", 12),
                      n_heads=get("num_attention_heads", 12), hidden_dim=get("intermediate_size", 3072),
                      image_size=get("image_size", 224), patch_size=get("patch_size", 16), channels=get("num_channels", 3),
                      norm_eps=get("layer_norm_eps", 1e-6), activation=get("hidden_act", "gelu_pytorch_tanh"),
                      image_token_id=config.get("image_token_index", config.get("image_token_id", 262144)),
                      tokens_per_image=config.get("mm_tokens_per_image", 256), projector_eps=get("layer_norm_eps", 1e-6))


def gemma3_config(args, text_fields: Mapping[str, Any], boi_token_id: int, eoi_token_id: int) -> dict[str, Any]:
    """The config.json of a Gemma3ForConditionalGeneration with this text model (``text_fields``: the family's
    ``hf_config``) and ``args.vision`` (the inverse of :func:`gemma3_vision`)."""
    v = args.vision
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": {**text_fields, "model_type": "gemma3_text"},
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": v.dim, "num_hidden_layers": v.n_layers,
                              "num_attention_heads": v.n_heads, "intermediate_size": v.hidden_dim, "image_size": v.image_size,
                              "patch_size": v.patch_size, "num_channels": v.channels, "layer_norm_eps": v.norm_eps,
                              "hidden_act": v.activation, "vision_use_head": False},
            "mm_tokens_per_image": v.tokens_per_image, "image_token_index": v.image_token_id,
            "boi_token_index": boi_token_id, "eoi_token_index": eoi_token_id, "tie_word_embeddings": args.tie_embeddings}
