"""Gemma 4's vision side in its multimodal repos (``Gemma4ForConditionalGeneration``): the config's ``vision_config``
read into :class:`~waypoint.models.gemma4_vision.Gemma4VisionArgs`, and the converter's rules between transformers'
keys and the native model's ``vision.*`` (:mod:`waypoint.models.gemma4_vision` names them).

On disk the tower is ``model.vision_tower.*`` and its embedder into the text's width ``model.embed_vision.*``; the
converter sees them as ``vision_tower.*`` and ``embed_vision.*`` (:data:`PREFIXES`, for the family's ``hf_prefixes``
beside the text model's). Both load into the one native tower (the embedder is its ``projection``: there is no
``projector.``). Every tensor is renamed as it is: no transposes, no reshapes. The clip bounds (``use_clipped_linears``)
and ``std_bias``/``std_scale`` (``standardize``) are buffers (:data:`BUFFERS`). The audio tower and ``embed_audio``
are not this module's: they stay carried untouched (the audio tower's clip bounds buffers too, by the same pattern)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waypoint.converters.table import Rule
from waypoint.models.gemma4_vision import Gemma4VisionArgs

TOWER, EMBEDDER = "vision_tower.", "embed_vision."  # the converter's prefixes for model.vision_tower., model.embed_vision.
PREFIXES = {"model.vision_tower.": TOWER, "model.embed_vision.": EMBEDDER}  # {on disk: the converter's}
LAYER, NATIVE = TOWER + "encoder.layers.{i}.", "vision.layers.{i}."
# (transformers' module under a layer, ours): each with a weight
NORMS = [("input_layernorm", "sa_norm"), ("post_attention_layernorm", "post_attn_norm"),
         ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "post_mlp_norm"),
         ("self_attn.q_norm", "attn.q_norm"), ("self_attn.k_norm", "attn.k_norm")]
LINEARS = [(f"self_attn.{p}_proj", f"attn.{p}_proj") for p in "qkvo"] + [
    (f"mlp.{p}_proj", f"mlp.{p}_proj") for p in ("gate", "up", "down")]
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
# keys that hold buffers, not parameters (the family's ``buffers``: left out of an index's total_parameters, as
# transformers' num_parameters()): every Gemma4ClippableLinear's bounds, the vision tower's and the carried audio
# tower's alike, and the tower's standardization; by the module's own names at any prefix, the files'
# (model.vision_tower., model.audio_tower.) as well as the converter's (vision_tower.)
BUFFERS = (r"\.(input|output)_(min|max)$", r"(^|\.)std_(bias|scale)$")


def gemma4_vision_rules(args: Gemma4VisionArgs) -> list[Rule]:
    rules = [Rule(TOWER + "patch_embedder.input_proj.weight", "vision.patch_embedding.weight"),
             Rule(TOWER + "patch_embedder.position_embedding_table", "vision.position_embedding"),
             Rule(EMBEDDER + "embedding_projection.weight", "vision.projection.weight")]
    rules += [Rule(f"{LAYER}{hf}.weight", f"{NATIVE}{ours}.weight") for hf, ours in NORMS]
    for hf, ours in LINEARS:
        rules.append(Rule(f"{LAYER}{hf}.linear.weight", f"{NATIVE}{ours}.weight"))
        if args.clipped_linears:
            rules += [Rule(f"{LAYER}{hf}.{bound}", f"{NATIVE}{ours}.{bound}") for bound in CLIP_BOUNDS]
    if args.standardize:
        rules += [Rule(TOWER + name, "vision." + name) for name in ("std_bias", "std_scale")]
    return rules


def gemma4_vision(config: Mapping[str, Any]) -> Gemma4VisionArgs | None:
    """A Gemma4ForConditionalGeneration config.json's tower (``Gemma4VisionConfig``'s defaults for what it leaves
    out; ``attention_bias``, which transformers' tower ignores, too), its placeholder tokens (image, video, audio:
    ``Gemma4Config``'s defaults) and how the language model attends over image tokens; None without a
    ``vision_config``."""
    c = config.get("vision_config")
    if not isinstance(c, Mapping):
        return None
    get = lambda key, default: c[key] if c.get(key) is not None else default  # noqa: E731
    text = config.get("text_config") or {}
    bidirectional = text.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        raise ValueError(f"text_config.use_bidirectional_attention={bidirectional!r}: only null (causal) or 'vision' "
                         "(an image's tokens both ways in the sliding layers) is supported")
    rope = get("rope_parameters", {})
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope_type={rope['rope_type']!r}: Gemma 4's tower has only the axial one")
    return Gemma4VisionArgs(
        dim=get("hidden_size", 768), n_layers=get("num_hidden_layers", 16), n_heads=get("num_attention_heads", 12),
        n_kv_heads=get("num_key_value_heads", 12), head_dim=get("head_dim", 64),
        hidden_dim=get("intermediate_size", 3072),
        out_dim=text.get("hidden_size") or 2304, n_positions=get("position_embedding_size", 10240),
        patch_size=get("patch_size", 16), pooling_kernel_size=get("pooling_kernel_size", 3),
        activation=get("hidden_activation", "gelu_pytorch_tanh"),
        rope_theta=float(rope.get("rope_theta", get("rope_theta", 100.0))),
        norm_eps=get("rms_norm_eps", 1e-6), clipped_linears=bool(get("use_clipped_linears", False)),
        standardize=bool(get("standardize", False)), image_token_id=int(config.get("image_token_id") or 258880),
        video_token_id=config.get("video_token_id", 258884), audio_token_id=config.get("audio_token_id", 258881),
        image_attention="sliding_bidirectional" if bidirectional == "vision" else "causal",
        pad_token_id=int(text.get("pad_token_id") if text.get("pad_token_id") is not None else 0))
