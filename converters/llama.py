"""The Llama table (Llama 2/3/3.1, Mistral, Gemma): HF ``LlamaForCausalLM`` keys <-> native keys.

Mistral and Gemma checkpoints have exactly Llama's keys; what differs (sliding window, Gemma's norm,
embedding scale and activation) lives in the ModelArgs read from config.json, not in the table.
The pieces are shared with the Qwen2 and Phi-3 tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waypoint.converters.errors import CheckpointError
from waypoint.converters.ops import RopePermute
from waypoint.converters.table import Converter, Rule
from waypoint.models.builders import model_args_from_hf_config
from waypoint.models.transformer import ModelArgs

LAYER, NATIVE = "model.layers.{i}.", "layers.{i}."
IGNORE = (r"(^|\.)rotary_emb\.inv_freq$",)


def model_args(config: Mapping[str, Any]) -> ModelArgs:
    """The config's ModelArgs; what the native model cannot represent is a one-line CheckpointError."""
    try:
        return model_args_from_hf_config(config)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"config.json: {e.args[0] if e.args else e}") from e


def q_permute(args: ModelArgs) -> RopePermute:
    return RopePermute(args.n_heads, args.resolved_head_dim)


def k_permute(args: ModelArgs) -> RopePermute:
    return RopePermute(args.n_kv_heads, args.resolved_head_dim)


def outer_rules() -> list[Rule]:
    """Embedding, final norm and output head."""
    return [
        Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", "output.weight"),
    ]


def norm_rules() -> list[Rule]:
    return [
        Rule(LAYER + "input_layernorm.weight", NATIVE + "sa_norm.weight"),
        Rule(LAYER + "post_attention_layernorm.weight", NATIVE + "mlp_norm.weight"),
    ]


def attention_rules(args: ModelArgs) -> list[Rule]:
    """Separate q/k/v/o projections; q and k rows go through the RoPE permutation."""
    return [
        Rule(LAYER + "self_attn.q_proj.weight", NATIVE + "attn.q_proj.weight", q_permute(args)),
        Rule(LAYER + "self_attn.k_proj.weight", NATIVE + "attn.k_proj.weight", k_permute(args)),
        Rule(LAYER + "self_attn.v_proj.weight", NATIVE + "attn.v_proj.weight"),
        Rule(LAYER + "self_attn.o_proj.weight", NATIVE + "attn.output_proj.weight"),
    ]


def mlp_rules() -> list[Rule]:
    return [
        Rule(LAYER + "mlp.gate_proj.weight", NATIVE + "mlp.w1.weight"),
        Rule(LAYER + "mlp.up_proj.weight", NATIVE + "mlp.w3.weight"),
        Rule(LAYER + "mlp.down_proj.weight", NATIVE + "mlp.w2.weight"),
    ]


def llama_converter(config: Mapping[str, Any]) -> Converter:
    """The converter for an HF config.json of the Llama family; the RoPE permutation's shape comes from it."""
    args = model_args(config)
    return Converter(
        rules=outer_rules() + norm_rules() + attention_rules(args) + mlp_rules(),
        ignore=IGNORE,
        tied_embeddings=args.tie_embeddings,
    )
