"""Qwen3.5 / Qwen3.6, dense (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``; the releases are multimodal
``Qwen3_5ForConditionalGeneration`` repos, model_type ``qwen3_5``): three Gated DeltaNet layers to one gated
full-attention layer (``layer_types``), zero-centred RMSNorms, RoPE on a quarter of each head (mRoPE in the releases,
which for text is the same rotation), a dense SwiGLU MLP in every layer (``hybrid_rules``).

A multimodal repo (its config under ``text_config``) loads whole: ``model.language_model.*`` (and ``lm_head``), and the
vision tower ``model.visual.*`` into the native model's ``vision.*`` (``families.qwen_vision_rules``), so that it
reads images (mRoPE positions for their tokens, ``models.mrope``); the multi-token-prediction layers ``mtp.*`` are
written back untouched, in the files they came in."""

from __future__ import annotations

from waypoint.families.family import VLLM_LORA_MODULES, Family
from waypoint.families.hf_config import HFConfig, common_fields
from waypoint.families.hf_rules import mlp_rules
from waypoint.families.hybrid_rules import HYBRID_DEFAULTS, HYBRID_FIXED, LORA_TARGETS, hybrid_args, hybrid_fields, hybrid_rules
from waypoint.families.qwen_vision_rules import qwen3_5_vision, qwen_vision_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer

MULTIMODAL = {"model.language_model.": "model.", "lm_head.": "lm_head."}  # the text model's keys in the releases
QWEN_MULTIMODAL = {**MULTIMODAL, "model.visual.": "visual."}  # and the vision tower's (families.qwen_vision_rules)
NESTED_MODULES = {"model.": "model.language_model.", "visual.": "model.visual."}  # transformers 5's module names
MTP = r"^mtp\."  # the multi-token-prediction layers transformers does not load: carried through untouched
# vLLM's Qwen3.5 (vllm/model_executor/models/qwen3_5.py, dense and MoE) with LoRA on keeps the Gated DeltaNet's
# in_proj_qkv and in_proj_z apart (fused into in_proj_qkvz only without LoRA), packs in_proj_b and in_proj_a into
# in_proj_ba, and serves out_proj: adapters on those load and apply, beside Llama's modules
VLLM_LORA_MODULES_QWEN3_5 = VLLM_LORA_MODULES | {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}


def model_args(cfg: HFConfig) -> ModelArgs:
    return ModelArgs(**hybrid_args(cfg, "qwen3_5"))


def vision_rules(args: ModelArgs) -> list:
    """The vision tower's rules, for a model that has one (a multimodal repo's)."""
    return qwen_vision_rules(args.vision) if args.vision is not None else []


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), **hybrid_fields(args)}


FAMILY = Family(
    name="qwen3_5", hf_model_types=("qwen3_5_text", "qwen3_5"), model_types=("QWEN3_5",), architecture="Qwen3_5ForCausalLM",
    defaults=dict(HYBRID_DEFAULTS, num_key_value_heads=4),
    fixed=HYBRID_FIXED,
    model_args=model_args, hf_config=hf_config, rules=lambda args: hybrid_rules(args) + mlp_rules() + vision_rules(args),
    lora_targets=LORA_TARGETS, hf_prefixes=(QWEN_MULTIMODAL,), nested_modules=NESTED_MODULES, nested_config="text_config", carried=lambda config: MTP,
    vision=qwen3_5_vision, vllm_lora_modules=VLLM_LORA_MODULES_QWEN3_5,
)


def qwen3_5_27b() -> Transformer:
    """Qwen3.5-27B / Qwen3.6-27B's language model: 64 layers (48 Gated DeltaNet, 16 gated attention)."""
    return Transformer(ModelArgs(**_shape(dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, hidden_dim=17408,
                                          linear_value_heads=48)))


def _shape(n_layers: int, **shape) -> dict:
    return dict(n_layers=n_layers, vocab_size=248320, head_dim=256, norm_eps=1e-6, rope_theta=10000000.0, max_seq_len=262144,
                norm_plus_one=True, qk_norm=True, attn_output_gate=True, rope_interleave=False, partial_rotary_factor=0.25,
                linear_attention_layers=tuple(i for i in range(n_layers) if (i + 1) % 4), linear_key_heads=16,
                linear_key_head_dim=128, linear_value_head_dim=128, **{"linear_value_heads": 32, **shape})
