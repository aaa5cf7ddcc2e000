"""Llama 2, 3, 3.1, 3.2 and 3.3 (``LlamaForCausalLM``): the reference layout the other families vary.

Llama 3.1+ scales RoPE frequencies (``rope_type: llama3``); Llama 3.2 1B/3B tie the output head to the
embedding (no ``lm_head.weight`` on disk).
"""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig, common_args, common_fields
from waypoint.families.hf_rules import llama_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def model_args(cfg: HFConfig) -> ModelArgs:
    return ModelArgs(**common_args(cfg, "llama"))


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation}


def model_type_of(cfg: HFConfig) -> str:
    """LLAMA2, LLAMA3 (a 128K vocabulary or rope base 500000) or LLAMA3_2 (Llama 3 with a tied head)."""
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta")) if isinstance(rope, dict) else cfg.get("rope_theta")
    llama3 = cfg.get("vocab_size", 0) >= 128000 or (theta or 0) >= 500000
    return ("LLAMA3_2" if cfg.get("tie_word_embeddings") else "LLAMA3") if llama3 else "LLAMA2"


FAMILY = Family(
    name="llama", hf_model_types=("llama",), model_types=("LLAMA2", "LLAMA3", "LLAMA3_2", "LLAMA3_3"),
    architecture="LlamaForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False, hidden_act="silu"),
    fixed=dict(attention_bias=False, mlp_bias=False),
    model_args=model_args, rules=llama_rules, hf_config=hf_config, model_type_of=model_type_of,
)


def llama2_7b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, hidden_dim=11008, max_seq_len=4096))


def llama2_13b() -> Transformer:
    return Transformer(ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, hidden_dim=13824, max_seq_len=4096))


def llama2_70b() -> Transformer:
    return Transformer(ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, hidden_dim=28672, max_seq_len=4096))


def llama3_8b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=14336,
                                 rope_theta=500000.0, max_seq_len=8192))


def llama3_1_8b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=14336,
                                 **LLAMA31_ROPE))


def llama3_2_1b() -> Transformer:
    """Llama-3.2-1B: tied embeddings, rope factor 32."""
    return Transformer(ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=8192,
                                 head_dim=64, tie_embeddings=True, **{**LLAMA31_ROPE, "rope_factor": 32.0}))


def llama3_2_3b() -> Transformer:
    """Llama-3.2-3B: tied embeddings, rope factor 32."""
    return Transformer(ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, hidden_dim=8192,
                                 head_dim=128, tie_embeddings=True, **{**LLAMA31_ROPE, "rope_factor": 32.0}))


def llama3_3_70b() -> Transformer:
    return Transformer(ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, hidden_dim=28672,
                                 **LLAMA31_ROPE))


LLAMA31_ROPE = dict(rope_theta=500000.0, max_seq_len=131072, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_max_seq_len=8192)
