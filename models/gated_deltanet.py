"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5/3.6 (their ``linear_attention`` layers).

``forward(x [batch, seq, dim]) -> [batch, seq, dim]``, as transformers' ``Qwen3_5GatedDeltaNet``:

1. ``in_proj_qkv`` -> q, k (``linear_num_key_heads`` heads of ``linear_key_head_dim``) and v (``linear_num_value_heads``
   of ``linear_value_head_dim``), through a depthwise causal ``conv1d`` (kernel ``linear_conv_kernel_dim``) and SiLU;
2. ``beta = sigmoid(in_proj_b(x))``, the log gate ``g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)``;
3. the gated delta rule (``models.delta_rule``) over the sequence;
4. a gated RMSNorm per value head, ``norm.weight * normalize(o) * silu(in_proj_z(x))``, then ``out_proj``.

Native parameter names are the HF ones (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``,
``dt_bias``, ``A_log``, ``norm``, ``out_proj``), so LoRA targets read the same in both (Qwen3-Next's fused
``in_proj_qkvz``/``in_proj_ba`` are split by its converter).

Packed sequences: the state and the convolution's window start afresh at each document (``documents``): within each
chunk, the delta rule masks what crosses a document's start (``delta_rule.Segments``), so a pack costs what its tokens
do, however its documents are cut, and no token sees another document's state.
With a cache (generation), each call continues from the state and the last inputs the previous call left.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.models.args import ModelArgs
from waypoint.models.delta_rule import causal_conv, chunk_gated_delta_rule


class GatedRMSNorm(nn.Module):
    """``weight * normalize(x)`` in ``x``'s dtype, times ``silu(gate)`` in fp32, cast back (transformers'
    ``Qwen3NextRMSNormGated``; its weight is not zero-centred, unlike the model's other norms)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        work = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(work)
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.to(work))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.k_heads, self.v_heads = args.linear_key_heads, args.linear_value_heads
        self.k_dim, self.v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        keys, values = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.in_proj_qkv = nn.Linear(args.dim, 2 * keys + values, bias=False)
        self.in_proj_z = nn.Linear(args.dim, values, bias=False)
        self.in_proj_b = nn.Linear(args.dim, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(args.dim, self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(2 * keys + values, 2 * keys + values, args.linear_conv_kernel, groups=2 * keys + values,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, args.norm_eps)
        self.out_proj = nn.Linear(values, args.dim, bias=False)

    def init_own_weights(self) -> None:
        """What ``Transformer.init_weights``' name rules get wrong here: transformers' initial values."""
        with torch.no_grad():
            nn.init.ones_(self.norm.weight)
            nn.init.ones_(self.dt_bias)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            bound = 1 / math.sqrt(self.conv1d.weight.shape[-1])
            nn.init.uniform_(self.conv1d.weight, -bound, bound)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                cache=None, layer: int = 0) -> torch.Tensor:
        """``documents``: a packed batch's document ids [batch, seq] (None: one sequence a row). ``cache``: a
        ``KVCache`` whose ``states[layer]`` this call continues and replaces. ``rope`` is unused (no positions)."""
        bsz, seq, _ = x.shape
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta = self.in_proj_b(x).sigmoid()
        work = torch.promote_types(x.dtype, torch.float32)
        g = -self.A_log.to(work).exp() * F.softplus(self.in_proj_a(x).to(work) + self.dt_bias)
        conv_state, state = cache.states[layer] if cache is not None and cache.states[layer] is not None else (None, None)
        mixed, conv_state = causal_conv(qkv, self.conv1d.weight, conv_state, documents)
        q, k, v = mixed.split([self.k_heads * self.k_dim] * 2 + [self.v_heads * self.v_dim], dim=-1)
        out, state = chunk_gated_delta_rule(q.unflatten(-1, (self.k_heads, self.k_dim)), k.unflatten(-1, (self.k_heads, self.k_dim)),
                                            v.unflatten(-1, (self.v_heads, self.v_dim)), g, beta, initial_state=state,
                                            output_final_state=cache is not None, documents=documents)
        if cache is not None:
            cache.states[layer] = (conv_state, state)
        out = self.norm(out.reshape(bsz, seq, self.v_heads, self.v_dim), z.view(bsz, seq, self.v_heads, self.v_dim))
        return self.out_proj(out.reshape(bsz, seq, -1))
