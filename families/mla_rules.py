"""What DeepSeek-V2 and -V3 share (``deepseek_v2``, ``deepseek_v3``): config.json's latent attention and expert
fields -> ModelArgs and back, and the rule pieces of their checkpoints.

Native keys (``models.mla`` for the attention, ``models.moe`` / ``models.shared_expert`` for the MoE layers)::

    model.layers.{i}.self_attn.q_proj.weight              layers.{i}.attn.q_proj.weight      (without q_lora_rank)
    model.layers.{i}.self_attn.q_a_proj.weight            layers.{i}.attn.q_a_proj.weight
    model.layers.{i}.self_attn.q_a_layernorm.weight       layers.{i}.attn.q_a_norm.weight
    model.layers.{i}.self_attn.q_b_proj.weight            layers.{i}.attn.q_b_proj.weight
    model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight  layers.{i}.attn.kv_a_proj.weight
    model.layers.{i}.self_attn.kv_a_layernorm.weight      layers.{i}.attn.kv_a_norm.weight
    model.layers.{i}.self_attn.kv_b_proj.weight           layers.{i}.attn.kv_b_proj.weight
    model.layers.{i}.self_attn.o_proj.weight              layers.{i}.attn.output_proj.weight
    (attention_bias: q_a_proj.bias, kv_a_proj_with_mqa.bias, o_proj.bias likewise)
    model.layers.{i}.mlp.gate.weight                      layers.{i}.moe.router.weight
    model.layers.{i}.mlp.gate.e_score_correction_bias     layers.{i}.moe.router.e_score_correction_bias   (V3)
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight   layers.{i}.moe.shared.{w1,w3,w2}.weight
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight      layers.{i}.moe.{w1,w3,w2} (stacked; or packed keys)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight       layers.{i}.mlp.{w1,w3,w2}.weight   (the first_k_dense_replace)

Every tensor is a plain rename: the rotary rows are used in the checkpoint's own order (``models.mla``). DeepSeek-V3's
multi-token-prediction layers (``model.layers.{num_hidden_layers}.*``) are the checkpointer's business, not these rules'.
"""

from __future__ import annotations

from typing import Any

from waypoint.converters.table import Rule
from waypoint.families.hf_config import HFConfig, common_args, common_fields
from waypoint.families.hf_rules import LAYER, NATIVE, at, mlp_rules, norm_rules, outer_rules
from waypoint.models.args import ModelArgs

ATTN, SELF = NATIVE + "attn.", LAYER + "self_attn."
# LoRA: every attention projection (PEFT names each one-to-one) and the head; not the experts
MLA_LORA_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "output_proj", "output")


def mla_args(cfg: HFConfig, model_type: str) -> dict[str, Any]:
    """The ModelArgs fields V2 and V3 read alike: shapes, rope (its dims the rotary part), the latent attention, the
    dense layers and the experts' shapes. ``num_key_value_heads`` is not read: MLA has a key and a value per head."""
    common = common_args(cfg, model_type, rope_types=("default", "yarn"))
    bias = bool(cfg["attention_bias"])
    n_experts = cfg.raw.get("num_local_experts") or cfg.raw.get("num_experts") or cfg["n_routed_experts"]  # the aliases
    n_layers = common["n_layers"]
    return dict(common, head_dim=cfg["qk_rope_head_dim"], n_kv_heads=common["n_heads"], kv_lora_rank=cfg["kv_lora_rank"],
                q_lora_rank=cfg.get("q_lora_rank"), qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"],
                qkv_bias=bias, attn_output_bias=bias, n_experts=n_experts, experts_per_token=cfg["num_experts_per_tok"],
                expert_hidden_dim=cfg["moe_intermediate_size"], expert_weights_fp32=True,
                dense_layers=tuple(range(min(cfg["first_k_dense_replace"] or 0, n_layers))),
                shared_expert_hidden_dim=cfg["moe_intermediate_size"] * cfg["n_shared_experts"] if cfg["n_shared_experts"] else None,
                routed_scaling=float(cfg["routed_scaling_factor"]))


def mla_fields(args: ModelArgs, family) -> dict[str, Any]:
    """config.json's fields for ``mla_args``'s ModelArgs (``num_key_value_heads``: n_heads)."""
    first_dense = len(args.dense_layers)
    if args.dense_layers != tuple(range(first_dense)):
        raise ValueError(f"dense layers {args.dense_layers} are not the first ones (first_k_dense_replace)")
    shared = args.shared_expert_hidden_dim or 0
    if shared % (args.expert_hidden_dim or args.hidden_dim):
        raise ValueError(f"shared_expert_hidden_dim={shared} is not a whole number of experts' widths")
    return {**common_fields(args, family), "hidden_act": args.activation, "attention_bias": args.qkv_bias,
            "kv_lora_rank": args.kv_lora_rank, "q_lora_rank": args.q_lora_rank, "qk_rope_head_dim": args.resolved_head_dim,
            "qk_nope_head_dim": args.qk_nope_head_dim, "v_head_dim": args.v_head_dim, "n_routed_experts": args.n_experts,
            "num_experts_per_tok": args.experts_per_token, "moe_intermediate_size": args.expert_hidden_dim,
            "first_k_dense_replace": first_dense, "n_shared_experts": shared // (args.expert_hidden_dim or args.hidden_dim),
            "routed_scaling_factor": args.routed_scaling}


def attention_rules(args: ModelArgs) -> list[Rule]:
    if args.q_lora_rank is None:
        query = [Rule(SELF + "q_proj.weight", ATTN + "q_proj.weight")]
    else:
        query = [Rule(SELF + "q_a_proj.weight", ATTN + "q_a_proj.weight"),
                 Rule(SELF + "q_a_layernorm.weight", ATTN + "q_a_norm.weight"),
                 Rule(SELF + "q_b_proj.weight", ATTN + "q_b_proj.weight")]
    rules = query + [Rule(SELF + "kv_a_proj_with_mqa.weight", ATTN + "kv_a_proj.weight"),
                     Rule(SELF + "kv_a_layernorm.weight", ATTN + "kv_a_norm.weight"),
                     Rule(SELF + "kv_b_proj.weight", ATTN + "kv_b_proj.weight"),
                     Rule(SELF + "o_proj.weight", ATTN + "output_proj.weight")]
    if args.qkv_bias:  # attention_bias: q_a_proj (q_proj has none), kv_a_proj_with_mqa, o_proj
        rules += [Rule(SELF + "kv_a_proj_with_mqa.bias", ATTN + "kv_a_proj.bias"), Rule(SELF + "o_proj.bias", ATTN + "output_proj.bias")]
        rules += [Rule(SELF + "q_a_proj.bias", ATTN + "q_a_proj.bias")] if args.q_lora_rank is not None else []
    return rules


def deepseek_rules(args: ModelArgs) -> list[Rule]:
    """Everything but the experts' own weights and the router (``moe_rules``' layouts)."""
    dense = at(args.dense_layers, mlp_rules())
    shared = LAYER + "mlp.shared_experts."
    shared_rules = [Rule(shared + "gate_proj.weight", NATIVE + "moe.shared.w1.weight"),
                    Rule(shared + "up_proj.weight", NATIVE + "moe.shared.w3.weight"),
                    Rule(shared + "down_proj.weight", NATIVE + "moe.shared.w2.weight")] if args.shared_expert_hidden_dim else []
    bias = [Rule(LAYER + "mlp.gate.e_score_correction_bias", NATIVE + "moe.router.e_score_correction_bias")] \
        if args.routing == "sigmoid_grouped" else []
    return outer_rules() + norm_rules() + attention_rules(args) + dense + shared_rules + bias
