"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): fused ``qkv_proj`` and ``gate_up_proj``, split on load and fused
again on save; a sliding window on every layer where the config has one; residual dropout (``resid_pdrop``).

``qkv_proj`` holds the q, k and v rows one after another; q and k then go through the RoPE permutation.
``gate_up_proj`` holds the gate (native w1) rows, then the up (w3) rows. PEFT's modules are the fused ones,
so LoRA may target only ``output_proj``, ``w2`` and ``output`` here. Phi-4-mini's partial rotary factor and the long-context
``longrope`` variants are refused (one line naming the field)."""

from __future__ import annotations

from waypoint.converters.ops import Chain, Identity, PerTensor, Split
from waypoint.converters.table import Rule
from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig, common_args, common_fields
from waypoint.families.hf_rules import LAYER, NATIVE, k_permute, norm_rules, outer_rules, q_permute
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def model_args(cfg: HFConfig) -> ModelArgs:
    return ModelArgs(**common_args(cfg, "phi3", rope_types=("default",)), sliding_window=cfg.get("sliding_window"),
                     resid_dropout=float(cfg.get("resid_pdrop") or 0.0))


def rules(args: ModelArgs) -> list[Rule]:
    q_rows, kv_rows = args.n_heads * args.resolved_head_dim, args.n_kv_heads * args.resolved_head_dim
    qkv = Chain(Split((q_rows, kv_rows, kv_rows)), PerTensor(q_permute(args), k_permute(args), Identity()))
    attn = NATIVE + "attn."
    return outer_rules() + norm_rules() + [
        Rule(LAYER + "self_attn.qkv_proj.weight", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), qkv),
        Rule(LAYER + "self_attn.o_proj.weight", attn + "output_proj.weight"),
        Rule(LAYER + "mlp.gate_up_proj.weight", (NATIVE + "mlp.w1.weight", NATIVE + "mlp.w3.weight"),
             Split((args.hidden_dim, args.hidden_dim))),
        Rule(LAYER + "mlp.down_proj.weight", NATIVE + "mlp.w2.weight"),
    ]


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation, "sliding_window": args.sliding_window,
            "resid_pdrop": args.resid_dropout}


FAMILY = Family(
    name="phi3", hf_model_types=("phi3",), model_types=("PHI3", "PHI3_MINI", "PHI4"), architecture="Phi3ForCausalLM",
    defaults=dict(rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu", sliding_window=None),
    model_args=model_args, rules=rules, hf_config=hf_config, lora_targets=("output_proj", "w2", "output"),
)


def phi3_mini_4k() -> Transformer:
    return Transformer(ModelArgs(dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32064, hidden_dim=8192, norm_eps=1e-5,
                                 max_seq_len=4096, sliding_window=2047))


def phi4_14b() -> Transformer:
    """Phi-4 (14B): GQA with 10 kv heads, a 100352 vocabulary, rope base 250000, no sliding window."""
    return Transformer(ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, vocab_size=100352, hidden_dim=17920, norm_eps=1e-5,
                                 rope_theta=250000.0, max_seq_len=16384))
