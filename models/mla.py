"""Multi-head latent attention (DeepSeek V2/V3's MLA): ``LatentAttention``, in place of ``attention.Attention`` where
``ModelArgs.kv_lora_rank`` is set, with the same ``forward(x, rope, mask, cache, layer)``.

Parameter names (under each layer's ``attn.``; transformers' under ``self_attn.`` in brackets)::

    q_proj.weight      [n_heads * (nope + rope), dim]     (q_proj; only without q_lora_rank)
    q_a_proj.weight    [q_lora_rank, dim]                 (q_a_proj; the query compressed)
    q_a_norm.weight    [q_lora_rank]                      (q_a_layernorm)
    q_b_proj.weight    [n_heads * (nope + rope), q_lora_rank]   (q_b_proj)
    kv_a_proj.weight   [kv_lora_rank + rope, dim]         (kv_a_proj_with_mqa: the k/v latent, then one rotary key
                                                           shared by every head)
    kv_a_norm.weight   [kv_lora_rank]                     (kv_a_layernorm)
    kv_b_proj.weight   [n_heads * (nope + v), kv_lora_rank]     (kv_b_proj: each head's key part without RoPE, then
                                                           its value, from the latent)
    output_proj.weight [dim, n_heads * v]                 (o_proj)
    q_a_proj.bias, kv_a_proj.bias, output_proj.bias       (attention_bias: ``qkv_bias`` and ``attn_output_bias``)

with ``nope`` = ``qk_nope_head_dim``, ``rope`` = ``head_dim`` (qk_rope_head_dim), ``v`` = ``v_head_dim``. A head's
query is ``[q_nope, rope(q_rot)]``, its key ``[k_nope, rope(k_rot)]``; the softmax scale is ``(nope + rope) ** -0.5``,
times YaRN's ``mscale_all_dim`` mscale squared (DeepSeek's ``yarn_apply_mscale``: ``mla_scale``).

RoPE: the rotary rows are in interleaved pairs in DeepSeek's checkpoints (V2 rotates them as complex pairs, V3 with
``rope_interleave`` true pairs them the same way), which is the native rotation's layout: the weights load as they are,
without a permutation. transformers' V3 writes the rotated pairs out as halves (evens, then odds) for q and k alike,
an order a dot product does not see. With ``rope_interleave`` false (``ModelArgs.rope_interleave``) the rotary rows are
in halves, rotated as HF's ``rotate_half``: those rows are regrouped into pairs here, on the activations (q and k
alike), so the converter stays a table of renames in both cases and a LoRA on the projections is PEFT's as it is.

The KV cache keeps the latent (after its norm) and the rotated shared key, ``kv_lora_rank + rope`` numbers a token,
as transformers' cache does; each step expands all of them through ``kv_b_proj``. The RMSNorms on the latents use
transformers' default eps (1e-6), not ``rms_norm_eps``, as ``DeepseekV3Attention`` builds them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.models.args import ModelArgs
from waypoint.models.attention import RMSNorm, apply_rope

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which q_a_layernorm and kv_a_layernorm keep


def mla_scale(args: ModelArgs) -> float:
    """The softmax scale: ``attn_scale`` if set, else ``(qk_nope_head_dim + head_dim) ** -0.5``, times
    ``mscale(rope_factor, rope_mscale_all_dim) ** 2`` where a scaled rope has ``rope_mscale_all_dim`` (transformers'
    ``yarn_apply_mscale``, in its order of operations)."""
    if args.attn_scale is not None:
        return args.attn_scale
    scale = (args.qk_nope_head_dim + args.resolved_head_dim) ** (-0.5)
    if args.rope_type != "default" and args.rope_mscale_all_dim:
        factor = args.rope_factor
        mscale = 1.0 if factor <= 1 else 0.1 * args.rope_mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """``forward(x [batch, seq, dim], rope, mask, cache, layer) -> [batch, seq, dim]``; see the module docstring."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.kv_lora_rank is None:
            raise ValueError("LatentAttention needs kv_lora_rank")
        self.n_heads, self.rope_dim, self.nope_dim = args.n_heads, args.resolved_head_dim, args.qk_nope_head_dim
        self.v_dim = args.v_head_dim if args.v_head_dim is not None else self.nope_dim + self.rope_dim
        self.kv_rank, self.halves = args.kv_lora_rank, not args.rope_interleave
        self.scale, self.dropout = mla_scale(args), args.attn_dropout
        qk_dim = self.nope_dim + self.rope_dim
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(args.dim, self.n_heads * qk_dim, bias=False)  # no bias even with attention_bias
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(args.dim, args.q_lora_rank, bias=args.qkv_bias)
            self.q_a_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, self.n_heads * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(args.dim, self.kv_rank + self.rope_dim, bias=args.qkv_bias)
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.output_proj = nn.Linear(self.n_heads * self.v_dim, args.dim, bias=args.attn_output_bias)

    def _rotate(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """RoPE on rotary rows [batch, seq, heads, rope]: in pairs as they are, or from halves regrouped into pairs."""
        if self.halves:
            x = x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        return apply_rope(x, rope)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None, cache=None,
                layer: int = 0) -> torch.Tensor:
        """As ``Attention.forward``; ``cache`` keeps this layer's latents (``KVCache.append``'s keys and values being
        the normed latent [batch, 1, seq, kv_lora_rank] and the rotated shared key [batch, 1, seq, rope])."""
        bsz, seq, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(bsz, seq, self.n_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent)[:, None]  # [batch, 1, seq, kv_lora_rank]
        q_rot = self._rotate(q_rot, rope)
        k_rot = self._rotate(k_rot.view(bsz, seq, 1, self.rope_dim), rope).transpose(1, 2)  # [batch, 1, seq, rope]
        if cache is not None:
            latent, k_rot = cache.append(layer, latent, k_rot)
        kv = self.kv_b_proj(latent[:, 0]).view(bsz, -1, self.n_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.n_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.output_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
