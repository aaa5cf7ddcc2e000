"""Qwen3.5 / Qwen3.6 mixture of experts (``Qwen3_5MoeForCausalLM``, model_type ``qwen3_5_moe_text``; released as the
multimodal ``Qwen3_5MoeForConditionalGeneration``, model_type ``qwen3_5_moe``, e.g. Qwen3.6-35B-A3B): Qwen3.5's hybrid
layers (``qwen3_5``) with a mixture-of-experts MLP in every layer: softmax over the experts, top-k renormalised, plus a
shared expert scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE's). Both expert layouts load and are written back
as they came (packed ``experts.gate_up_proj``, the releases'; or per expert)."""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig, common_fields
from waypoint.families.hf_rules import LAYER
from waypoint.families.hybrid_rules import HYBRID_DEFAULTS, HYBRID_FIXED, LORA_TARGETS, hybrid_args, hybrid_fields, hybrid_rules
from waypoint.families.moe_rules import packed_rules, per_expert_rules
from waypoint.families.qwen2_moe import shared_expert_rules
from waypoint.families.qwen3_5 import MTP, NESTED_MODULES, QWEN_MULTIMODAL, VLLM_LORA_MODULES_QWEN3_5, _shape, vision_rules
from waypoint.families.qwen_vision_rules import qwen3_5_vision
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def moe_args(cfg: HFConfig, normalize: bool) -> dict:
    return dict(n_experts=cfg["num_experts"], experts_per_token=cfg["num_experts_per_tok"],
                expert_hidden_dim=cfg["moe_intermediate_size"], normalize_expert_weights=normalize,
                router_aux_loss_coef=float(cfg["router_aux_loss_coef"]),
                shared_expert_hidden_dim=cfg["shared_expert_intermediate_size"], shared_expert_gate=True)


def moe_fields(args: ModelArgs) -> dict:
    return {"num_experts": args.n_experts, "num_experts_per_tok": args.experts_per_token,
            "moe_intermediate_size": args.expert_hidden_dim, "shared_expert_intermediate_size": args.shared_expert_hidden_dim,
            "router_aux_loss_coef": args.router_aux_loss_coef}


def model_args(cfg: HFConfig) -> ModelArgs:
    # Qwen3_5MoeTextConfig has no intermediate_size (no layer is dense): the experts' width stands in for it
    cfg = HFConfig({**cfg.raw, "intermediate_size": cfg["moe_intermediate_size"]}, cfg.defaults)
    hybrid = hybrid_args(cfg, "qwen3_5_moe")
    return ModelArgs(**hybrid, **moe_args(cfg, normalize=True))  # its router always renormalises the top-k


def hf_config(args: ModelArgs) -> dict:
    fields = {**common_fields(args, FAMILY), **hybrid_fields(args), **moe_fields(args)}
    del fields["intermediate_size"]  # Qwen3_5MoeTextConfig has none: every layer is sparse
    return fields


# LoRA on the routed experts: PEFT's target_parameters on transformers' packed parameters (gate and up as halves)
EXPERT_PARAMETERS = {"experts_gate_up": LAYER + "mlp.experts.gate_up_proj", "experts_down": LAYER + "mlp.experts.down_proj"}


def expert_layouts(args: ModelArgs) -> dict:
    return {"packed": packed_rules(args), "per_expert": per_expert_rules(args, "mlp.", "gate_proj", "up_proj", "down_proj")}


FAMILY = Family(
    name="qwen3_5_moe", hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"), model_types=("QWEN3_5_MOE",),
    architecture="Qwen3_5MoeForCausalLM",
    defaults=dict(HYBRID_DEFAULTS, intermediate_size=None, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512, router_aux_loss_coef=0.001),
    fixed=HYBRID_FIXED,
    model_args=model_args, hf_config=hf_config, rules=lambda args: hybrid_rules(args) + shared_expert_rules() + vision_rules(args),
    layouts=expert_layouts, lora_targets=LORA_TARGETS + tuple(EXPERT_PARAMETERS), lora_parameters=EXPERT_PARAMETERS,
    lora_halves=frozenset({"experts_gate_up"}), hf_prefixes=(QWEN_MULTIMODAL,), nested_modules=NESTED_MODULES, nested_config="text_config",
    carried=lambda config: MTP, vision=qwen3_5_vision, vllm_lora_modules=VLLM_LORA_MODULES_QWEN3_5,
)


def qwen3_6_35b_a3b() -> Transformer:
    """Qwen3.5/3.6-35B-A3B's language model: 40 layers (30 Gated DeltaNet), 256 experts of 512, top-8, a shared expert."""
    return Transformer(ModelArgs(**_shape(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, hidden_dim=512),
                                 n_experts=256, experts_per_token=8, expert_hidden_dim=512, router_aux_loss_coef=0.001,
                                 shared_expert_hidden_dim=512, shared_expert_gate=True))
