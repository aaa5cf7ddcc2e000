"""Deterministic, resumable batch order.

The order of an epoch is a function of ``(seed, epoch)`` alone, so a run resumed at
batch ``k`` of an epoch sees exactly the batches an uninterrupted run would have
seen from ``k`` on, and the skipped batches' items are never loaded.

With several processes, batch ``k`` is the ``batch_size * world_size`` samples
``order[k * batch_size * world_size:][:batch_size * world_size]`` and rank ``r`` takes
its ``r``-th ``batch_size`` of them: the sample stream does not depend on the number
of processes, so a run resumed on another world size (same global batch) continues it
with no repeats and no gaps, and one process with ``batch_size * world_size`` sees
the same samples per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from waypoint.errors import CheckpointError

_EPOCH_STRIDE = 1_000_003  # prime: (seed, epoch) pairs map to distinct generator seeds for epochs < stride


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The shuffled sample order of ``epoch``: a permutation of ``range(num_samples)``."""
    generator = torch.Generator().manual_seed((seed * _EPOCH_STRIDE + epoch) % 2**63)
    return torch.randperm(num_samples, generator=generator).tolist()


def batches_per_epoch(num_samples: int, batch_size: int) -> int:
    """Full batches in an epoch (the last, partial batch is dropped)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return num_samples // batch_size


def optimizer_steps_per_epoch(num_samples: int, batch_size: int, accumulate: int, world_size: int,
                    max_steps: int | None = None) -> int:
    """Optimizer steps in an epoch of ``batch_size x accumulate x world_size`` samples each (capped by ``max_steps``)."""
    steps = num_samples // (batch_size * accumulate * world_size)
    if max_steps:
        steps = min(steps, max_steps)
    if steps < 1:
        raise CheckpointError(f"dataset has {num_samples} samples: too few for batch_size={batch_size} "
                         f"x gradient_accumulation_steps={accumulate} x {world_size} processes")
    return steps


def iterate_batches(dataset, batch_size: int, seed: int, epoch: int, collate_fn: Callable[[list], Any],
                    start_batch: int = 0, shuffle: bool = True, rank: int = 0,
                    world_size: int = 1) -> Iterator[tuple[int, Any]]:
    """Yield ``(batch_index, collate_fn(items))`` for this rank's part of the full batches of ``epoch``,
    from ``start_batch`` on.

    Batches before ``start_batch`` are skipped without reading their items. Arguments are
    checked at the call, not at the first ``next()``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    num_batches = batches_per_epoch(len(dataset), batch_size * world_size)
    if not 0 <= start_batch <= num_batches:
        raise ValueError(f"start_batch must be in [0, {num_batches}] (batches per epoch), got {start_batch}")
    order = epoch_permutation(len(dataset), seed, epoch) if shuffle else list(range(len(dataset)))
    return _batches(dataset, order, batch_size, range(start_batch, num_batches), collate_fn, rank, world_size)


def _batches(dataset, order: list[int], batch_size: int, indices: range, collate_fn: Callable[[list], Any],
             rank: int, world_size: int) -> Iterator[tuple[int, Any]]:
    for index in indices:
        first = (index * world_size + rank) * batch_size
        yield index, collate_fn([dataset[i] for i in order[first:first + batch_size]])
