"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a mixture-of-experts MLP in every layer: a router
picks ``num_experts_per_tok`` of ``num_local_experts`` experts per token (softmax over all, top-k, renormalised,
the weights kept in fp32);
``router_aux_loss_coef`` weighs the load-balancing loss added in training. Both on-disk expert layouts load
and are written back as they came (``moe_rules``). LoRA targets the attention projections only."""

from __future__ import annotations

from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig, common_args, common_fields
from waypoint.families.hf_rules import attention_rules, norm_rules, outer_rules
from waypoint.families.moe_rules import packed_rules, per_expert_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "output_proj", "output")  # and the head; not the experts


def model_args(cfg: HFConfig) -> ModelArgs:
    return ModelArgs(**common_args(cfg, "mixtral", rope_types=("default", "yarn")), sliding_window=cfg.get("sliding_window"),
                     n_experts=cfg["num_local_experts"], experts_per_token=cfg["num_experts_per_tok"], expert_weights_fp32=True,
                     router_aux_loss_coef=float(cfg["router_aux_loss_coef"]))


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation, "sliding_window": args.sliding_window,
            "num_local_experts": args.n_experts, "num_experts_per_tok": args.experts_per_token,
            "router_aux_loss_coef": args.router_aux_loss_coef}


FAMILY = Family(
    name="mixtral", hf_model_types=("mixtral",), model_types=("MIXTRAL",), architecture="MixtralForCausalLM",
    defaults=dict(rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, tie_word_embeddings=False, hidden_act="silu",
                  num_key_value_heads=8, sliding_window=None, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2,
                  router_aux_loss_coef=0.001),
    fixed=dict(router_jitter_noise=0.0),
    model_args=model_args, rules=lambda args: outer_rules() + norm_rules() + attention_rules(args), hf_config=hf_config,
    layouts=lambda args: {"per_expert": per_expert_rules(args, "block_sparse_moe.", "w1", "w3", "w2"), "packed": packed_rules(args)},
    lora_targets=ATTENTION_TARGETS,
)


def mixtral_8x7b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, hidden_dim=14336, norm_eps=1e-5,
                                 rope_theta=1000000.0, max_seq_len=32768, n_experts=8, experts_per_token=2, expert_weights_fp32=True,
                                 router_aux_loss_coef=0.02))
