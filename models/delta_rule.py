"""The gated delta rule (Gated DeltaNet's token mixer: Qwen3-Next, Qwen3.5/3.6), chunked, in plain PyTorch.

Per value head, a state ``S`` [k_dim, v_dim] is decayed, corrected and read at every token ``t``::

    S = exp(g_t) * S                      # the gate: g_t <= 0
    S = S + beta_t * k_t (v_t - S^T k_t)^T  # the delta rule: move k_t's read-out towards v_t
    o_t = S^T q_t

with ``q``, ``k`` l2-normalised and ``q`` scaled by ``k_dim ** -0.5``. Token by token that is a Python loop over the
sequence; here it runs ``chunk_size`` tokens at a time (the WY/UT form of the DeltaNet papers and of
flash-linear-attention): within a chunk every quantity is a batched matrix product over all chunks at once, and the
only sequential part is two products per chunk (``V = U - W S``, ``S = exp(G_last) S + K_dec^T V``):

- ``L = I + strict_lower(beta_i k_i.k_j exp(G_i - G_j))`` per chunk (``G``: the gates' cumulative sum in the chunk);
  ``U = L^-1 (beta v)`` and ``W = L^-1 (beta k exp(G))`` (one triangular solve for both);
- the chunk's output ``o = q exp(G) S_n + A V``, for all chunks at once after the scan (``A``: the chunk's causal,
  decayed ``q.k``; ``S_n`` the state entering it), with ``K_dec = k exp(G_last - G)``;
- ``k.k`` and ``q.k`` once per key head, shared by its value heads by broadcasting (no copies of q and k per value head).

Everything is fp32 (as transformers' and flash-linear-attention's kernels compute it) and differentiable by autograd;
the results agree with transformers' ``torch_chunk_gated_delta_rule`` to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           chunk_size: int = 64, documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q``, ``k`` [batch, seq, k_heads, k_dim] (not yet normalised), ``v`` [batch, seq, v_heads, v_dim], ``g`` (log
    gates, <= 0) and ``beta`` [batch, seq, v_heads]; each q/k head serves ``v_heads // k_heads`` consecutive value
    heads. ``initial_state`` [batch, v_heads, k_dim, v_dim] (generation). ``documents`` [batch, seq]: packed sequences'
    document ids (each run of one id a document): the state starts afresh at each (``Segments``). Returns the output
    [batch, seq, v_heads, v_dim] in ``v``'s dtype and, with ``output_final_state``, the state after the last token (fp32)."""
    dtype = v.dtype
    work = torch.promote_types(dtype, torch.float32)  # fp32 (fp64 inputs stay fp64)
    batch, seq, k_heads, k_dim = k.shape
    v_heads, v_dim = v.shape[-2:]
    if v_heads % k_heads:
        raise ValueError(f"{v_heads} value heads are not a multiple of {k_heads} key heads")
    share = v_heads // k_heads
    size = min(chunk_size, seq)
    pad = -seq % size
    n = (seq + pad) // size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [batch, seq, heads, ...] -> [batch, heads, chunks, size, ...] fp32
        x = x.to(work).transpose(1, 2)
        if pad:  # zero tokens at the end: no update (beta 0), no decay (g 0), read by nothing kept
            x = F.pad(x, (0, 0) * (x.ndim - 3) + (0, pad))
        return x.unflatten(2, (n, size))

    # q and k per key head [b, hk, 1, n, c, d] (shared by their value heads by broadcasting), the rest per value
    # head [b, hk, share, n, c, ...]
    q, k = (chunked(l2norm(x.to(work))).unsqueeze(2) for x in (q, k))
    q = q * k_dim ** -0.5
    v = chunked(v).unflatten(1, (k_heads, share))
    g, beta = (chunked(x).unflatten(1, (k_heads, share)) for x in (g, beta))

    G = g.cumsum(-1)
    seen = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()  # j <= i
    segments = None if documents is None else Segments(documents, n, size, pad)
    if segments is not None:
        seen = seen & segments.same
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~seen, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    k_t = k.transpose(-1, -2)
    system = (k @ k_t) * decay * beta[..., None]  # beta_i k_i.k_j exp(G_i - G_j); its diagonal is taken as 1
    reads = G.exp() if segments is None else G.exp() * segments.reads  # whose tokens read the state entering the chunk
    rhs = torch.cat([v * beta[..., None], (k * (beta * reads)[..., None])], dim=-1)
    U, W = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([v_dim, k_dim], dim=-1)
    A = (q @ k_t) * decay  # the chunk's causal, decayed q.k
    q_dec = q * reads[..., None]
    last = G[..., -1:]
    writes, carry = (last - G).exp(), last.exp()[..., None]  # into the state leaving the chunk [b, hk, share, n, 1, 1]
    if segments is not None:  # only the chunk's last document's tokens; the entering state only if it is that document
        writes, carry = writes * segments.writes, carry * segments.keeps[..., None]
    k_dec_t = (k * writes[..., None]).transpose(-1, -2)

    state = (q.new_zeros(batch, k_heads, share, k_dim, v_dim) if initial_state is None
             else initial_state.to(work).unflatten(1, (k_heads, share)))
    entering, corrected = [], []
    # unbind: one backward for all chunks (indexing would zero-fill a full-size gradient per chunk)
    for U_i, W_i, K_i, c_i in zip(U.unbind(3), W.unbind(3), k_dec_t.unbind(3), carry.unbind(3)):
        entering.append(state)
        v_new = U_i - W_i @ state  # the chunk's updates, less what the state already predicts (the delta rule)
        corrected.append(v_new)
        state = state * c_i + K_i @ v_new
    out = q_dec @ torch.stack(entering, dim=3) + A @ torch.stack(corrected, dim=3)  # [b, hk, share, n, c, v]
    out = out.flatten(3, 4)[..., :seq, :].flatten(1, 2).transpose(1, 2).to(dtype)
    return out, (state.flatten(1, 2) if output_final_state else None)


class Segments:
    """Where packed documents meet, chunk by chunk (ids [batch, seq] -> masks over [batch, 1, 1, chunks, size, ...],
    broadcast over the heads): ``same`` [.., size, size] pairs of one document; ``reads`` [.., size] tokens of the
    document the state entering the chunk belongs to; ``writes`` tokens of the chunk's last document (the state leaving
    it is theirs alone); ``keeps`` [.., 1] whether the entering state is that document's too. The padding after the last
    token counts as its document."""

    def __init__(self, documents: torch.Tensor, n: int, size: int, pad: int) -> None:
        if pad:
            documents = torch.cat([documents, documents[:, -1:].expand(-1, pad)], dim=1)
        ids = documents.unflatten(1, (n, size))[:, None, None]  # [b, 1, 1, n, c]
        before = torch.cat([ids[..., :1, :1], ids[..., :-1, -1:]], dim=-2)  # the token before each chunk's first
        self.same = ids[..., :, None] == ids[..., None, :]
        self.reads, self.writes, self.keeps = ids == before, ids == ids[..., -1:], ids[..., -1:] == before


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution, then SiLU: ``x`` [batch, seq, channels] (channels last, as the projection
    gives them), ``weight`` [channels, 1, kernel]; ``state`` [batch, kernel - 1, channels]: the inputs before ``x``
    (generation; None: zeros); ``documents`` [batch, seq]: packed documents' ids, each token reading only its own
    document's inputs. Returns the output and the last ``kernel - 1`` inputs (the next call's state).

    A sum of ``kernel`` shifted, weighted copies rather than ``F.conv1d``: no transposes to channels-first and back,
    and a backward of the same few element-wise passes (the depthwise convolution's is several times slower here)."""
    width = weight.shape[-1] - 1
    history = x.new_zeros(x.shape[0], width, x.shape[2]) if state is None else state.to(x.dtype)
    full = torch.cat([history, x], dim=1).to(weight.dtype)
    seq, taps = x.shape[1], weight[:, 0].t()  # [kernel, channels]
    out = full[:, :seq] * taps[0]
    if documents is not None:  # tap j reads the input width - j tokens back: only within the token's document
        ids = torch.cat([documents[:, :1].expand(-1, width), documents], dim=1)
        out = out * (ids[:, :seq] == documents)[..., None]
    for j in range(1, width + 1):  # fused multiply-adds, in the taps' order, as the convolution's kernel rounds them
        shifted = full[:, j:j + seq] if documents is None else full[:, j:j + seq] * (ids[:, j:j + seq] == documents)[..., None]
        out = torch.addcmul(out, shifted, taps[j])
    return F.silu(out).to(x.dtype), full[:, full.shape[1] - width:]
