"""The Llama-family table (Llama 2/3, Mistral): HF ``LlamaForCausalLM`` keys <-> native keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from converters.ops import RopePermute
from converters.table import Converter, Rule
from models.builders import model_args_from_hf_config


def llama_converter(config: Mapping[str, Any]) -> Converter:
    """The converter for an HF config.json of the Llama family; the RoPE permutation's shape comes from it."""
    args = model_args_from_hf_config(config)
    hd = args.resolved_head_dim
    layer, native = "model.layers.{i}.", "layers.{i}."
    return Converter(
        rules=[
            Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
            Rule(layer + "input_layernorm.weight", native + "sa_norm.weight"),
            Rule(layer + "self_attn.q_proj.weight", native + "attn.q_proj.weight", RopePermute(args.n_heads, hd)),
            Rule(layer + "self_attn.k_proj.weight", native + "attn.k_proj.weight", RopePermute(args.n_kv_heads, hd)),
            Rule(layer + "self_attn.v_proj.weight", native + "attn.v_proj.weight"),
            Rule(layer + "self_attn.o_proj.weight", native + "attn.output_proj.weight"),
            Rule(layer + "post_attention_layernorm.weight", native + "mlp_norm.weight"),
            Rule(layer + "mlp.gate_proj.weight", native + "mlp.w1.weight"),
            Rule(layer + "mlp.up_proj.weight", native + "mlp.w3.weight"),
            Rule(layer + "mlp.down_proj.weight", native + "mlp.w2.weight"),
            Rule("model.norm.weight", "norm.weight"),
            Rule("lm_head.weight", "output.weight"),
        ],
        ignore=(r"(^|\.)rotary_emb\.inv_freq$",),
        tied_embeddings=args.tie_embeddings,
    )
