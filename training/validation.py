"""A validation split and its loss.

``validation: {source: PATH, every_n_steps: N}`` reads another file with the training dataset's settings;
``validation: {fraction: 0.05, every_n_steps: N}`` holds out that share of the training records, chosen by a
permutation of the run's seed (the same split on every run and resume; the held-out records never train).
Every ``every_n_steps`` optimizer steps, and after the last one, the mean next-token loss over the split's
supervised tokens is computed without dropout, on every rank alike (each takes its share of every batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, Subset

from waypoint.errors import CheckpointError
from waypoint.training.fsdp import reshard
from waypoint.training.loss import model_inputs, model_loss_sum, supervised_tokens


@dataclass
class Validation:
    dataset: Dataset
    every_n_steps: int

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every_n_steps == 0 or step == last_step


def split(options: Mapping | None, train: Dataset, make: Callable[[str], Dataset], seed: int) -> tuple[Dataset, Validation | None]:
    """(the training dataset, the validation) for the config's ``validation`` section (None: no validation);
    ``make(source)``: the training dataset's class and settings on another file."""
    if not options:
        return train, None
    unknown = set(options) - {"source", "fraction", "every_n_steps"}
    if unknown or ("source" in options) == ("fraction" in options):
        raise CheckpointError("validation: give either source (a file) or fraction (of the training records), and "
                         f"every_n_steps{f'; unknown {sorted(unknown)}' if unknown else ''}")
    every = options.get("every_n_steps")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise CheckpointError(f"validation.every_n_steps: expected an integer >= 1, got {every!r}")
    if "source" in options:
        return train, Validation(make(options["source"]), every)
    fraction = options["fraction"]
    n_held = round(fraction * len(train)) if isinstance(fraction, (int, float)) and 0 < fraction < 1 else 0
    if not 1 <= n_held < len(train):
        raise CheckpointError(f"validation.fraction: {fraction!r} of {len(train)} records holds out none or all of them")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    held = sorted(order[:n_held])
    kept = sorted(order[n_held:])
    return Subset(train, kept), Validation(Subset(train, held), every)


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
