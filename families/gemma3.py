"""Gemma 3, text (``Gemma3ForCausalLM``, model_type ``gemma3_text``): Gemma 2's layout plus q/k norms, five
sliding-window layers to one full one (``layer_types``, or v4's ``sliding_window_pattern``), and two RoPE
tables: a local base (default 10000) for sliding layers and the global base with its scaling (linear, factor 8
in the 4B+ models) for full ones. No soft-capping by default.

The multimodal repos (``Gemma3ForConditionalGeneration``, model_type ``gemma3``): the text model's keys sit under
``language_model.`` and its config under ``text_config``; the SigLIP vision tower and the projector load into the
native model too (``ModelArgs.vision``, :mod:`waypoint.families.vision_rules`), so it reads images, and are written
back in the files they came in (SigLIP's unused pooling head carried untouched)."""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.gemma import gemma_args
from waypoint.families.gemma2 import gemma_common, gemma_fields
from waypoint.families.hf_config import FULL, SLIDING, HFConfig, rope_fields, rope_params
from waypoint.families.hf_rules import attention_rules, mlp_rules, outer_rules, qk_norm_rules, sandwich_norm_rules
from waypoint.families.vision_rules import GEMMA3_PREFIXES, SIGLIP_HEAD, gemma3_projector_rules, gemma3_vision, siglip_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def model_args(cfg: HFConfig) -> ModelArgs:
    local = rope_params(cfg, SLIDING)
    per_type = isinstance((cfg.get("rope_parameters") or {}).get(SLIDING), dict)
    if per_type and local["rope_type"] != "default":
        raise ValueError(f"rope type {local['rope_type']!r} for sliding_attention layers is not supported (only default)")
    local_theta = float(local["rope_theta"] if per_type else cfg.get("rope_local_base_freq"))
    return ModelArgs(**gemma_common(cfg, "gemma3_text", pattern=int(cfg.get("sliding_window_pattern")), rope_layer_type=FULL),
                     qk_norm=True, local_rope_theta=local_theta,
                     # transformers' Gemma3Attention never passes attn_logit_softcapping on: it has no effect
                     final_softcap=cfg.get("final_logit_softcapping"))


def hf_config(args: ModelArgs) -> dict:
    fields = gemma_fields(args, FAMILY)
    fields["rope_parameters"] = {FULL: rope_fields(args), SLIDING: {"rope_type": "default", "rope_theta": args.local_rope_theta}}
    fields["rope_local_base_freq"] = args.local_rope_theta
    return fields


FAMILY = Family(
    name="gemma3", hf_model_types=("gemma3_text", "gemma3"), model_types=("GEMMA3",), architecture="Gemma3ForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                  num_key_value_heads=4, head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
                  attn_logit_softcapping=None, final_logit_softcapping=None, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                  sliding_window_pattern=6),
    fixed=dict(attention_bias=False, use_bidirectional_attention=False),
    model_args=model_args, hf_config=hf_config,
    rules=lambda args: (outer_rules() + sandwich_norm_rules() + attention_rules(args) + qk_norm_rules(args) + mlp_rules()
                        + (siglip_rules() + gemma3_projector_rules() if args.vision is not None else [])),
    # multimodal repos (gemma-3-4b and up, model_type gemma3): the text model under language_model., its config
    # under text_config, the vision tower and projector beside it
    hf_prefixes=GEMMA3_PREFIXES, nested_config="text_config", vision=gemma3_vision, carried=lambda config: SIGLIP_HEAD,
    # transformers 5's module names (an adapter's PEFT keys), the tower's and the projector's too
    nested_modules={"model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
                    "multi_modal_projector.": "model.multi_modal_projector."},
)


def _gemma3(scaled: bool, **shape) -> Transformer:
    n = shape["n_layers"]
    rope = dict(rope_type="linear", rope_factor=8.0) if scaled else {}
    shape.setdefault("vocab_size", 262208)
    return Transformer(gemma_args(**shape, max_seq_len=131072 if scaled else 32768, sandwich_norms=True,
                                  qk_norm=True, attn_scale=256 ** -0.5, sliding_window=1024 if scaled else 512,
                                  full_attention_layers=tuple(range(5, n, 6)), rope_theta=1000000.0, local_rope_theta=10000.0,
                                  **rope))


def gemma3_1b() -> Transformer:
    return _gemma3(False, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, hidden_dim=6912, vocab_size=262144)


def gemma3_4b() -> Transformer:
    """The text model of gemma-3-4b (its vision tower aside)."""
    return _gemma3(True, dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, hidden_dim=10240)
