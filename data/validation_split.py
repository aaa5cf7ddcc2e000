"""A validation split: which records are held out, and when they are scored.

``validation: {source: PATH, every_n_steps: N}`` reads another file with the training dataset's settings;
``validation: {fraction: 0.05, every_n_steps: N}`` holds out that share of the training records, chosen by a
permutation of the run's seed (the same split on every run and resume; the held-out records never train). Their loss
is ``waypoint.training.validation``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, Subset

from waypoint.errors import CheckpointError


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
