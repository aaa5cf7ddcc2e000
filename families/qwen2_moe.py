"""Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, with
``qkv_bias``) with mixture-of-experts MLPs as Qwen3-MoE's (experts of width ``moe_intermediate_size``, softmax over
all, top-k, renormalised only with ``norm_topk_prob``; dense MLPs of ``intermediate_size`` in ``mlp_only_layers``
and all but every ``decoder_sparse_step``-th layer), plus in each MoE layer a shared expert: a dense gated MLP of
``shared_expert_intermediate_size`` on every token, times ``sigmoid(shared_expert_gate(x))``, added to the routed
experts' output (native ``moe.shared.{w1,w2,w3}`` and ``moe.shared_gate``: ``models.shared_expert``).

Its sliding window differs from Qwen2's: with ``use_sliding_window``, and without ``layer_types``, the even layers
below ``max_window_layers`` slide. Both on-disk expert layouts load and are written back as they came
(``moe_rules``: Qwen2-MoE's packed keys and shapes are Qwen3-MoE's). LoRA targets the attention, the head and the
``w1``/``w2``/``w3`` linears (the shared experts' and the dense layers': PEFT names them one to one), not the routed
experts."""

from __future__ import annotations

from waypoint.converters.table import Rule
from waypoint.families.family import Family
from waypoint.families.hf_config import FULL, SLIDING, HFConfig, common_args, common_fields, layer_types, layer_window_args
from waypoint.families.hf_rules import LAYER, NATIVE, at, attention_rules, mlp_rules, norm_rules, outer_rules, qkv_bias_rules
from waypoint.families.moe_rules import packed_rules, per_expert_rules
from waypoint.families.qwen3_moe import dense_layers
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer


def window_args(cfg: HFConfig, n_layers: int) -> dict:
    """Qwen2MoeConfig's window: only with use_sliding_window, on the layers layer_types marks (by default the
    even ones below max_window_layers)."""
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window") or window is None:
        return {}
    types = cfg.raw.get("layer_types")
    if types is None:
        first_full = cfg["max_window_layers"]
        types = [SLIDING if (i + 1) % 2 and i < first_full else FULL for i in range(n_layers)]
    return layer_window_args(window, types, n_layers)


def window_fields(args: ModelArgs) -> dict:
    types = layer_types(args)
    sliding = [i for i, t in enumerate(types) if t == SLIDING]
    return {"use_sliding_window": bool(sliding), "sliding_window": args.sliding_window, "layer_types": types,
            "max_window_layers": sliding[-1] + 1 if sliding else args.n_layers}


def model_args(cfg: HFConfig) -> ModelArgs:
    common = common_args(cfg, "qwen2_moe")
    n_layers = common["n_layers"]
    return ModelArgs(**common, qkv_bias=bool(cfg["qkv_bias"]), **window_args(cfg, n_layers), n_experts=cfg["num_experts"],
                     experts_per_token=cfg["num_experts_per_tok"], expert_hidden_dim=cfg["moe_intermediate_size"],
                     normalize_expert_weights=bool(cfg["norm_topk_prob"]), dense_layers=dense_layers(cfg, n_layers),
                     router_aux_loss_coef=float(cfg["router_aux_loss_coef"]),
                     shared_expert_hidden_dim=cfg["shared_expert_intermediate_size"], shared_expert_gate=True)


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation, **window_fields(args), "qkv_bias": args.qkv_bias,
            "num_experts": args.n_experts, "num_experts_per_tok": args.experts_per_token,
            "moe_intermediate_size": args.expert_hidden_dim, "norm_topk_prob": args.normalize_expert_weights,
            "shared_expert_intermediate_size": args.shared_expert_hidden_dim, "decoder_sparse_step": 1,
            "mlp_only_layers": list(args.dense_layers), "router_aux_loss_coef": args.router_aux_loss_coef}


def shared_expert_rules() -> list[Rule]:
    shared = LAYER + "mlp.shared_expert."
    return [Rule(shared + "gate_proj.weight", NATIVE + "moe.shared.w1.weight"),
            Rule(shared + "up_proj.weight", NATIVE + "moe.shared.w3.weight"),
            Rule(shared + "down_proj.weight", NATIVE + "moe.shared.w2.weight"),
            Rule(LAYER + "mlp.shared_expert_gate.weight", NATIVE + "moe.shared_gate.weight")]


def rules(args: ModelArgs) -> list[Rule]:
    dense = at(args.dense_layers, mlp_rules())
    return (outer_rules() + norm_rules() + attention_rules(args) + (qkv_bias_rules(args) if args.qkv_bias else [])
            + dense + shared_expert_rules())


FAMILY = Family(
    name="qwen2_moe", hf_model_types=("qwen2_moe",), model_types=("QWEN2_MOE",), architecture="Qwen2MoeForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                  num_key_value_heads=16, sliding_window=4096, use_sliding_window=False, max_window_layers=28,
                  attention_dropout=0.0, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                  router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=1408,
                  shared_expert_intermediate_size=5632, qkv_bias=True),
    model_args=model_args, rules=rules, hf_config=hf_config,
    layouts=lambda args: {"per_expert": per_expert_rules(args, "mlp.", "gate_proj", "up_proj", "down_proj"), "packed": packed_rules(args)},
)


def qwen1_5_moe_a2_7b() -> Transformer:
    """Qwen1.5-MoE-A2.7B: 60 experts of 1408, top-4 without renormalising, a shared expert of 5632 in all 24 layers."""
    return Transformer(ModelArgs(dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, vocab_size=151936, hidden_dim=5632,
                                 norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=8192, qkv_bias=True, n_experts=60,
                                 experts_per_token=4, expert_hidden_dim=1408, normalize_expert_weights=False,
                                 router_aux_loss_coef=0.001, shared_expert_hidden_dim=5632, shared_expert_gate=True))
