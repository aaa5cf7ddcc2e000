"""Gemma (1) (``GemmaForCausalLM``): Llama's keys; (1 + w) norms computed in fp32, embeddings scaled by
sqrt(hidden_size), a gelu-tanh gate, a tied head and head_dim 256 (2B, 7B)."""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig, common_args, common_fields
from waypoint.families.hf_rules import llama_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def model_args(cfg: HFConfig) -> ModelArgs:
    if cfg.get("hidden_act") == "gelu":  # transformers' GemmaConfig: legacy "gelu" means the tanh approximation
        cfg = HFConfig({**cfg.raw, "hidden_act": "gelu_pytorch_tanh"}, cfg.defaults)
    return ModelArgs(**common_args(cfg, "gemma"), norm_plus_one=True, embedding_scale=cfg["hidden_size"] ** 0.5)


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation, "hidden_activation": args.activation}


FAMILY = Family(
    name="gemma", hf_model_types=("gemma",), model_types=("GEMMA",), architecture="GemmaForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                  num_key_value_heads=16, head_dim=256),
    fixed=dict(attention_bias=False, use_bidirectional_attention=False),
    model_args=model_args, rules=llama_rules, hf_config=hf_config,
)


def gemma_args(**shape) -> ModelArgs:
    return ModelArgs(**{**dict(vocab_size=256000, head_dim=256, norm_eps=1e-6, max_seq_len=8192, tie_embeddings=True,
                                norm_plus_one=True, embedding_scale=shape["dim"] ** 0.5, activation="gelu_pytorch_tanh"), **shape})


def gemma_2b() -> Transformer:
    return Transformer(gemma_args(dim=2048, n_layers=18, n_heads=8, n_kv_heads=1, hidden_dim=16384))


def gemma_7b() -> Transformer:
    return Transformer(gemma_args(dim=3072, n_layers=28, n_heads=16, n_kv_heads=16, hidden_dim=24576))
