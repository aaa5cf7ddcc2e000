"""gpt-oss (``GptOssForCausalLM``, openai/gpt-oss-20b and -120b): Llama's block with biases on every attention
projection, a learned sink logit per head in each softmax's denominator, sliding-window (128) layers alternating
with full ones (``layer_types``), YaRN RoPE, and a mixture-of-experts MLP in every layer whose router has a bias
and takes the top-k logits before a softmax over them, whose experts have biases and a clamped SwiGLU
(``swiglu_limit``, ``swiglu_alpha``: ``(up + 1) * gate * sigmoid(alpha * gate)``).

Two on-disk expert layouts, each loaded and written back as it came:

- ``mxfp4`` (the releases): ``mlp.experts.gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` /
  ``_scales``, FP4 values in blocks of 32 along the input features (``converters.mxfp4``); dequantized they are
  ``[E, 2I, H]`` (gate and up rows interleaved) and ``[E, H, I]``, the native orientation;
- ``dense`` (transformers' ``save_pretrained`` of a dequantized model): ``mlp.experts.gate_up_proj [E, H, 2I]``
  (gate and up interleaved on the last dim) and ``down_proj [E, I, H]``, transposed from the native ``[E, out, in]``.

The biases (``gate_up_proj_bias [E, 2I]``, interleaved the same way, and ``down_proj_bias``) are bf16 in both.
"""

from __future__ import annotations

from waypoint.converters.mxfp4 import MXFP4
from waypoint.converters.ops import Chain, Interleave, Transpose
from waypoint.converters.table import Rule
from waypoint.families.family import Family
from waypoint.families.hf_config import FULL, SLIDING, HFConfig, common_args, common_fields, layer_types, layer_window_args
from waypoint.families.hf_rules import LAYER, NATIVE, attention_rules, norm_rules, outer_rules, qkv_bias_rules
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer

EXPERTS, MOE = LAYER + "mlp.experts.", NATIVE + "moe."
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "output_proj", "output")
# LoRA on the experts, as PEFT's target_parameters (GptOssExperts registers gate_up_proj first)
EXPERT_PARAMETERS = {"experts_gate_up": LAYER + "mlp.experts.gate_up_proj", "experts_down": LAYER + "mlp.experts.down_proj"}


def model_args(cfg: HFConfig) -> ModelArgs:
    n_layers = cfg["num_hidden_layers"]
    types = cfg.raw.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n_layers)]
    bias = bool(cfg["attention_bias"])
    return ModelArgs(**common_args(cfg, "gpt_oss", rope_types=("default", "yarn")),
                     **layer_window_args(cfg.get("sliding_window"), types, n_layers),
                     qkv_bias=bias, attn_output_bias=bias, attn_sinks=True, n_experts=cfg["num_local_experts"],
                     experts_per_token=cfg["num_experts_per_tok"], router_bias=True, expert_bias=True, routing="topk_softmax",
                     swiglu_limit=float(cfg["swiglu_limit"]), swiglu_alpha=float(cfg["swiglu_alpha"]),
                     router_aux_loss_coef=float(cfg["router_aux_loss_coef"]))


def hf_config(args: ModelArgs) -> dict:
    return {**common_fields(args, FAMILY), "hidden_act": args.activation, "sliding_window": args.sliding_window,
            "layer_types": layer_types(args), "attention_bias": args.qkv_bias, "num_local_experts": args.n_experts,
            "num_experts_per_tok": args.experts_per_token, "swiglu_limit": args.swiglu_limit,
            "swiglu_alpha": args.swiglu_alpha, "router_aux_loss_coef": args.router_aux_loss_coef}


def rules(args: ModelArgs) -> list[Rule]:
    attention = [Rule(LAYER + "self_attn.o_proj.bias", NATIVE + "attn.output_proj.bias"),
                 Rule(LAYER + "self_attn.sinks", NATIVE + "attn.sinks")] if args.attn_output_bias else \
        [Rule(LAYER + "self_attn.sinks", NATIVE + "attn.sinks")]
    return (outer_rules() + norm_rules() + attention_rules(args) + (qkv_bias_rules(args) if args.qkv_bias else [])
            + attention + [Rule(LAYER + "mlp.router.weight", MOE + "router.weight"),
                           Rule(LAYER + "mlp.router.bias", MOE + "router.bias"),
                           Rule(EXPERTS + "gate_up_proj_bias", (MOE + "b1", MOE + "b3"), Interleave(2, dim=1)),
                           Rule(EXPERTS + "down_proj_bias", MOE + "b2")])


def layouts(args: ModelArgs) -> dict[str, list[Rule]]:
    # dense first: what a model written without a source checkpoint takes (MXFP4 blocks need a quantization_config)
    return {
        "dense": [Rule(EXPERTS + "gate_up_proj", (MOE + "w1", MOE + "w3"), Chain(Transpose((1, 2)), Interleave(2, dim=1))),
                  Rule(EXPERTS + "down_proj", MOE + "w2", Transpose((1, 2)))],
        "mxfp4": [Rule((EXPERTS + "gate_up_proj_blocks", EXPERTS + "gate_up_proj_scales"), (MOE + "w1", MOE + "w3"),
                       Chain(MXFP4(), Interleave(2, dim=1))),
                  Rule((EXPERTS + "down_proj_blocks", EXPERTS + "down_proj_scales"), MOE + "w2", MXFP4())],
    }


FAMILY = Family(
    name="gpt_oss", hf_model_types=("gpt_oss",), model_types=("GPT_OSS",), architecture="GptOssForCausalLM",
    defaults=dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                  head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128, tie_word_embeddings=False,
                  hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, attention_dropout=0.0,
                  num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, router_aux_loss_coef=0.001,
                  attention_bias=True, rope_theta=150000.0,
                  rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 4096}),
    model_args=model_args, rules=rules, hf_config=hf_config, layouts=layouts,
    lora_targets=ATTENTION_TARGETS + tuple(EXPERT_PARAMETERS), lora_parameters=EXPERT_PARAMETERS,
)


def _gpt_oss(n_layers: int, n_experts: int) -> Transformer:
    shape = {**FAMILY.defaults, "num_hidden_layers": n_layers, "num_local_experts": n_experts}  # the released configs
    return Transformer(model_args(HFConfig(shape, FAMILY.defaults)))


def gpt_oss_20b() -> Transformer:
    return _gpt_oss(24, 32)


def gpt_oss_120b() -> Transformer:
    return _gpt_oss(36, 128)
