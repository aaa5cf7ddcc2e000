"""Each supervised token's log-probability and the entropy of its distribution, through the output projection a chunk
of tokens at a time: what online RL (GRPO) needs of the policy, per completion token, never the full logits.

:func:`linear_token_logps` is :func:`waypoint.models.fused_loss.linear_cross_entropy_rows` without the sum over a row:
forward keeps the supervised hidden rows and the weight and returns the log-probs [batch, seq - 1] (0 where the
label is ignored) with the entropies beside them (no gradient); backward recomputes each chunk's logits and softmax
and scales softmax minus one-hot by each token's own upstream gradient. ``temperature`` divides the (capped) logits
before the log-softmax, as TRL's ``GRPOTrainer`` divides them, so the log-probs are those of the distribution the
completions were sampled from. :func:`token_logps_from_logits` is the same from full logits (the plain path, for an
output projection the fused path cannot use, such as a LoRA layer's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from waypoint.models.fused_loss import IGNORE_INDEX, _chunks, chunk_tokens

__all__ = ["linear_token_logps", "token_logps_from_logits"]


def _supervised(hidden: torch.Tensor, labels: torch.Tensor):
    rows = hidden[:, :-1].flatten(0, 1)
    targets = labels[:, 1:].flatten()
    index = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    if len(index) < len(targets):
        rows, targets = rows[index], targets[index]
    return rows, targets, index


def _placed(values: torch.Tensor, index: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    placed = torch.zeros(batch * (seq - 1), dtype=torch.float32, device=values.device)
    return placed.index_copy_(0, index, values).view(batch, seq - 1)


def linear_token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None,
                       softcap: float | None = None, temperature: float = 1.0,
                       buffer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies), each fp32 [batch, seq - 1]: position ``t`` holds ``log p(labels[:, t + 1])`` under the
    logits ``hidden[:, t] @ weight.T`` (capped when ``softcap``, then divided by ``temperature``) and the entropy of
    that distribution; 0 at positions whose next label is ignored."""
    batch, seq = labels.shape
    rows, targets, index = _supervised(hidden, labels)
    chunk = chunk_tokens(weight.shape[0], chunk)
    if not torch.is_grad_enabled():
        return _forward(rows, weight, targets, index, batch, seq, chunk, softcap, temperature, buffer)
    return _LinearTokenLogps.apply(rows, weight, targets, index, batch, seq, chunk, softcap, temperature, buffer)


def _forward(rows, weight, targets, index, batch, seq, chunk, softcap, temperature, buffer):
    losses = torch.empty(len(targets), dtype=torch.float32, device=rows.device)
    entropies = torch.empty(len(targets), dtype=torch.float32, device=rows.device)
    _chunks(rows, weight, targets, chunk, softcap, False, False, buffer, losses=losses, temperature=temperature,
            entropies=entropies)
    return _placed(losses.neg_(), index, batch, seq), _placed(entropies, index, batch, seq)


class _LinearTokenLogps(torch.autograd.Function):
    """Forward: the log-probs and entropies only, keeping the supervised hidden rows, the weight and the targets.
    Backward: each chunk's logits and softmax again, softmax minus one-hot scaled by minus its token's upstream
    gradient (a log-prob is minus a loss). The output weight stays unsharded between the two under FSDP2, as for
    ``linear_cross_entropy_rows``."""

    @staticmethod
    def forward(ctx, rows, weight, targets, index, batch, seq, chunk, softcap, temperature, buffer):
        ctx.save_for_backward(rows, weight, targets, index)
        ctx.settings = (chunk, softcap, temperature, buffer)
        logps, entropies = _forward(rows, weight, targets, index, batch, seq, chunk, softcap, temperature, buffer)
        ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropies):
        rows, weight, targets, index = ctx.saved_tensors
        chunk, softcap, temperature, buffer = ctx.settings
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_rows = grad_weight = None
        if need_hidden or need_weight:
            scale = grad_logps.flatten().float()[index].neg()
            _, grad_rows, grad_weight = _chunks(rows, weight, targets, chunk, softcap, need_hidden, need_weight, buffer,
                                                scale=scale, temperature=temperature)
            if grad_weight is not None:
                grad_weight = grad_weight.to(weight.dtype)
        return grad_rows, grad_weight, None, None, None, None, None, None, None, None


def token_logps_from_logits(logits: torch.Tensor, labels: torch.Tensor,
                            temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_token_logps` from full logits [batch, seq, vocab] (already capped)."""
    batch, seq = labels.shape
    log_probs = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    targets = labels[:, 1:]
    supervised = targets != IGNORE_INDEX
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * supervised
    with torch.no_grad():
        entropies = -(log_probs.exp() * log_probs).sum(-1) * supervised
    return picked, entropies
