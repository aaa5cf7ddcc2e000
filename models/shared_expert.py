"""The shared expert of a mixture-of-experts layer (Qwen2-MoE; DeepSeek's shared experts without the gate): a dense
gated MLP that every token goes through besides its routed experts, its output added to theirs.

Parameter names (under each MoE layer's ``moe.``)::

    shared.w1.weight   [shared_hidden_dim, dim]   gate   transformers' ``mlp.shared_expert.gate_proj.weight``
    shared.w3.weight   [shared_hidden_dim, dim]   up     ``mlp.shared_expert.up_proj.weight``
    shared.w2.weight   [dim, shared_hidden_dim]   down   ``mlp.shared_expert.down_proj.weight``
    shared_gate.weight [1, dim]                          ``mlp.shared_expert_gate.weight`` (only with a gate)

As ``Qwen2MoeSparseMoeBlock``: ``routed + sigmoid(shared_gate(x)) * shared(x)``, each product in the input's dtype.
The linears are ``nn.Linear`` named ``w1``/``w2``/``w3`` like the dense block's, so LoRA (``apply_lora``) and NF4
(``quantize_base: nf4``) take them as they take the dense MLP's.
"""

from __future__ import annotations

import torch
from torch import nn

from waypoint.models.args import ACTIVATIONS


class FeedForward(nn.Module):
    """Gated MLP: w2(act(w1 x) * w3 x); SwiGLU with the default silu, GeGLU with a gelu. The dense block's MLP
    (``transformer`` re-exports it) and a MoE's shared expert: here, below both, so that the MoE can own one."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu") -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def shared_output(shared: FeedForward, gate: nn.Linear | None, x: torch.Tensor) -> torch.Tensor:
    """The shared expert's contribution for ``x`` [tokens, dim]: scaled by ``sigmoid(gate(x))`` where there is a gate."""
    out = shared(x)
    return out if gate is None else torch.sigmoid(gate(x)) * out


def init_shared(shared: FeedForward | None, gate: nn.Linear | None, std: float, down_std: float) -> None:
    """Normal(0, ``std``) for w1, w3 and the gate, Normal(0, ``down_std``) for w2 (transformers' Linear init)."""
    with torch.no_grad():
        for p in ((shared.w1.weight, shared.w3.weight) if shared is not None else ()) + ((gate.weight,) if gate is not None else ()):
            nn.init.normal_(p, std=std)
        if shared is not None:
            nn.init.normal_(shared.w2.weight, std=down_std)
