"""Qwen3, dense (``Qwen3ForCausalLM``): Qwen2's layout without the qkv biases, with a per-head RMSNorm on q and
k (``self_attn.q_norm`` / ``k_norm``) before RoPE and an explicit ``head_dim``; the small sizes tie the head.

The norm weights take the RoPE permutation of the head's rows (``hf_rules.head_permute``): normalising a head
is the same in either order, scaling it element by element is not."""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig, common_args, common_fields
from waypoint.families.hf_rules import llama_rules, qk_norm_rules
from waypoint.families.qwen2 import qwen_window_args, qwen_window_fields
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def model_args(cfg: HFConfig) -> ModelArgs:
    common = common_args(cfg, "qwen3")
    return ModelArgs(**common, qk_norm=True, **qwen_window_args(cfg, common["n_layers"]))


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation, **qwen_window_fields(args)}


FAMILY = Family(
    name="qwen3", hf_model_types=("qwen3",), model_types=("QWEN3",), architecture="Qwen3ForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                  num_key_value_heads=32, head_dim=128, sliding_window=4096, use_sliding_window=False, max_window_layers=28),
    fixed=dict(attention_bias=False),
    model_args=model_args, rules=lambda args: llama_rules(args) + qk_norm_rules(args), hf_config=hf_config,
)


def qwen3_0_6b() -> Transformer:
    """Qwen3-0.6B: tied head, head_dim 128 while hidden_size / heads is 64."""
    return Transformer(ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, vocab_size=151936, hidden_dim=3072,
                                 norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=True, qk_norm=True))


def qwen3_8b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=151936, hidden_dim=12288,
                                 norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, qk_norm=True))
