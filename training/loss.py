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
