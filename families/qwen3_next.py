"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B): the hybrid layers of Qwen3.5 (``qwen3_5``) before their
projections were split: each Gated DeltaNet's ``in_proj_qkvz`` and ``in_proj_ba`` fuse q, k, v, z (and b, a) per key
head, which the converter splits into the native ``in_proj_qkv``/``in_proj_z`` (``in_proj_b``/``in_proj_a``) and
fuses back on save. Mixture-of-experts MLPs as Qwen3.5-MoE's, renormalised only with ``norm_topk_prob``; layers in
``mlp_only_layers`` (and all but every ``decoder_sparse_step``-th) keep a dense MLP. LoRA cannot target the fused
projections (PEFT would adapt q, k, v and z as one module), the rest as Qwen3.5's."""

from __future__ import annotations

from waypoint.families.family import VLLM_LORA_MODULES, Family
from waypoint.families.hf_config import HFConfig, common_fields
from waypoint.families.hf_rules import at, mlp_rules
from waypoint.families.hybrid_rules import HYBRID_DEFAULTS, HYBRID_FIXED, LORA_TARGETS, hybrid_args, hybrid_fields, hybrid_rules
from waypoint.families.qwen2_moe import shared_expert_rules
from waypoint.families.qwen3_5 import MTP
from waypoint.families.qwen3_5_moe import EXPERT_PARAMETERS, expert_layouts, moe_args, moe_fields
from waypoint.families.qwen3_moe import dense_layers
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def model_args(cfg: HFConfig) -> ModelArgs:
    hybrid = hybrid_args(cfg, "qwen3_next")
    return ModelArgs(**hybrid, **moe_args(cfg, normalize=bool(cfg["norm_topk_prob"])),
                     dense_layers=dense_layers(cfg, hybrid["n_layers"]) if cfg["num_experts"] else ())


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), **hybrid_fields(args), **moe_fields(args), "norm_topk_prob": args.normalize_expert_weights,
            "decoder_sparse_step": 1, "mlp_only_layers": list(args.dense_layers)}


def rules(args: ModelArgs) -> list:
    return hybrid_rules(args, fused=True) + at(args.dense_layers, mlp_rules()) + shared_expert_rules()

# vLLM's Qwen3-Next (vllm/model_executor/models/qwen3_next.py) serves the Gated DeltaNet's fused in_proj_qkvz and
# in_proj_ba as they are (its packed_modules_mapping maps each to itself) and out_proj, beside Llama's modules
VLLM_LORA_MODULES_QWEN3_NEXT = VLLM_LORA_MODULES | {"in_proj_qkvz", "in_proj_ba", "out_proj"}

FAMILY = Family(
    name="qwen3_next", hf_model_types=("qwen3_next",), model_types=("QWEN3_NEXT",), architecture="Qwen3NextForCausalLM",
    defaults=dict(HYBRID_DEFAULTS, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512, norm_topk_prob=True, router_aux_loss_coef=0.001, decoder_sparse_step=1,
                  mlp_only_layers=[], intermediate_size=5632),
    fixed=HYBRID_FIXED,
    model_args=model_args, hf_config=hf_config, rules=rules, layouts=expert_layouts,
    lora_targets=tuple(t for t in LORA_TARGETS if t not in ("in_proj_qkv", "in_proj_z")) + tuple(EXPERT_PARAMETERS),
    lora_parameters=EXPERT_PARAMETERS, lora_halves=frozenset({"experts_gate_up"}), carried=lambda config: MTP,
    vllm_lora_modules=VLLM_LORA_MODULES_QWEN3_NEXT,
)


def qwen3_next_80b_a3b() -> Transformer:
    """Qwen3-Next-80B-A3B: 48 layers (36 Gated DeltaNet), 512 experts of 512, top-10, a shared expert."""
    return Transformer(ModelArgs(dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, hidden_dim=5632, vocab_size=151936,
                                 head_dim=256, norm_eps=1e-6, rope_theta=10000000.0, max_seq_len=262144, norm_plus_one=True,
                                 qk_norm=True, attn_output_gate=True, rope_interleave=False, partial_rotary_factor=0.25,
                                 linear_attention_layers=tuple(i for i in range(48) if (i + 1) % 4), linear_key_heads=16,
                                 linear_value_heads=32, n_experts=512, experts_per_token=10, expert_hidden_dim=512,
                                 router_aux_loss_coef=0.001, shared_expert_hidden_dim=512, shared_expert_gate=True))
