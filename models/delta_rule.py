"""The gated delta rule (Gated DeltaNet's token mixer: Qwen3-Next, Qwen3.5/3.6), chunked, in plain PyTorch.

Per value head, a state ``S`` [k_dim, v_dim] is decayed, corrected and read at every token ``t``::

    S = exp(g_t) * S                      # the gate: g_t <= 0
    S = S + beta_t * k_t (v_t - S^T k_t)^T  # the delta rule: move k_t's read-out towards v_t
    o_t = S^T q_t

with ``q``, ``k`` l2-normalised and ``q`` scaled by ``k_dim ** -0.5``. Token by token that is a Python loop over the
sequence; here it runs ``chunk_size`` tokens at a time (the WY/UT form of the DeltaNet papers and of
flash-linear-attention): within a chunk every quantity is a batched matrix product over all chunks at once, and the
only sequential part is one ``[k_dim, k_dim] @ [k_dim, v_dim]`` product per chunk, ``S_next = M_n S + C_n``:

- ``L = I + strict_lower(beta_i k_i.k_j exp(G_i - G_j))`` per chunk (``G``: the gates' cumulative sum in the chunk);
  ``U = L^-1 (beta v)`` and ``W = L^-1 (beta k exp(G))`` (one triangular solve for both);
- the state entering chunk ``n`` is read by ``Q_eff = q exp(G) - A W`` (``A``: the chunk's causal, decayed ``q.k``),
  the chunk's own tokens by ``A U``: ``o = Q_eff S_n + A U``;
- ``M_n = exp(G_last) I - K_dec^T W`` and ``C_n = K_dec^T U`` with ``K_dec = k exp(G_last - G)``.

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
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q``, ``k`` [batch, seq, k_heads, k_dim] (not yet normalised), ``v`` [batch, seq, v_heads, v_dim], ``g`` (log
    gates, <= 0) and ``beta`` [batch, seq, v_heads]; each q/k head serves ``v_heads // k_heads`` consecutive value
    heads. ``initial_state`` [batch, v_heads, k_dim, v_dim] (generation). Returns the output [batch, seq, v_heads,
    v_dim] in ``v``'s dtype and, with ``output_final_state``, the state after the last token (fp32)."""
    dtype = v.dtype
    batch, seq, k_heads, k_dim = k.shape
    v_heads, v_dim = v.shape[-2:]
    if v_heads % k_heads:
        raise ValueError(f"{v_heads} value heads are not a multiple of {k_heads} key heads")
    repeat = v_heads // k_heads
    # [batch, heads, seq, dim] in fp32, q and k normalised (then shared by their value heads)
    q, k = (l2norm(x.transpose(1, 2).float()) for x in (q, k))
    q = q * k_dim ** -0.5
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    v = v.transpose(1, 2).float()
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()

    size = min(chunk_size, seq)
    pad = -seq % size
    if pad:  # zero tokens at the end: no update (beta 0), no decay (g 0), read by nothing kept
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (seq + pad) // size
    q, k, v = (x.unflatten(2, (n, size)) for x in (q, k, v))  # [b, h, n, c, d]
    g, beta = g.unflatten(2, (n, size)), beta.unflatten(2, (n, size))  # [b, h, n, c]

    G = g.cumsum(-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], k_beta * G.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    U, W = solved.split([v_dim, k_dim], dim=-1)
    A = (q @ k.transpose(-1, -2)) * decay
    q_eff = q * G.exp()[..., None] - A @ W  # reads the state entering the chunk
    inner = A @ U  # the chunk's own tokens
    last = G[..., -1:]
    k_dec = k * (last - G).exp()[..., None]
    eye = torch.eye(k_dim, dtype=q.dtype, device=q.device)
    M = last.exp()[..., None] * eye - k_dec.transpose(-1, -2) @ W  # [b, h, n, k, k]
    C = k_dec.transpose(-1, -2) @ U  # [b, h, n, k, v]

    state = (torch.zeros(batch, v_heads, k_dim, v_dim, dtype=q.dtype, device=q.device) if initial_state is None
             else initial_state.to(q.dtype))
    entering = []
    for M_i, C_i in zip(M.unbind(2), C.unbind(2)):  # unbind: one backward for all chunks (indexing: one each)
        entering.append(state)
        state = torch.baddbmm(C_i.flatten(0, 1), M_i.flatten(0, 1), state.flatten(0, 1)).view_as(C_i)
    out = q_eff @ torch.stack(entering, dim=2) + inner  # [b, h, n, c, v]
    out = out.flatten(2, 3)[:, :, :seq].transpose(1, 2).to(dtype)
    return out, (state if output_final_state else None)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution, then SiLU: ``x`` [batch, channels, seq], ``weight`` [channels, 1, kernel];
    ``state`` [batch, channels, kernel - 1]: the inputs before ``x`` (generation; None: zeros). Returns the output and
    the last ``kernel - 1`` inputs (the next call's state)."""
    width = weight.shape[-1] - 1
    history = x.new_zeros(x.shape[0], x.shape[1], width) if state is None else state.to(x.dtype)
    full = torch.cat([history, x], dim=-1)
    out = F.conv1d(full.to(weight.dtype), weight, groups=x.shape[1])
    return F.silu(out).to(x.dtype), full[..., full.shape[-1] - width:]
