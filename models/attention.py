"""Self-attention of the native transformer (:mod:`waypoint.models.transformer`, which re-exports these names).

``Attention`` projects q/k/v, optionally normalises each q and k head (``qk_norm``: Qwen3, Gemma 3), rotates
them with RoPE in Meta's interleaved-pair layout, and attends causally or under a ``[seq, seq]`` bool mask with
``torch``'s SDPA, or, with Gemma 2's ``attn_softcap`` or gpt-oss's ``attn_sinks``, with the explicit path
``eager_attention`` (which caps the scores, or adds each head's sink to the softmax's denominator). RMSNorm
lives here because the per-head norms use it; the blocks use it too.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.models.args import ModelArgs


class RMSNorm(nn.Module):
    """``weight * normalize(x)``, or with ``plus_one`` Gemma's ``(1 + weight) * normalize(x)`` multiplied in fp32
    before the cast back (Llama casts first, then multiplies; both as transformers does); ``fp32_weight``: the weight
    multiplied in fp32 too, and the root taken as transformers' Gemma 4 takes it (``pow(x, -0.5)``, not ``rsqrt``, which
    may differ in the last bit); ``weight=False``: no weight at all (Gemma 4's value and router norms)."""

    def __init__(self, dim: int, eps: float = 1e-5, plus_one: bool = False, fp32_weight: bool = False,
                 weight: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.plus_one, self.fp32_weight = plus_one, fp32_weight
        self.weight = (nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim)) if weight else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mean_square = x32.pow(2).mean(-1, keepdim=True) + self.eps
        normed = x32 * (torch.pow(mean_square, -0.5) if self.fp32_weight else torch.rsqrt(mean_square))
        if self.weight is None:
            return normed.to(x.dtype)
        if self.plus_one:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if self.fp32_weight:
            return (normed * self.weight.float()).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def sliding_window_mask(seq: int, window: int, device=None) -> torch.Tensor:
    """[seq, seq] bool, True where query i may attend key j: ``i - window < j <= i`` (transformers' sliding window)."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (j > i - window)


def document_mask(document_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[batch, 1, seq, seq] bool for packed sequences: query i attends key j of its own document, causally
    (``j <= i``) and, with a ``window``, within it (``i - window < j``)."""
    i = torch.arange(document_ids.shape[1], device=document_ids.device)
    allowed = (document_ids[:, :, None] == document_ids[:, None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    return allowed[:, None]


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` [batch, seq, heads, head_dim] by ``cache``: the table [max_seq, head_dim//2, 2]
    (positions 0, 1, ...) or, for packed sequences, each token's own rows [batch, seq, head_dim//2, 2].

    Each pair ``(x0, x1)`` and its row ``(cos, sin)`` read as complex numbers: their product is
    ``(x0 cos - x1 sin, x0 sin + x1 cos)``, the rotation, in one kernel over views of the same memory (no
    stack, no copies per half; the same bits as those formulas written out, at a quarter of the time here)."""
    dtype = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    pairs = torch.view_as_complex(x.to(dtype).unflatten(-1, (-1, 2)).contiguous())
    table = cache[:, :, None] if cache.dim() == 4 else cache[: x.shape[1], None]
    return torch.view_as_real(pairs * torch.view_as_complex(table.to(dtype).contiguous())).flatten(-2).to(x.dtype)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, *,
                    softcap: float | None = None, sinks: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Attention written out, for what SDPA cannot do, as transformers' eager paths: ``q``/``k``/``v`` [batch, heads,
    seq, head_dim] (k/v heads shared by consecutive q heads); scores in q's dtype, optionally capped
    (``softcap``: Gemma 2's ``tanh(s / cap) * cap``), then masked (``mask`` [seq, seq] or [batch, 1, seq, seq] bool,
    None: causal); with ``sinks`` [heads] (gpt-oss) each head's learned logit joins the softmax's denominator as one
    more column, whose probability is dropped; softmax in fp32 cast back to q's dtype."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, column], dim=-1).float()
        combined = combined - combined.max(dim=-1, keepdim=True).values  # as transformers, against overflow
        probs = F.softmax(combined, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(F.dropout(probs, dropout) if dropout else probs, v)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                         softcap: float, dropout: float = 0.0) -> torch.Tensor:
    """Gemma 2's attention with score soft-capping (``eager_attention`` with ``softcap``)."""
    return eager_attention(q, k, v, mask, scale, softcap=softcap, dropout=dropout)


class Attention(nn.Module):
    """Multi-head attention with grouped k/v heads; ``forward(x [batch, seq, dim], rope, mask) -> [batch, seq, dim]``.

    Gemma 4's layers differ by ``layer_id``: full-attention ones take their own head width and k/v heads, may use
    their keys as values (``attn_k_eq_v``: no ``v_proj``), and the last ``kv_shared_layers`` have no k/v projections
    at all, attending over the keys and values an earlier layer of their type left in ``shared_kv``."""

    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads, self.head_dim = args.attention_shape(layer_id)
        self.dropout = args.attn_dropout
        self.scale, self.softcap = args.attn_scale, args.attn_softcap
        # Gemma 4: the layer whose keys and values this one reads (None: its own), and whether later layers read its own
        self.kv_source = args.kv_source(layer_id)
        self.stores_kv = layer_id in {args.kv_source(i) for i in range(args.n_layers)}
        own_kv = self.kv_source is None
        # Qwen3-Next / 3.5: each head's query rows followed by its gate's (attn_output_gate)
        self.gated = args.attn_output_gate
        self.q_proj = nn.Linear(args.dim, self.n_heads * self.head_dim * (2 if self.gated else 1), bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias) if own_kv else None
        keys_as_values = args.attn_k_eq_v and args.is_full_attention(layer_id)
        self.v_proj = (nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
                       if own_kv and not keys_as_values else None)
        self.output_proj = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=args.attn_output_bias)
        # gpt-oss: each head's learned logit in its softmax's denominator (None without attn_sinks)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if args.attn_sinks else None
        # per-head norms (weights in the interleaved order of the rows they scale); None without qk_norm
        norm = partial(RMSNorm, self.head_dim, args.norm_eps, args.norm_plus_one, args.norm_fp32_weight)
        self.q_norm = norm() if args.qk_norm else None
        self.k_norm = norm() if args.qk_norm and own_kv else None
        self.v_norm = (RMSNorm(self.head_dim, args.norm_eps, fp32_weight=True, weight=False)  # Gemma 4's, weightless
                       if args.value_norm and own_kv else None)
        # RoPE on the first rotary_dim dims of each head (all but Qwen3-Next / 3.5's); with rope_interleave false those
        # rows are HF's halves, regrouped into pairs on the activations (q and k alike: the dot product is unchanged)
        self.rotary_dim, self.halves = int(self.head_dim * args.partial_rotary_factor), not args.rope_interleave

    def _rotate(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim and not self.halves:
            return apply_rope(x, rope)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        if self.halves:
            rot = rot.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        return torch.cat([apply_rope(rot, rope), rest], dim=-1)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None, cache=None,
                layer: int = 0, shared_kv: dict | None = None) -> torch.Tensor:
        """``mask``: [seq, seq] or [batch, 1, seq, seq] bool (True: attend) replacing the plain causal mask: a sliding
        window, or packed documents. ``rope``: the table, or each token's rows (packed). ``cache``: a
        ``kv_cache.KVCache`` whose keys and values this layer (``layer``) extends and attends over (``mask`` given).
        ``shared_kv``: {layer: (keys, values)} of the layers whose keys and values later ones read (Gemma 4)."""
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.n_heads, -1)
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        if self.q_norm is not None:  # before the rotation, as Qwen3 and Gemma 3
            q = self.q_norm(q)
        q = self._rotate(q, rope).transpose(1, 2)
        if self.kv_source is not None:  # the keys and values of an earlier layer (after its cache, if any)
            k, v = shared_kv[self.kv_source]
        else:
            k = self.k_proj(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
            # keys as values (Gemma 4's full layers): the k rows are in the interleaved order RoPE wants, the values'
            # in transformers' (o_proj's columns are not permuted), so the halves are taken back apart
            v = (self.v_proj(x).view(bsz, seq, self.n_kv_heads, self.head_dim) if self.v_proj is not None
                 else k.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2))
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.v_norm is not None:
                v = self.v_norm(v)
            k, v = self._rotate(k, rope).transpose(1, 2), v.transpose(1, 2)
            if cache is not None:
                k, v = cache.append(layer, k, v)
            if self.stores_kv:
                shared_kv[layer] = k, v
        dropout = self.dropout if self.training else 0.0
        if self.softcap is None and self.sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                                 enable_gqa=self.n_kv_heads != self.n_heads, dropout_p=dropout)
        else:  # SDPA cannot cap the scores, nor add a sink to the denominator
            scale = self.scale if self.scale is not None else self.head_dim ** -0.5
            out = eager_attention(q, k, v, mask, scale, softcap=self.softcap, sinks=self.sinks, dropout=dropout)
        out = out.transpose(1, 2).reshape(bsz, seq, -1)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(bsz, seq, -1))
        return self.output_proj(out)
