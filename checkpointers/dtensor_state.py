"""Between whole tensors and FSDP2's sharded ones (DTensors), one tensor at a time.

Loading: :func:`waypoint.lazy.local_shard` cuts a rank's piece out of a whole (memory-mapped) tensor,
so only that piece is read and copied. Saving in a checkpoint format: :class:`GatheredState`
is a read-only mapping on rank 0 whose ``state[key]`` gathers that one tensor from every
rank while the others run :func:`serve_gathers`; a checkpointer writing file after file
from it holds about one output file at a time, never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

_DONE = None  # the key that ends serve_gathers


def gather_to_main(value: DTensor) -> torch.Tensor | None:
    """The whole tensor on the mesh's first rank, on the CPU (None on the others); every rank takes part.

    FSDP2's row shards (``Shard(0)`` on a 1-D mesh) are received straight into their rows of one
    buffer, so rank 0 holds the tensor once (an all-gather would hold it twice, and on every rank);
    other layouts fall back to ``full_tensor()``.
    """
    mesh = value.device_mesh
    if mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
        whole = value.full_tensor()
        return whole.cpu() if mesh.get_local_rank() == 0 else None
    group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    rows = value.shape[0]
    chunk = -(-rows // world) if rows else 0  # torch.chunk's piece size: rank r holds rows [r*chunk, (r+1)*chunk)
    bounds = [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world)]
    local = value.to_local()
    if me != 0:
        if bounds[me][1] > bounds[me][0]:
            dist.send(local.contiguous(), dst=dist.get_global_rank(group, 0), group=group)
        return None
    out = torch.empty(value.shape, dtype=value.dtype, device=local.device)
    out[bounds[0][0]:bounds[0][1]].copy_(local)
    for r in range(1, world):
        start, end = bounds[r]
        if end > start:
            dist.recv(out[start:end], src=dist.get_global_rank(group, r), group=group)
    return out.cpu()


class GatheredState(Mapping):
    """Rank 0's view of a sharded state dict: ``state[key]`` is the whole tensor, gathered on demand.

    Every access is a collective: the other ranks must be in :func:`serve_gathers` on the same
    ``group``, and rank 0 must call :meth:`close` when done (``with`` does it) to release them.
    """

    def __init__(self, state: Mapping[str, Any], group=None) -> None:
        self._state = state
        self._group = group

    def __getitem__(self, key: str) -> Any:
        value = self._state[key]
        if not isinstance(value, DTensor):
            return value.cpu() if isinstance(value, torch.Tensor) else value
        dist.broadcast_object_list([key], src=0, group=self._group)
        return gather_to_main(value)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of the whole tensor, without gathering it."""
        value = self._state[key]
        return value.shape, value.dtype

    def close(self) -> None:
        dist.broadcast_object_list([_DONE], src=0, group=self._group)

    def __enter__(self) -> GatheredState:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_gathers(state: Mapping[str, Any], group=None) -> int:
    """On ranks other than 0: take part in each gather rank 0's :class:`GatheredState` asks for; the count."""
    served = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is _DONE:
            return served
        gather_to_main(state[box[0]])
        served += 1
