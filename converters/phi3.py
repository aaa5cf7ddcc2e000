"""The Phi-3 table: fused ``qkv_proj`` and ``gate_up_proj``, split on load and fused again on save.

``qkv_proj`` holds the q, k and v rows one after another; q and k then go through the RoPE
permutation. ``gate_up_proj`` holds the gate (native w1) rows, then the up (w3) rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waypoint.converters.llama import IGNORE, LAYER, NATIVE, k_permute, model_args, norm_rules, outer_rules, q_permute
from waypoint.converters.ops import Chain, Identity, PerTensor, Split
from waypoint.converters.table import Converter, Rule


def phi3_converter(config: Mapping[str, Any]) -> Converter:
    args = model_args(config)
    q_rows, kv_rows = args.n_heads * args.resolved_head_dim, args.n_kv_heads * args.resolved_head_dim
    qkv = Chain(Split((q_rows, kv_rows, kv_rows)), PerTensor(q_permute(args), k_permute(args), Identity()))
    attn = NATIVE + "attn."
    return Converter(
        rules=outer_rules() + norm_rules() + [
            Rule(LAYER + "self_attn.qkv_proj.weight", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), qkv),
            Rule(LAYER + "self_attn.o_proj.weight", attn + "output_proj.weight"),
            Rule(LAYER + "mlp.gate_up_proj.weight", (NATIVE + "mlp.w1.weight", NATIVE + "mlp.w3.weight"),
                 Split((args.hidden_dim, args.hidden_dim))),
            Rule(LAYER + "mlp.down_proj.weight", NATIVE + "mlp.w2.weight"),
        ],
        ignore=IGNORE,
        tied_embeddings=args.tie_embeddings,
    )
