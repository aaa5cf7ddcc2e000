"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): Llama's keys plus biases on the q/k/v projections; the small
sizes (0.5B-3B) tie the head. A sliding window applies only with ``use_sliding_window``, to the layers
``layer_types`` marks (without it: the layers from ``max_window_layers`` on)."""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.hf_config import FULL, SLIDING, HFConfig, common_args, common_fields, layer_types, layer_window_args
from waypoint.families.hf_rules import llama_rules, qkv_bias_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def qwen_window_args(cfg: HFConfig, n_layers: int) -> dict:
    """Qwen2/Qwen3's sliding window: only with use_sliding_window, on the layers layer_types marks."""
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window") or window is None:
        return {}
    types = cfg.raw.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers")
        types = [SLIDING if i >= first else FULL for i in range(n_layers)]
    return layer_window_args(window, types, n_layers)


def qwen_window_fields(args: ModelArgs) -> dict:
    types = layer_types(args)
    return {"use_sliding_window": SLIDING in types, "sliding_window": args.sliding_window, "layer_types": types,
            "max_window_layers": types.index(SLIDING) if SLIDING in types else args.n_layers}


def model_args(cfg: HFConfig) -> ModelArgs:
    common = common_args(cfg, "qwen2")
    return ModelArgs(**common, qkv_bias=True, **qwen_window_args(cfg, common["n_layers"]))


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation, **qwen_window_fields(args)}


FAMILY = Family(
    name="qwen2", hf_model_types=("qwen2",), model_types=("QWEN2", "QWEN2_5"), architecture="Qwen2ForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                  num_key_value_heads=32, sliding_window=4096, use_sliding_window=False, max_window_layers=28),
    model_args=model_args, rules=lambda args: llama_rules(args) + qkv_bias_rules(args), hf_config=hf_config,
)


def qwen2_7b() -> Transformer:
    return Transformer(ModelArgs(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064, hidden_dim=18944, norm_eps=1e-6,
                                 rope_theta=1000000.0, max_seq_len=131072, qkv_bias=True))


def qwen2_5_0_5b() -> Transformer:
    """Qwen2.5-0.5B: tied head."""
    return Transformer(ModelArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, vocab_size=151936, hidden_dim=4864, norm_eps=1e-6,
                                 rope_theta=1000000.0, max_seq_len=32768, qkv_bias=True, tie_embeddings=True))


def qwen2_5_7b() -> Transformer:
    return Transformer(ModelArgs(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064, hidden_dim=18944, norm_eps=1e-6,
                                 rope_theta=1000000.0, max_seq_len=131072, qkv_bias=True))
