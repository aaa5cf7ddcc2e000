"""Rule pieces and config fields of the hybrid Gated DeltaNet + gated-attention families (Qwen3-Next, Qwen3.5/3.6).

Layers of ``layer_types`` ``linear_attention`` hold ``linear_attn.*`` (native ``attn.*`` of a ``GatedDeltaNet``, the
same names after it); the others ``self_attn.*`` with a ``q_proj`` twice as wide (each head's query rows, then its
gate's) and zero-centred q/k norms. RoPE rotates HF's halves of the first ``partial_rotary_factor`` of each head, which
the native attention regroups on the activations (``rope_interleave`` false): no row is permuted, every tensor is
renamed as it is, except Qwen3-Next's per-key-head fused ``in_proj_qkvz`` / ``in_proj_ba`` (``HeadGroups``).
"""

from __future__ import annotations

from typing import Any

from waypoint.converters.ops import HeadGroups
from waypoint.converters.table import Rule
from waypoint.families.hf_config import FULL, HFConfig, common_args, rope_fields
from waypoint.families.hf_rules import LAYER, NATIVE, at, norm_rules, outer_rules
from waypoint.models.args import ModelArgs

LINEAR = "linear_attention"
DELTANET = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")  # renamed as they are
SPLIT = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")  # Qwen3.5's, fused in Qwen3-Next
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "output_proj", "in_proj_qkv", "in_proj_z", "out_proj", "w1", "w2", "w3", "output")


def deltanet_rules(args: ModelArgs, fused: bool) -> list[Rule]:
    hf, native = LAYER + "linear_attn.", NATIVE + "attn."
    rules = [Rule(hf + name, native + name) for name in DELTANET]
    if fused:  # Qwen3-Next: per key head [q, k, v, z] and [b, a]
        ratio = args.linear_value_heads // args.linear_key_heads
        qkvz = (args.linear_key_head_dim,) * 2 + (ratio * args.linear_value_head_dim,) * 2
        rules += [Rule(hf + "in_proj_qkvz.weight", (native + SPLIT[0], native + SPLIT[1]),
                       HeadGroups(args.linear_key_heads, qkvz, ((0, 1, 2), (3,)))),
                  Rule(hf + "in_proj_ba.weight", (native + SPLIT[2], native + SPLIT[3]),
                       HeadGroups(args.linear_key_heads, (ratio, ratio), ((0,), (1,))))]
    else:
        rules += [Rule(hf + name, native + name) for name in SPLIT]
    return at(args.linear_attention_layers, rules)


def gated_attention_rules(args: ModelArgs) -> list[Rule]:
    hf, native = LAYER + "self_attn.", NATIVE + "attn."
    rules = [Rule(hf + f"{p}_proj.weight", native + f"{p}_proj.weight") for p in "qkv"]
    rules += [Rule(hf + "o_proj.weight", native + "output_proj.weight"),
              Rule(hf + "q_norm.weight", native + "q_norm.weight"), Rule(hf + "k_norm.weight", native + "k_norm.weight")]
    return at([i for i in range(args.n_layers) if i not in args.linear_attention_layers], rules)


def hybrid_rules(args: ModelArgs, fused: bool = False) -> list[Rule]:
    """Embedding, head, norms and token mixers; the families add their MLPs."""
    return outer_rules() + norm_rules() + deltanet_rules(args, fused) + gated_attention_rules(args)


def hybrid_args(cfg: HFConfig, model_type: str) -> dict[str, Any]:
    """The ModelArgs fields of a hybrid config: ``common_args`` with partial rotary, the layer types (``layer_types``,
    else one full-attention layer every ``full_attention_interval``) and Gated DeltaNet's shapes."""
    common = common_args(cfg, model_type, partial_rotary=True)
    n = common["n_layers"]
    types = cfg.raw.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must name linear_attention or full_attention for each of the {n} layers")
    # Qwen3.5's mRoPE (images' tokens take 2-D positions, models.mrope): transformers' default section when absent
    mrope = tuple((cfg.raw.get("rope_parameters") or {}).get("mrope_section") or (11, 11, 10)) if model_type.startswith("qwen3_5") else None
    return dict(common, norm_plus_one=True, qk_norm=True, attn_output_gate=True, rope_interleave=False, mrope_section=mrope,
                linear_attention_layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
                linear_key_heads=cfg["linear_num_key_heads"], linear_value_heads=cfg["linear_num_value_heads"],
                linear_key_head_dim=cfg["linear_key_head_dim"], linear_value_head_dim=cfg["linear_value_head_dim"],
                linear_conv_kernel=cfg["linear_conv_kernel_dim"])


def hybrid_fields(args: ModelArgs) -> dict[str, Any]:
    """The config.json fields ``hybrid_args`` reads (after ``common_fields``)."""
    rope = dict(rope_fields(args), partial_rotary_factor=args.partial_rotary_factor)
    if args.mrope_section is not None:  # Qwen3.5's, as its releases write it (interleaved: the only mRoPE read)
        rope.update(mrope_section=list(args.mrope_section), mrope_interleaved=True)
    return {"hidden_act": args.activation, "rope_parameters": rope, "partial_rotary_factor": args.partial_rotary_factor,
            "layer_types": [LINEAR if i in args.linear_attention_layers else FULL for i in range(args.n_layers)],
            "linear_num_key_heads": args.linear_key_heads, "linear_num_value_heads": args.linear_value_heads,
            "linear_key_head_dim": args.linear_key_head_dim, "linear_value_head_dim": args.linear_value_head_dim,
            "linear_conv_kernel_dim": args.linear_conv_kernel}


HYBRID_DEFAULTS = dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                       num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                       full_attention_interval=4, partial_rotary_factor=0.25)
# what the native model reproduces only one way (the releases' config.json say attn_output_gate: true; transformers
# gates whatever it says)
HYBRID_FIXED = dict(attention_bias=False, attn_output_gate=True)
