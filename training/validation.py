"""A validation split's loss (the split itself: ``waypoint.data.validation_split``).

Every ``every_n_steps`` optimizer steps, and after the last one, the mean next-token loss over the split's
supervised tokens is computed without dropout, on every rank alike (each takes its share of every batch).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from waypoint.training.fsdp import reshard
from waypoint.training.loss import model_inputs, model_loss_sum, supervised_tokens


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Dataset, batch_size: int, collate, device: torch.device, dist) -> float:
    """The mean next-token loss over ``dataset``'s supervised tokens, in eval mode (no dropout). Every rank runs the
    same number of forwards (a rank without items in the last batch runs one that counts nothing), as FSDP needs."""
    was_training = model.training
    model.eval()
    try:
        loss_sum, tokens = 0.0, 0
        per_step = batch_size * dist.world_size
        for start in range(0, len(dataset), per_step):
            mine = list(range(start + dist.rank * batch_size, min(start + (dist.rank + 1) * batch_size, len(dataset))))
            batch = collate([dataset[i] for i in (mine or [start])])
            loss = model_loss_sum(model, batch["tokens"].to(device), batch["labels"].to(device), **model_inputs(batch, device))
            if mine:
                loss_sum += float(loss)
                tokens += supervised_tokens(batch["labels"])
        return dist.sum(loss_sum) / max(dist.sum(tokens), 1)
    finally:
        reshard(model)  # under FSDP2, as after a training step
        model.train(was_training)
