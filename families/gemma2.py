"""Gemma 2 (``Gemma2ForCausalLM``): Gemma's norms, embedding scale and activation, plus a norm after attention
and after the MLP (sandwich norms), attention-logit and final-logit soft-capping, a softmax scale of
``query_pre_attn_scalar ** -0.5``, and sliding-window layers alternating with full ones (``layer_types``)."""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.gemma import gemma_args
from waypoint.families.hf_config import FULL, SLIDING, HFConfig, common_args, common_fields, layer_types, layer_window_args
from waypoint.families.hf_rules import attention_rules, mlp_rules, outer_rules, sandwich_norm_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def gemma_common(cfg: HFConfig, model_type: str, pattern: int, rope_layer_type: str | None = None) -> dict:
    """What Gemma 2 and 3 read alike: ``layer_types`` (else every ``pattern``-th layer full), the scale, the norms."""
    cfg = HFConfig({**cfg.raw, "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act")}, cfg.defaults)
    n_layers = cfg["num_hidden_layers"]
    types = cfg.raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
    return dict(common_args(cfg, model_type, rope_layer_type=rope_layer_type), norm_plus_one=True,
                embedding_scale=cfg["hidden_size"] ** 0.5, sandwich_norms=True,
                attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
                **layer_window_args(cfg.get("sliding_window"), types, n_layers))


def model_args(cfg: HFConfig) -> ModelArgs:
    return ModelArgs(**gemma_common(cfg, "gemma2", pattern=2), attn_softcap=cfg.get("attn_logit_softcapping"),
                     final_softcap=cfg.get("final_logit_softcapping"))


def query_pre_attn_scalar(args: ModelArgs) -> int | float:
    """The attention scale as config.json gives it (``scale ** -2``): an int where it is one, as transformers 5's
    strict config classes take nothing else (Gemma3TextConfig: 32.0 is refused)."""
    value = round(args.attn_scale ** -2, 6)
    return int(value) if value == int(value) else value


def gemma_fields(args: ModelArgs, family: Family) -> dict:
    return {**common_fields(args, family), "hidden_activation": args.activation, "sliding_window": args.sliding_window,
            "layer_types": layer_types(args), "query_pre_attn_scalar": query_pre_attn_scalar(args),
            "attn_logit_softcapping": args.attn_softcap, "final_logit_softcapping": args.final_softcap}


FAMILY = Family(
    name="gemma2", hf_model_types=("gemma2",), model_types=("GEMMA2",), architecture="Gemma2ForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                  num_key_value_heads=4, head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    fixed=dict(attention_bias=False, use_bidirectional_attention=False),
    model_args=model_args, rules=lambda args: outer_rules() + sandwich_norm_rules() + attention_rules(args) + mlp_rules(),
    hf_config=lambda args: gemma_fields(args, FAMILY),
)


def _gemma2(**shape) -> Transformer:
    n_layers = shape["n_layers"]
    return Transformer(gemma_args(**shape, max_seq_len=8192, sandwich_norms=True, attn_softcap=50.0, final_softcap=30.0,
                                  sliding_window=4096, full_attention_layers=tuple(range(1, n_layers, 2))))


def gemma2_2b() -> Transformer:
    return _gemma2(dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, hidden_dim=9216, attn_scale=256 ** -0.5)


def gemma2_9b() -> Transformer:
    return _gemma2(dim=3584, n_layers=42, n_heads=16, n_kv_heads=8, hidden_dim=14336, attn_scale=256 ** -0.5)


def gemma2_27b() -> Transformer:
    return _gemma2(dim=4608, n_layers=46, n_heads=32, n_kv_heads=16, head_dim=128, hidden_dim=36864, attn_scale=144 ** -0.5)
