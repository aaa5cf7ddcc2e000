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
    (every micro-batch of every rank), whatever the split. Returns (that loss, the step's tokens, the mean
    load-balancing loss of a mixture-of-experts model or None), summed or averaged over ranks.

    Each micro-batch's loss sum is divided by the global token count; under FSDP, which averages gradients
    over ranks, it is also multiplied by the number of ranks. A MoE model's load-balancing loss (``model.aux_loss()``,
    transformers' ``aux_loss``) is added to each micro-batch's loss times ``router_aux_loss_coef``, averaged over the
    step's micro-batches. ``dist``: a ``waypoint.training.distributed.Distributed``.
    """
    n_supervised = max(dist.sum(sum(supervised_tokens(b["labels"]) for b in micro_batches)), 1)
    n_micro = len(micro_batches) * dist.world_size
    coef = getattr(getattr(model, "args", None), "router_aux_loss_coef", 0.0)
    loss_sum, aux_sum, has_aux = 0.0, 0.0, False
    for batch in micro_batches:
        logits = model(batch["tokens"].to(device))
        loss = next_token_loss_sum(logits, batch["labels"].to(device)) / n_supervised
        aux = model.aux_loss() if hasattr(model, "aux_loss") else None
        total = loss if aux is None else loss + coef * aux / n_micro
        (total * dist.world_size).backward()
        loss_sum += loss.item()
        if aux is not None:
            has_aux, aux_sum = True, aux_sum + aux.item() / n_micro
    tokens = int(dist.sum(sum(b["tokens"].numel() for b in micro_batches)))
    return dist.sum(loss_sum), tokens, dist.sum(aux_sum) if has_aux else None
