"""DeepSeek-V2 (``DeepseekV2ForCausalLM``: DeepSeek-V2, -V2-Lite, -Coder-V2): multi-head latent attention as V3's
(``models.mla``; V2-Lite has no ``q_lora_rank``: one q_proj) with the rotary rows always in interleaved pairs, the
first ``first_k_dense_replace`` layers dense, the others ``n_routed_experts`` experts plus ``n_shared_experts``
shared ones (one ungated MLP), routed by ``models.grouped_routing``'s ``softmax_grouped``: a softmax over all
experts, the top-k (``topk_method`` greedy) or the top-k within the ``topk_group`` best of ``n_group`` groups, each
scored by its best expert (``group_limited_greedy``), times ``routed_scaling_factor``. transformers' V2 never
renormalises the top-k weights (its ``norm_topk_prob`` is read by no code), and neither does this family.
Both expert layouts load and are written back as they came (``moe_rules``).
"""

from __future__ import annotations

from waypoint.converters.table import Rule
from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig
from waypoint.families.mla_rules import MLA_LORA_TARGETS, deepseek_rules, mla_args, mla_fields
from waypoint.families.moe_rules import packed_rules, per_expert_rules
from waypoint.models.args import ModelArgs

TOPK_METHODS = ("greedy", "group_limited_greedy")


def model_args(cfg: HFConfig) -> ModelArgs:
    method = cfg["topk_method"]
    if method not in TOPK_METHODS:
        raise ValueError(f"topk_method={method!r} is not supported (supported: {', '.join(TOPK_METHODS)})")
    groups = (cfg["n_group"], cfg["topk_group"]) if method == "group_limited_greedy" else (1, 1)
    if None in groups:
        raise ValueError("topk_method='group_limited_greedy' needs n_group and topk_group")
    return ModelArgs(**mla_args(cfg, "deepseek_v2"), routing="softmax_grouped", expert_groups=groups[0],
                     topk_groups=groups[1], normalize_expert_weights=False)


def hf_config(args: ModelArgs) -> dict:
    grouped = args.expert_groups > 1
    return {**mla_fields(args, FAMILY), "topk_method": "group_limited_greedy" if grouped else "greedy",
            "n_group": args.expert_groups if grouped else None, "topk_group": args.topk_groups if grouped else None,
            "norm_topk_prob": False}


def rules(args: ModelArgs) -> list[Rule]:
    return deepseek_rules(args)


FAMILY = Family(
    name="deepseek_v2", hf_model_types=("deepseek_v2",), model_types=("DEEPSEEK_V2",), architecture="DeepseekV2ForCausalLM",
    defaults=dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attention_bias=False, attention_dropout=0.0, first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536,
                  n_group=None, n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  routed_scaling_factor=1.0, topk_group=None, topk_method="greedy", v_head_dim=128, num_experts_per_tok=None,
                  moe_intermediate_size=1407),
    fixed=dict(mlp_bias=False),
    model_args=model_args, rules=rules, hf_config=hf_config, lora_targets=MLA_LORA_TARGETS,
    layouts=lambda args: {"per_expert": per_expert_rules(args, "mlp.", "gate_proj", "up_proj", "down_proj"), "packed": packed_rules(args)},
)
