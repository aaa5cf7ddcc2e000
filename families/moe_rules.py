"""Rule pieces of the two on-disk layouts of mixture-of-experts layers, shared by Mixtral and Qwen3-MoE.

Native: ``layers.{i}.moe.router.weight [E, H]`` and the experts stacked, ``moe.w1``/``moe.w3 [E, I, H]`` (gate, up)
and ``moe.w2 [E, H, I]`` (down): expert e's HF ``[I, H]`` weight is exactly ``w1[e]``.

- per-expert keys (the hub's, and what transformers 5 writes by default): ``<experts>.{e}.<gate>.weight``, ...,
  stacked on load and unstacked on save (``Stack``);
- packed keys (transformers' ``save_original_format=False`` and newer hubs): ``mlp.experts.gate_up_proj [E, 2I, H]``
  (gate rows, then up rows: split along dim 1) and ``mlp.experts.down_proj [E, H, I]``.
"""

from __future__ import annotations

from waypoint.converters.ops import Split, Stack
from waypoint.converters.table import Rule
from waypoint.families.hf_rules import LAYER, NATIVE
from waypoint.models.args import ModelArgs

MOE = NATIVE + "moe."


def per_expert_rules(args: ModelArgs, block: str, gate: str, up: str, down: str) -> list[Rule]:
    """``LAYER + block`` holds ``gate.weight`` (the router) and ``experts.{e}.<gate|up|down>.weight``."""
    stack = Stack(args.n_experts)
    experts = LAYER + block + "experts.{e}."
    return [
        Rule(LAYER + block + "gate.weight", MOE + "router.weight"),
        Rule(experts + gate + ".weight", MOE + "w1", stack),
        Rule(experts + up + ".weight", MOE + "w3", stack),
        Rule(experts + down + ".weight", MOE + "w2", stack),
    ]


def packed_rules(args: ModelArgs) -> list[Rule]:
    hidden = args.expert_hidden_dim or args.hidden_dim
    return [
        Rule(LAYER + "mlp.gate.weight", MOE + "router.weight"),
        Rule(LAYER + "mlp.experts.gate_up_proj", (MOE + "w1", MOE + "w3"), Split((hidden, hidden), dim=1)),
        Rule(LAYER + "mlp.experts.down_proj", MOE + "w2"),
    ]
