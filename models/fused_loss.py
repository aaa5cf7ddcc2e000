"""The next-token cross-entropy, and the output projection fused with it a chunk of tokens at a time.

With a 128k vocabulary the logits are the largest tensors of a step: the fp32 logits of 8k tokens take 4 GB, and a
plain cross-entropy keeps them, their log-softmax and their gradient alive at once. :func:`linear_cross_entropy_sum`
never holds more than one chunk's: for each chunk of tokens it computes the logits, their losses and at once the
gradient of that loss sum with respect to the chunk's hidden states and the projection weight (softmax minus
one-hot: a sum's gradient needs nothing from later), so backward only scales what forward kept by the incoming
gradient. Nothing is computed twice, and what is kept for backward is hidden-sized and weight-sized, not
[tokens, vocab].

Only the supervised rows (label not -100) go through the projection: an ignored position adds nothing to the loss
or to either gradient, and in chat data the prompts, often half of a batch, are ignored. The plain path computes
their logits all the same.

Every [chunk, vocab] tensor is a view of one :class:`ChunkBuffer` (Gemma 2's capped logits and their gradient
included), which the model keeps from step to step on the CPU: a step there allocates none.

The per-token losses are the plain path's (the same rows through the same matmul, the same fp32 log-softmax); the
sum and the gradients agree with it up to the order in which the chunks are added.

:func:`linear_cross_entropy_rows` gives each sequence's loss sum, a [batch] vector, for losses such as DPO's that
are nonlinear in them. Its upstream gradient is then a vector, a factor per sequence that is unknown until backward,
so the gradients cannot be formed in forward: forward computes the losses only and keeps the supervised hidden rows
(and the weight), and backward recomputes each chunk's logits and softmax, scales softmax minus one-hot row by row,
and forms the gradients as above. One extra [chunk, dim] x [dim, vocab] matmul per chunk, and still nothing
[tokens, vocab]-sized kept between forward and backward.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 2**26  # logits per chunk (256 MB in fp32): 2048 tokens of a 32k vocabulary, 512 of a 128k one.
# Smaller chunks cost time: each adds the whole [vocab, dim] weight gradient once more (measured for 2048 tokens
# of a 128k vocabulary, forward and backward of the loss: 128-token chunks 6.3-6.5 s, 512 5.3 s, full logits 5.8 s)


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy of ``logits[:, t]`` against ``labels[:, t + 1]`` (in fp32), ignoring -100.

    Summing (not averaging) per micro-batch and dividing by the tokens of the whole
    optimizer step makes gradient accumulation equal to one large batch.
    """
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def next_token_loss_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's :func:`next_token_loss_sum`: [batch] fp32, 0 for a row with no supervised position."""
    batch, seq = labels.shape
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                             ignore_index=IGNORE_INDEX, reduction="none")
    return losses.view(batch, seq - 1).sum(1)


def chunk_tokens(vocab: int, chunk: int | None = None) -> int:
    """Tokens per chunk: ``chunk`` when given, else about ``CHUNK_ELEMENTS`` logits' worth."""
    return chunk if chunk else max(1, CHUNK_ELEMENTS // vocab)


class ChunkBuffer:
    """The fused loss's working memory: one buffer per role, each as large as the largest chunk asked of it, reused
    by every chunk and every step that passes the same :class:`ChunkBuffer`.

    A chunk's logits are the largest tensor a step creates (256 MB in fp32 at the default chunk size). A fresh one
    per chunk is memory that glibc maps and returns to the system each time (it is past its 32 MB threshold), and
    the kernel zero-fills every page of it again on first touch: measured on 2 CPU cores, 32k page faults a step of
    the bench's ``small`` shape and 260k of its ``vocab128k`` one. Kept, it is filled in place."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, role: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised [rows, cols] view of ``role``'s buffer, grown (never shrunk) to fit."""
        size = rows * cols
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype or buffer.device != device:
            self._buffers.pop(role, None)  # let the old one go before the larger one is allocated
            buffer = self._buffers[role] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:size].view(rows, cols)

    def clear(self) -> None:
        """Return the memory (the next chunk allocates afresh)."""
        self._buffers.clear()


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk: int | None = None, softcap: float | None = None,
                             buffer: ChunkBuffer | None = None) -> torch.Tensor:
    """``next_token_loss_sum`` of the logits ``hidden @ weight.T`` (capped as ``tanh(l / softcap) * softcap`` when
    ``softcap``), ``hidden`` [batch, seq, dim] and ``labels`` [batch, seq], without the logits of more than one
    chunk of ``chunk`` tokens (default: :func:`chunk_tokens`) existing at a time, and without the logits of the
    positions whose next label is ignored. ``buffer``: where the chunks' logits are written, kept by the caller from
    one step to the next (None: a buffer for this call, reused by its chunks)."""
    rows = hidden[:, :-1].flatten(0, 1)
    targets = labels[:, 1:].flatten()
    supervised = targets != IGNORE_INDEX
    if not bool(supervised.all()):  # autograd scatters the rows' gradient back (zeros for the ignored ones)
        index = supervised.nonzero().squeeze(1)
        rows, targets = rows[index], targets[index]
    chunk = chunk_tokens(weight.shape[0], chunk)
    if not torch.is_grad_enabled():  # evaluation: the losses only
        return _chunks(rows, weight, targets, chunk, softcap, False, False, buffer)[0]
    return _LinearCrossEntropySum.apply(rows, weight, targets, chunk, softcap, buffer)


def linear_cross_entropy_rows(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              chunk: int | None = None, softcap: float | None = None,
                              buffer: ChunkBuffer | None = None) -> torch.Tensor:
    """:func:`linear_cross_entropy_sum` row by row: each row's next-token loss sum [batch] (fp32, 0 for a row with no
    supervised position), :func:`next_token_loss_rows` of the (capped) logits ``hidden @ weight.T``, one chunk of
    ``chunk`` supervised positions at a time. The gradients are recomputed in backward, a chunk at a time."""
    batch, seq = labels.shape
    rows = hidden[:, :-1].flatten(0, 1)
    targets = labels[:, 1:].flatten()
    index = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # the supervised positions, flat over [batch, seq - 1]
    if len(index) < len(targets):  # autograd scatters the rows' gradient back (zeros for the ignored ones)
        rows, targets = rows[index], targets[index]
    chunk = chunk_tokens(weight.shape[0], chunk)
    if not torch.is_grad_enabled():  # evaluation: the losses only
        return _row_sums(rows, weight, targets, index, batch, seq, chunk, softcap, buffer)
    return _LinearCrossEntropyRows.apply(rows, weight, targets, index, batch, seq, chunk, softcap, buffer)


def _row_sums(hidden, weight, targets, index, batch, seq, chunk, softcap, buffer):
    """Each row's loss sum [batch]: the supervised positions' losses scattered to their places in [batch, seq - 1]
    and summed as :func:`next_token_loss_rows` sums them."""
    losses = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
    _chunks(hidden, weight, targets, chunk, softcap, False, False, buffer, losses=losses)
    placed = torch.zeros(batch * (seq - 1), dtype=torch.float32, device=hidden.device)
    return placed.index_copy_(0, index, losses).view(batch, seq - 1).sum(1)


def _chunks(hidden, weight, labels, chunk, softcap, need_hidden, need_weight, buffer=None, losses=None, scale=None,
            temperature=1.0, entropies=None):
    """(loss sum, its gradient with respect to ``hidden`` or None, to ``weight`` in fp32 or None), a chunk at a time;
    every row of ``hidden`` supervised by its label. Every [chunk, vocab] tensor is a view of ``buffer`` (a
    :class:`ChunkBuffer`; None: one for this call), each step written in place in the order the out-of-place
    formulas take (the same bits). ``losses``: an fp32 [rows] tensor that takes each row's loss as well.
    ``scale``: fp32 [rows], each row's factor on the gradients (the upstream gradient of each row's loss, applied to
    softmax minus one-hot in fp32, where autograd applies it in the plain path). ``temperature``: the (capped)
    logits are divided by it, in fp32, before the log-softmax (the sampling distribution's log-probs, as online RL
    takes them). ``entropies``: an fp32 [rows] tensor that takes each row's entropy of that distribution."""
    buffer = buffer if buffer is not None else ChunkBuffer()
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = None
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start: start + chunk], labels[start: start + chunk]
        take = partial(buffer.take, rows=len(y), cols=weight.shape[0], device=h.device)
        logits = torch.matmul(h, weight.T, out=take("logits", dtype=h.dtype))
        if softcap is not None:  # tanh(l / c) * c, with tanh(l / c) kept in the logits' place for the cap's gradient
            tanh = logits.div_(softcap).tanh_()
            logits = torch.mul(tanh, softcap, out=take("capped", dtype=h.dtype))
        # the log-softmax in fp32 (a copy of its own in a narrower dtype), written over the logits in place (aten's
        # out= variant), then the gradient over it
        if logits.dtype != torch.float32:
            logits = take("fp32", dtype=torch.float32).copy_(logits)
        if temperature != 1.0:
            logits = logits.div_(temperature)
        log_probs = torch._log_softmax(logits, -1, False, out=logits)
        if entropies is not None:  # -sum(p log p), through a buffer of its own (the log-probs are still needed)
            p_log_p = take("entropy", dtype=torch.float32).copy_(log_probs).exp_().mul_(log_probs)
            torch.neg(p_log_p.sum(-1), out=entropies[start: start + chunk])
        picked = log_probs.gather(1, y[:, None])
        total += picked.sum().neg()
        if losses is not None:
            torch.neg(picked.squeeze(1), out=losses[start: start + chunk])
        if not (need_hidden or need_weight):
            continue
        g = log_probs.exp_()  # softmax minus one-hot: d(loss sum) / d(logits)
        g[torch.arange(len(y), device=g.device), y] -= 1.0
        if scale is not None:
            g.mul_(scale[start: start + chunk, None])
        if temperature != 1.0:
            g.div_(temperature)
        if g.dtype != h.dtype:  # back to h's dtype, into a buffer whose contents are no longer needed
            g = take("capped" if softcap is not None else "logits", dtype=h.dtype).copy_(g)
        if softcap is not None:  # through tanh(l / c) * c as autograd goes: (g * c) * (1 - tanh * tanh) / c
            g = g.mul_(softcap).mul_(tanh.mul_(tanh).neg_().add_(1)).div_(softcap)
        if grad_hidden is not None:
            torch.matmul(g, weight, out=grad_hidden[start: start + chunk])
        if need_weight:
            if grad_weight is None:  # the first chunk's product is the sum so far: no zeros to add it to
                grad_weight = (g.T @ h).float()
            elif grad_weight.dtype == g.dtype:
                grad_weight.addmm_(g.T, h)
            else:
                grad_weight += (g.T @ h).float()
    if need_weight and grad_weight is None:  # no supervised row
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return total, grad_hidden, grad_weight


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, softcap, buffer):
        total, grad_hidden, grad_weight = _chunks(hidden, weight, labels, chunk, softcap, *ctx.needs_input_grad[:2],
                                                  buffer)
        ctx.grads = (grad_hidden, grad_weight, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight, dtype = ctx.grads
        ctx.grads = None
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(dtype)
        return grad_hidden, grad_weight, None, None, None, None


class _LinearCrossEntropyRows(torch.autograd.Function):
    """Forward: the row sums only, keeping the supervised hidden rows, the weight, the targets and the positions.
    Backward: each chunk's logits and softmax again, softmax minus one-hot scaled by its row's upstream gradient.

    Under FSDP2 (``training.fsdp.shard_model``) the output weight belongs to the root unit, which FSDP2 does not
    reshard after forward (with ``reshard_after_forward`` left at its default, as ``shard_model`` leaves it: the root's
    parameters would be all-gathered again at once for backward), so the unsharded weight kept here is still whole
    when backward recomputes the logits with it (tests/test_sequence_logps.py checks it on two processes)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, index, batch, seq, chunk, softcap, buffer):
        ctx.save_for_backward(hidden, weight, targets, torch.div(index, max(seq - 1, 1), rounding_mode="floor"))
        ctx.settings = (chunk, softcap, buffer)
        return _row_sums(hidden, weight, targets, index, batch, seq, chunk, softcap, buffer)

    @staticmethod
    def backward(ctx, grad_rows):
        hidden, weight, targets, row_of = ctx.saved_tensors
        chunk, softcap, buffer = ctx.settings
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = grad_weight = None
        if need_hidden or need_weight:
            scale = grad_rows.float()[row_of]  # each supervised position's row's upstream gradient
            _, grad_hidden, grad_weight = _chunks(hidden, weight, targets, chunk, softcap, need_hidden, need_weight,
                                                  buffer, scale=scale)
            if grad_weight is not None:
                grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None
