"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norms) with mixture-of-experts MLPs of width
``moe_intermediate_size``: softmax over all experts, top-k, renormalised only with ``norm_topk_prob``. Layers in
``mlp_only_layers``, and all but every ``decoder_sparse_step``-th, keep a dense MLP of ``intermediate_size``.
Both on-disk expert layouts load and are written back as they came (``moe_rules``)."""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig, common_args, common_fields
from waypoint.families.hf_rules import at, attention_rules, mlp_rules, norm_rules, outer_rules, qk_norm_rules
from waypoint.families.mixtral import ATTENTION_TARGETS
from waypoint.families.moe_rules import packed_rules, per_expert_rules
from waypoint.families.qwen2 import qwen_window_args, qwen_window_fields
from waypoint.converters.table import Rule
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def dense_layers(cfg: HFConfig, n_layers: int) -> tuple[int, ...]:
    """transformers' rule: a layer is sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th."""
    step, only = cfg["decoder_sparse_step"], set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(n_layers) if i in only or not (step > 0 and (i + 1) % step == 0))


def model_args(cfg: HFConfig) -> ModelArgs:
    common = common_args(cfg, "qwen3_moe")
    n_experts = cfg.raw.get("num_experts") or cfg["num_local_experts"]  # v4 configs: num_experts
    return ModelArgs(**common, qk_norm=True, **qwen_window_args(cfg, common["n_layers"]), n_experts=n_experts,
                     experts_per_token=cfg["num_experts_per_tok"], expert_hidden_dim=cfg["moe_intermediate_size"],
                     normalize_expert_weights=bool(cfg["norm_topk_prob"]), dense_layers=dense_layers(cfg, common["n_layers"]),
                     router_aux_loss_coef=float(cfg["router_aux_loss_coef"]))


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation, **qwen_window_fields(args),
            "num_local_experts": args.n_experts, "num_experts_per_tok": args.experts_per_token,
            "moe_intermediate_size": args.expert_hidden_dim, "norm_topk_prob": args.normalize_expert_weights,
            "decoder_sparse_step": 1, "mlp_only_layers": list(args.dense_layers), "router_aux_loss_coef": args.router_aux_loss_coef}


def rules(args: ModelArgs) -> list[Rule]:
    dense = at(args.dense_layers, mlp_rules())
    return outer_rules() + norm_rules() + attention_rules(args) + qk_norm_rules(args) + dense


FAMILY = Family(
    name="qwen3_moe", hf_model_types=("qwen3_moe",), model_types=("QWEN3_MOE",), architecture="Qwen3MoeForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                  num_key_value_heads=4, head_dim=None, sliding_window=4096, use_sliding_window=False, max_window_layers=28,
                  num_local_experts=128, num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=0.001,
                  decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768),
    fixed=dict(attention_bias=False),
    model_args=model_args, rules=rules, hf_config=hf_config, lora_targets=ATTENTION_TARGETS,
    layouts=lambda args: {"per_expert": per_expert_rules(args, "mlp.", "gate_proj", "up_proj", "down_proj"), "packed": packed_rules(args)},
)


def qwen3_30b_a3b() -> Transformer:
    return Transformer(ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936, hidden_dim=6144,
                                 norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, qk_norm=True, n_experts=128,
                                 experts_per_token=8, expert_hidden_dim=768, normalize_expert_weights=True, router_aux_loss_coef=0.001))
