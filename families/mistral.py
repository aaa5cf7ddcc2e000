"""Mistral 7B and Mistral Nemo (``MistralForCausalLM``): Llama's keys with a sliding window on every layer
(v0.1) and, in Nemo, a head_dim of 128 independent of hidden_size / heads."""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig, common_args, common_fields
from waypoint.families.hf_rules import llama_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def model_args(cfg: HFConfig) -> ModelArgs:
    return ModelArgs(**common_args(cfg, "mistral", rope_types=("default", "yarn")), sliding_window=cfg.get("sliding_window"))


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation, "sliding_window": args.sliding_window}


FAMILY = Family(
    name="mistral", hf_model_types=("mistral",), model_types=("MISTRAL",), architecture="MistralForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=4096 * 32, tie_word_embeddings=False, hidden_act="silu",
                  num_key_value_heads=8, sliding_window=4096),
    model_args=model_args, rules=llama_rules, hf_config=hf_config,
)


def mistral_7b() -> Transformer:
    """Mistral-7B-v0.1 (v0.3: 32768 vocabulary, rope theta 1e6, no sliding window)."""
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, hidden_dim=14336,
                                 rope_theta=10000.0, max_seq_len=32768, sliding_window=4096))


def mistral_nemo_12b() -> Transformer:
    """Mistral-Nemo-Base-2407: head_dim 128 while hidden_size / heads is 160."""
    return Transformer(ModelArgs(dim=5120, n_layers=40, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=131072,
                                 hidden_dim=14336, rope_theta=1000000.0, max_seq_len=1024000))
