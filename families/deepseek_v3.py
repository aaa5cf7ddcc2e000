"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3, -R1, Kimi-K2-shaped configs): multi-head latent attention
(``models.mla``; ``q_lora_rank`` None: one q_proj), YaRN with ``mscale_all_dim`` also on the softmax scale, the first
``first_k_dense_replace`` layers dense and the others a mixture of ``n_routed_experts`` experts plus ``n_shared_experts``
shared ones (one ungated MLP ``n_shared_experts * moe_intermediate_size`` wide), routed by
``models.grouped_routing``'s ``sigmoid_grouped``: sigmoid scores, ``e_score_correction_bias`` added for choosing
only, the top-k within the ``topk_group`` best of ``n_group`` groups (each scored by its two best experts), the
unbiased scores renormalised with ``norm_topk_prob`` and times ``routed_scaling_factor``.

``rope_interleave`` (default true, DeepSeek's own checkpoints) says the rotary rows are in interleaved pairs, the
native layout; false: in halves, rotated as such by ``LatentAttention``. Both expert layouts load and are written back
as they came (``moe_rules``). ``num_key_value_heads`` is not read (every MLA head has its own key and value); the
multi-token-prediction layers (``num_nextn_predict_layers``) are not part of the native model: they are carried
untouched (``carried``), written back as they came.
"""

from __future__ import annotations

from waypoint.converters.table import Rule
from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig
from waypoint.families.mla_rules import MLA_LORA_TARGETS, deepseek_rules, mla_args, mla_fields
from waypoint.families.moe_rules import packed_rules, per_expert_rules
from waypoint.models.args import ModelArgs


def model_args(cfg: HFConfig) -> ModelArgs:
    n_group = cfg["n_group"] or 1
    return ModelArgs(**mla_args(cfg, "deepseek_v3"), rope_interleave=bool(cfg["rope_interleave"]), routing="sigmoid_grouped",
                     expert_groups=n_group, topk_groups=cfg["topk_group"] or n_group,
                     normalize_expert_weights=bool(cfg["norm_topk_prob"]))


def hf_config(args: ModelArgs) -> dict:
    return {**mla_fields(args, FAMILY), "rope_interleave": args.rope_interleave, "n_group": args.expert_groups,
            "topk_group": args.topk_groups, "norm_topk_prob": args.normalize_expert_weights, "num_nextn_predict_layers": 0}


def rules(args: ModelArgs) -> list[Rule]:
    return deepseek_rules(args)


FAMILY = Family(
    name="deepseek_v3", hf_model_types=("deepseek_v3",), model_types=("DEEPSEEK_V3",), architecture="DeepseekV3ForCausalLM",
    defaults=dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                  num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                  routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                  qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                  norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_interleave=True, attention_bias=False, attention_dropout=0.0),
    model_args=model_args, rules=rules, hf_config=hf_config, lora_targets=MLA_LORA_TARGETS,
    layouts=lambda args: {"per_expert": per_expert_rules(args, "mlp.", "gate_proj", "up_proj", "down_proj"), "packed": packed_rules(args)},
    carried=lambda config: mtp_layers(config), buffers=(r"\.e_score_correction_bias$",),
)


def mtp_layers(config) -> str | None:
    """The keys of the multi-token-prediction layers after the last one (V3 and R1 ship one: ``model.layers.61.*``),
    carried untouched through a fine-tune; None without them."""
    first = config.get("num_hidden_layers", FAMILY.defaults["num_hidden_layers"])
    count = config.get("num_nextn_predict_layers") or 0
    return rf"^model\.layers\.({'|'.join(str(first + i) for i in range(count))})\." if count else None
