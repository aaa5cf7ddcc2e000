"""One process or many: what the recipes need from torch.distributed, in one place.

Under ``torchrun`` (``WORLD_SIZE`` > 1) :func:`init_distributed` starts the process group
(NCCL with Gloo beside it on GPU, Gloo on CPU), a 1-D device mesh for FSDP2, and a second
Gloo group for the collectives of a save running in a background thread, so they never
interleave with the training thread's (which use the default group). Without ``torchrun`` every helper here is
a no-op and the recipes run as a single process.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from waypoint.errors import CheckpointError


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    mesh: Any = None  # DeviceMesh when world_size > 1
    checkpoint_group: Any = None  # Gloo group for collectives issued by a background save thread
    local_rank: int = 0  # the rank within this machine (torchrun's LOCAL_RANK): 0 is the machine's first process

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives (identity in a single process) -----------------------------------
    def sum(self, value: float | int) -> float:
        """The sum over ranks of a Python number (exact for integers below 2**53)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    def sum_tensor(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a tensor (detached: collectives carry no gradient)."""
        value = value.detach().clone()
        if self.enabled:
            dist.all_reduce(value)
        return value

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on one (a preemption signal reaches ranks at different times)."""
        return bool(self.sum(int(bool(flag)))) if self.enabled else bool(flag)

    def broadcast(self, obj: Any, group=None) -> Any:
        """Rank 0's ``obj`` on every rank (``group``: the default, or ``checkpoint_group`` from a save thread)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def gather(self, obj: Any, group=None) -> list[Any] | None:
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=group)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` as a list, on every rank, in rank order."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def run_on_main(self, fn: Callable[[], Any], others: Callable[[], Any] | None = None) -> Any:
        """``fn()`` on rank 0 (decisions about output_dir, writing a checkpoint) and ``others()`` meanwhile on
        the other ranks (serving rank 0's gathers); rank 0's result on every rank, and its CheckpointError
        raised on every rank rather than leaving the others waiting."""
        result = error = None
        if self.is_main:
            try:
                result = fn()
            except CheckpointError as e:
                if not self.enabled:
                    raise
                error = str(e)
        elif others is not None:
            others()
        result, error = self.broadcast((result, error))
        if error is not None:
            raise CheckpointError(error)
        return result

    def run_on_each_machine(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, then on the first process of every other machine (each with its own local disk:
        preparing a local cache); rank 0's result on every rank, and the first CheckpointError raised on all."""
        result = self.run_on_main(fn)
        if not self.enabled:
            return result
        error = None
        if self.local_rank == 0 and not self.is_main:
            try:
                fn()
            except CheckpointError as e:
                error = str(e)
        errors = [None] * self.world_size
        dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise CheckpointError(first)
        return result

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device: str) -> Distributed:
    """The process group for this process (``torchrun`` sets RANK/WORLD_SIZE/LOCAL_RANK), or a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    requested = torch.device(device)
    if world_size == 1:
        return Distributed(device=requested)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if requested.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError("device=cuda but this machine has no CUDA device; use device=cpu")
        torch.cuda.set_device(local_rank)
        placed, backend = torch.device("cuda", local_rank), "cuda:nccl,cpu:gloo"
    elif requested.type == "cpu":
        placed, backend = requested, "gloo"
    else:
        raise CheckpointError(f"device={device}: under torchrun use cpu or cuda")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(placed.type, (world_size,))
    checkpoint_group = dist.new_group(backend="gloo")
    return Distributed(rank=rank, world_size=world_size, device=placed, mesh=mesh, checkpoint_group=checkpoint_group,
                       local_rank=local_rank)
