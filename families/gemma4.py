"""Gemma 4, text (``Gemma4ForCausalLM``, model_type ``gemma4_text``); released as the multimodal
``Gemma4ForConditionalGeneration`` (model_type ``gemma4``: the text model's keys under ``model.language_model.``, its
config under ``text_config``; the vision and audio towers and their embedders pass through untouched).

What it adds to Gemma 3 (each a ModelArgs field, computed as transformers 5.24's ``modeling_gemma4`` computes it):

- norms scale by ``weight`` (not ``1 + weight``), in fp32; a weightless norm on each value head; attention scale 1.0;
- five sliding layers (RoPE base 1e4, ``head_dim``) to one full one (``global_head_dim``, their own k/v heads, and
  *proportional* RoPE: of each head's pairs the first ``partial_rotary_factor`` turn, at base 1e6);
- ``attention_k_eq_v``: full layers' keys are also their values (no ``v_proj``);
- ``num_kv_shared_layers``: the last N layers have no k/v projections and attend over the keys and values of the last
  earlier layer of their type; with ``use_double_wide_mlp`` their MLP is twice as wide;
- ``layer_scalar``: a stored scalar per layer times its output (a buffer);
- per-layer embeddings (E2B/E4B, ``hidden_size_per_layer_input``): ``models.per_layer_embeddings``;
- ``enable_moe_block`` (26B-A4B): experts beside every layer's dense MLP, with a router of its own
  (``routing="normed_softmax_topk"``) and three more norms.

The full layers' shape comes from v5.24's ``per_layer_config`` (what ``save_pretrained`` writes) or the releases'
``global_head_dim`` / ``num_global_key_value_heads``; either way the file is written back as it came.
"""

from __future__ import annotations

from waypoint.converters.ops import RopePermute, Split
from waypoint.converters.table import Rule
from waypoint.families.family import LLAMA_LORA_TARGETS, Family
from waypoint.families.hf_config import FULL, SLIDING, HFConfig, common_args, common_fields, layer_types, layer_window_args, rope_fields, rope_params
from waypoint.families.hf_rules import LAYER, NATIVE, at, mlp_rules, outer_rules, sandwich_norm_rules
from waypoint.families.qwen3_5 import MULTIMODAL
from waypoint.families.gemma4_vision_rules import BUFFERS as VISION_BUFFERS, PREFIXES as VISION_PREFIXES
from waypoint.families.gemma4_vision_rules import gemma4_vision, gemma4_vision_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer

PATTERN = 6  # Gemma4TextConfig's default: five sliding layers, then a full one


def _types(cfg: HFConfig) -> list[str]:
    n = cfg["num_hidden_layers"]
    types = list(cfg.raw.get("layer_types") or [SLIDING if (i + 1) % PATTERN else FULL for i in range(n)])
    if types:
        types[-1] = FULL  # as Gemma4TextConfig forces it
    return types


def _global_shape(cfg: HFConfig, types: list[str]) -> tuple[int, int | None]:
    """The full layers' (head_dim, k/v heads or None), from ``per_layer_config`` or the releases' fields."""
    per_layer = cfg.raw.get("per_layer_config")
    if isinstance(per_layer, dict):  # present, even empty (then every layer its head_dim), as Gemma4TextConfig reads it
        # keys are layer indices, as ints or strings; v5.24's to_dict zero-pads them to one width ("05", "11")
        per_layer = {int(k): v for k, v in per_layer.items()}
        full = [i for i, t in enumerate(types) if t == FULL]
        overrides = [per_layer.get(i) or {} for i in full]
        sliding = [k for k, v in per_layer.items() if v and types[k] != FULL]
        if sliding or any(o != overrides[0] for o in overrides) or set(overrides[0]) - {"head_dim", "num_key_value_heads"}:
            raise ValueError("per_layer_config other than one head_dim / num_key_value_heads for every full_attention layer "
                             "is not supported")
        return int(overrides[0].get("head_dim") or cfg["head_dim"]), overrides[0].get("num_key_value_heads")
    kv_heads = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v", True) else None
    return int(cfg.get("global_head_dim") or 512), kv_heads


def model_args(cfg: HFConfig) -> ModelArgs:
    cfg = HFConfig({**cfg.raw, "hidden_act": cfg.get("hidden_activation")}, cfg.defaults)
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention='all' is not supported for model_type 'gemma4_text' (only causal)")
    types = _types(cfg)
    local = rope_params(cfg, SLIDING)
    if local["rope_type"] != "default":
        raise ValueError(f"rope type {local['rope_type']!r} for sliding_attention layers is not supported (only default)")
    head_dim, kv_heads = _global_shape(cfg, types)
    moe = dict(n_experts=cfg["num_experts"], experts_per_token=cfg["top_k_experts"], expert_hidden_dim=cfg["moe_intermediate_size"],
               moe_beside_mlp=True, routing="normed_softmax_topk", expert_weights_fp32=True) if cfg.get("enable_moe_block") else {}
    per_layer = cfg.get("hidden_size_per_layer_input") or 0
    return ModelArgs(
        **common_args(cfg, "gemma4_text", rope_types=("default", "proportional"), rope_layer_type=FULL),
        **layer_window_args(cfg.get("sliding_window"), types, cfg["num_hidden_layers"]),
        embedding_scale=cfg["hidden_size"] ** 0.5, norm_fp32_weight=True, sandwich_norms=True, qk_norm=True, value_norm=True,
        attn_scale=1.0, final_softcap=cfg.get("final_logit_softcapping"), local_rope_theta=float(local["rope_theta"]),
        layer_scalar=True, global_head_dim=head_dim, global_kv_heads=kv_heads, attn_k_eq_v=bool(cfg.get("attention_k_eq_v")),
        kv_shared_layers=int(cfg.get("num_kv_shared_layers") or 0), double_wide_mlp=bool(cfg.get("use_double_wide_mlp")),
        per_layer_dim=per_layer, per_layer_vocab_size=cfg.get("vocab_size_per_layer_input") if per_layer else None, **moe)


def hf_config(args: ModelArgs) -> dict:
    fields = common_fields(args, FAMILY)
    fields.update(
        hidden_activation=args.activation, sliding_window=args.sliding_window, layer_types=layer_types(args),
        final_logit_softcapping=args.final_softcap, rope_parameters={
            FULL: rope_fields(args), SLIDING: {"rope_type": "default", "rope_theta": args.local_rope_theta}},
        global_head_dim=args.global_head_dim, num_global_key_value_heads=args.global_kv_heads,
        attention_k_eq_v=args.attn_k_eq_v, num_kv_shared_layers=args.kv_shared_layers, use_double_wide_mlp=args.double_wide_mlp,
        hidden_size_per_layer_input=args.per_layer_dim, vocab_size_per_layer_input=args.per_layer_vocab_size or args.vocab_size,
        enable_moe_block=args.moe_beside_mlp, num_experts=args.n_experts or None,
        top_k_experts=args.experts_per_token if args.n_experts else None, moe_intermediate_size=args.expert_hidden_dim)
    del fields["rope_theta"]  # Gemma4TextConfig has none: rope_parameters per layer type
    return fields


# -- the converter's table ---------------------------------------------------------------------------------------

def _attention_rules(args: ModelArgs, layers: list[int]) -> list[Rule]:
    """q/k/o and the per-head norms of ``layers`` (one attention shape), k and v only where a layer has its own."""
    if not layers:
        return []
    kv_heads, head_dim = args.attention_shape(layers[0])
    rules = [Rule(LAYER + "self_attn.q_proj.weight", NATIVE + "attn.q_proj.weight", RopePermute(args.n_heads, head_dim)),
             Rule(LAYER + "self_attn.q_norm.weight", NATIVE + "attn.q_norm.weight", RopePermute(1, head_dim)),
             Rule(LAYER + "self_attn.o_proj.weight", NATIVE + "attn.output_proj.weight")]
    own = [i for i in layers if args.kv_source(i) is None]
    rules = at(layers, rules) + at(own, [
        Rule(LAYER + "self_attn.k_proj.weight", NATIVE + "attn.k_proj.weight", RopePermute(kv_heads, head_dim)),
        Rule(LAYER + "self_attn.k_norm.weight", NATIVE + "attn.k_norm.weight", RopePermute(1, head_dim))])
    with_v = [i for i in own if not (args.attn_k_eq_v and args.is_full_attention(i))]
    return rules + at(with_v, [Rule(LAYER + "self_attn.v_proj.weight", NATIVE + "attn.v_proj.weight")])


def per_layer_rules() -> list[Rule]:
    return [
        Rule("model.embed_tokens_per_layer.weight", "per_layer.embeddings.weight"),
        Rule("model.per_layer_model_projection.weight", "per_layer.model_proj.weight"),
        Rule("model.per_layer_projection_norm.weight", "per_layer.norm.weight"),
        Rule(LAYER + "per_layer_input_gate.weight", NATIVE + "per_layer_input.input_gate.weight"),
        Rule(LAYER + "per_layer_projection.weight", NATIVE + "per_layer_input.input_proj.weight"),
        Rule(LAYER + "post_per_layer_input_norm.weight", NATIVE + "per_layer_input.norm.weight"),
    ]


def moe_rules(args: ModelArgs) -> list[Rule]:
    """The experts beside the MLP: transformers' packed ``experts.*`` (gate rows, then up rows) and its router."""
    moe, hidden = NATIVE + "moe.", args.expert_hidden_dim
    return [
        Rule(LAYER + "router.proj.weight", moe + "router.weight"),
        Rule(LAYER + "router.scale", moe + "router_scale"),
        Rule(LAYER + "router.per_expert_scale", moe + "expert_scale"),
        Rule(LAYER + "experts.gate_up_proj", (moe + "w1", moe + "w3"), Split((hidden, hidden), dim=1)),
        Rule(LAYER + "experts.down_proj", moe + "w2"),
        Rule(LAYER + "post_feedforward_layernorm_1.weight", NATIVE + "post_dense_norm.weight"),
        Rule(LAYER + "pre_feedforward_layernorm_2.weight", NATIVE + "moe_norm.weight"),
        Rule(LAYER + "post_feedforward_layernorm_2.weight", NATIVE + "post_moe_norm.weight"),
    ]


def rules(args: ModelArgs) -> list[Rule]:
    full = [i for i in range(args.n_layers) if args.is_full_attention(i)]
    sliding = [i for i in range(args.n_layers) if not args.is_full_attention(i)]
    return (outer_rules() + sandwich_norm_rules() + _attention_rules(args, sliding) + _attention_rules(args, full)
            + mlp_rules() + [Rule(LAYER + "layer_scalar", NATIVE + "layer_scalar")]
            + (per_layer_rules() if args.per_layer_dim else []) + (moe_rules(args) if args.moe_beside_mlp else [])
            + (gemma4_vision_rules(args.vision) if args.vision is not None else []))


# LoRA on the experts: PEFT's target_parameters on transformers' packed parameters (gate and up as halves)
EXPERT_PARAMETERS = {"experts_gate_up": LAYER + "experts.gate_up_proj", "experts_down": LAYER + "experts.down_proj"}

FAMILY = Family(
    name="gemma4", hf_model_types=("gemma4_text", "gemma4"), model_types=("GEMMA4",), architecture="Gemma4ForCausalLM",
    # Gemma4TextConfig's defaults (E2B's shape)
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                  num_key_value_heads=4, head_dim=256, sliding_window=512, final_logit_softcapping=None, attention_dropout=0.0,
                  vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
                  num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, num_experts=None,
                  top_k_experts=None, moe_intermediate_size=None, rope_parameters={
                      SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                      FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}),
    fixed=dict(attention_bias=False),
    model_args=model_args, hf_config=hf_config, rules=rules,
    lora_targets=LLAMA_LORA_TARGETS + ("input_gate", "input_proj") + tuple(EXPERT_PARAMETERS),
    lora_parameters=EXPERT_PARAMETERS, lora_halves=frozenset({"experts_gate_up"}),
    buffers=(r"\.layer_scalar$", *VISION_BUFFERS),
    hf_prefixes=({**MULTIMODAL, **VISION_PREFIXES},),
    # transformers' module names (an adapter's PEFT keys), the tower's too
    nested_modules={"model.": "model.language_model.", "vision_tower.": "model.vision_tower."},
    nested_config="text_config", vision=gemma4_vision,
)


# -- the published sizes: the text models of google/gemma-4-{E2B,E4B,26B-A4B,31B}(-it), their config.json's text_config
# (transformers' convert_gemma4_weights.py _VARIANTS, google-deepmind/gemma's gemma/gm/nn/gemma4/_gemma4.py) ----------

def _gemma4(pattern: int, **shape) -> Transformer:
    """What every release shares: full attention every ``pattern``-th layer (the last one included), 512-wide full heads
    with proportional RoPE (a quarter of their pairs turn, at base 1e6), sliding ones at base 1e4, logits capped at 30."""
    full = tuple(i for i in range(shape["n_layers"]) if (i + 1) % pattern == 0)
    return Transformer(ModelArgs(**{**dict(
        vocab_size=262144, head_dim=256, norm_eps=1e-6, max_seq_len=131072, tie_embeddings=True, activation="gelu_pytorch_tanh",
        embedding_scale=shape["dim"] ** 0.5, norm_fp32_weight=True, sandwich_norms=True, qk_norm=True, value_norm=True,
        attn_scale=1.0, final_softcap=30.0, layer_scalar=True, full_attention_layers=full, global_head_dim=512,
        rope_type="proportional", rope_theta=1e6, rope_factor=1.0, rope_proportion=0.25, local_rope_theta=10000.0), **shape}))


def gemma4_e2b() -> Transformer:
    """gemma-4-E2B: per-layer embeddings, four sliding layers to one full one, the last 20 layers kv-shared (and their
    MLPs double-wide)."""
    return _gemma4(5, dim=1536, n_layers=35, n_heads=8, n_kv_heads=1, hidden_dim=6144, sliding_window=512,
                   kv_shared_layers=20, double_wide_mlp=True, per_layer_dim=256, per_layer_vocab_size=262144)


def gemma4_e4b() -> Transformer:
    """gemma-4-E4B: per-layer embeddings, the last 18 layers kv-shared."""
    return _gemma4(6, dim=2560, n_layers=42, n_heads=8, n_kv_heads=2, hidden_dim=10240, sliding_window=512,
                   kv_shared_layers=18, per_layer_dim=256, per_layer_vocab_size=262144)


def gemma4_26b_a4b() -> Transformer:
    """gemma-4-26B-A4B: 128 experts (top 8, each 704 wide) beside every layer's 2112-wide dense MLP; the full layers'
    keys are their values, with 2 k/v heads."""
    return _gemma4(6, dim=2816, n_layers=30, n_heads=16, n_kv_heads=8, hidden_dim=2112, sliding_window=1024,
                   max_seq_len=262144, global_kv_heads=2, attn_k_eq_v=True, n_experts=128, experts_per_token=8,
                   expert_hidden_dim=704, moe_beside_mlp=True, routing="normed_softmax_topk", expert_weights_fp32=True)


def gemma4_31b() -> Transformer:
    """gemma-4-31B (dense): the full layers' keys are their values, with 4 k/v heads."""
    return _gemma4(6, dim=5376, n_layers=60, n_heads=32, n_kv_heads=16, hidden_dim=21504, sliding_window=1024,
                   max_seq_len=262144, global_kv_heads=4, attn_k_eq_v=True)
