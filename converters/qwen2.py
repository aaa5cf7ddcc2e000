"""The Qwen2 table: Llama's keys plus biases on the q/k/v projections.

The q and k biases are rows of the projection's output, so they go through the same RoPE
permutation as the weights (RopePermute acts on dim 0 of 1-D tensors too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waypoint.converters.llama import IGNORE, LAYER, NATIVE, attention_rules, k_permute, mlp_rules, model_args, norm_rules, outer_rules, q_permute
from waypoint.converters.table import Converter, Rule


def qwen2_converter(config: Mapping[str, Any]) -> Converter:
    args = model_args(config)
    biases = [
        Rule(LAYER + "self_attn.q_proj.bias", NATIVE + "attn.q_proj.bias", q_permute(args)),
        Rule(LAYER + "self_attn.k_proj.bias", NATIVE + "attn.k_proj.bias", k_permute(args)),
        Rule(LAYER + "self_attn.v_proj.bias", NATIVE + "attn.v_proj.bias"),
    ]
    return Converter(
        rules=outer_rules() + norm_rules() + attention_rules(args) + biases + mlp_rules(),
        ignore=IGNORE,
        tied_embeddings=args.tie_embeddings,
    )
