"""Next-token cross-entropy over supervised positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def supervised_tokens(labels: torch.Tensor) -> int:
    """How many positions of ``labels`` [batch, seq] a next-token loss supervises."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy of ``logits[:, t]`` against ``labels[:, t + 1]`` (in fp32), ignoring -100.

    Summing (not averaging) per micro-batch and dividing by the tokens of the whole
    optimizer step makes gradient accumulation equal to one large batch.
    """
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def forward_backward(model: torch.nn.Module, micro_batches: list[dict], device: torch.device,
                     dist) -> tuple[float, int, float | None]:
    """One optimizer step's gradients: the mean loss over the supervised tokens of the whole global batch
    (every micro-batch of every rank), whatever the split of each micro-batch over ranks. Returns (that loss,
    the step's tokens, the load-balancing loss of a mixture-of-experts model averaged over micro-batches, or None).

    Each micro-batch's loss sum is divided by the global token count; under FSDP, which averages gradients
    over ranks, it is also multiplied by the number of ranks. ``dist``: a ``waypoint.training.distributed.Distributed``.
    """
    n_supervised = max(dist.sum(sum(supervised_tokens(b["labels"]) for b in micro_batches)), 1)
    loss_sum, aux_sum, has_aux = 0.0, 0.0, False
    for batch in micro_batches:
        packed = {k: batch[k].to(device) for k in ("positions", "document_ids") if k in batch}
        logits = model(batch["tokens"].to(device), **packed)
        loss = next_token_loss_sum(logits, batch["labels"].to(device)) / n_supervised
        total = loss
        aux = balance_share(model, dist, batch.get("mask"))
        if aux is not None:  # MoE: the load-balancing loss, weighted by router_aux_loss_coef, averaged over micro-batches
            share, value = aux
            total = loss + model.args.router_aux_loss_coef * share / len(micro_batches)
            has_aux, aux_sum = True, aux_sum + value / len(micro_batches)
        (total * dist.world_size).backward()
        loss_sum += loss.item()
    # the samples' own tokens (padding aside, where the collate marks it): what packing raises
    tokens = int(dist.sum(sum(int(b["mask"].sum()) if "mask" in b else b["tokens"].numel() for b in micro_batches)))
    return dist.sum(loss_sum), tokens, aux_sum if has_aux else None


def balance_share(model: torch.nn.Module, dist, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, float] | None:
    """A mixture-of-experts model's load-balancing loss (transformers' ``aux_loss``) over the micro-batch of every
    rank, padding left out (``mask``): (this rank's differentiable share, whose sum over ranks is the loss; the loss's
    value). The expert counts and probability sums are summed over ranks first, so N processes train as one with
    the same global batch. None for a dense model."""
    from waypoint.models.moe import balance_loss

    stats = model.aux_stats(mask) if hasattr(model, "aux_stats") else None
    if stats is None:
        return None
    counts, prob_sum, rows = stats
    n_experts = model.args.n_experts
    counts_all, prob_all, rows_all = dist.sum_tensor(counts), dist.sum_tensor(prob_sum), dist.sum(rows)
    # d share / d prob_sum on this rank = d loss / d (global prob_sum): the gradient of the whole batch's loss
    share = balance_loss(counts_all, prob_sum, rows_all, n_experts)
    return share, float(balance_loss(counts_all, prob_all, rows_all, n_experts))
