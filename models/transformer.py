"""A decoder-only transformer in Meta's parameter layout.

Parameter names (the native checkpoint format)::

    tok_embeddings.weight
    layers.{i}.sa_norm.weight
    layers.{i}.attn.{q,k,v,output}_proj.weight
    layers.{i}.mlp_norm.weight
    layers.{i}.mlp.{w1,w2,w3}.weight
    norm.weight
    output.weight            (absent from the state dict's storage when tied)

Rotary embeddings rotate interleaved pairs ``(x0, x1), (x2, x3), ...`` as in
Meta's reference code; Hugging Face rotates the two halves of each head, which
the converters bridge by permuting the rows of the q and k projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attn_dropout: float = 0.0  # attention-probability dropout while training

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim={self.resolved_head_dim} must be even for rotary embeddings")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """cos/sin table of shape [max_seq_len, head_dim // 2, 2], in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` [batch, seq, heads, head_dim] by ``cache`` [seq, head_dim//2, 2]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos = cache[: x.shape[1], None, :, 0]
    sin = cache[: x.shape[1], None, :, 1]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.resolved_head_dim
        self.dropout = args.attn_dropout
        self.q_proj = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.output_proj = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = apply_rope(self.q_proj(x).view(bsz, seq, self.n_heads, self.head_dim), rope)
        k = apply_rope(self.k_proj(x).view(bsz, seq, self.n_kv_heads, self.head_dim), rope)
        v = self.v_proj(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.output_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.sa_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.sa_norm(x), rope)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """``model(tokens [batch, seq]) -> logits [batch, seq, vocab]``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # An explicit (empty) weight skips nn.Embedding's init, which on the meta device costs a
        # one-off ~0.8 s import of torch._dynamo; off the meta device it is initialised as usual.
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
        if not self.tok_embeddings.weight.is_meta:
            nn.init.normal_(self.tok_embeddings.weight)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.activation_checkpointing = False
        self.register_buffer("rope", torch.empty(0), persistent=False)
        self.tie_weights()
        self.reset_rope()

    def tie_weights(self) -> None:
        """Share the output projection with the embedding when the model is tied."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def reset_rope(self) -> None:
        """(Re)compute the rotary table on the embedding's device; call after loading onto a meta-built model."""
        device = self.tok_embeddings.weight.device
        if device.type == "meta":  # nothing to compute yet (and meta kernels for it cost a slow import)
            self.rope = torch.empty(0, device=device)
            return
        a = self.args
        self.rope = rope_cache(a.resolved_head_dim, a.max_seq_len, a.rope_theta, device=device)

    def init_weights(self, std: float = 0.02) -> None:
        """Random initialisation for training from scratch (tests, tiny models)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=std if not name.endswith(("output_proj.weight", "w2.weight")) else std / math.sqrt(2 * self.args.n_layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.rope.shape[0]:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.rope.shape[0]}")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                h = torch.utils.checkpoint.checkpoint(layer, h, self.rope, use_reentrant=False)
            else:
                h = layer(h, self.rope)
        return self.output(self.norm(h))
