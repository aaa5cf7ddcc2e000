"""Tensors computed or cut only when read: the lazy state dicts of loading, and a rank's piece of a whole tensor.

The bottom layer (with ``waypoint.errors``): models, converters and checkpointers all import it, it imports
nothing of theirs.

A state dict whose tensors are computed when read:

Loading converts (and, for Meta's model-parallel files, joins) tensors; done eagerly, every
converted tensor exists at once. :class:`LazyState` keeps a recipe per key instead, with the
shape and dtype known up front (checked on the meta device), so a reader that takes one
tensor at a time (a sharded model keeping only its rows, a writer filling one file) holds
one converted tensor at a time. Reading a key twice computes it twice: nothing is cached.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from waypoint.errors import CheckpointError


class LazyState(MutableMapping):
    """``state[key]`` runs ``thunks[key]()``; ``state.spec(key)`` is ``(shape, dtype)`` without running it.
    Values assigned with ``state[key] = value`` are kept as they are."""

    def __init__(self, thunks: dict[str, Callable[[], torch.Tensor]], specs: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        self._thunks = dict(thunks)
        self._specs = dict(specs)
        self._values: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key in self._values:
            return self._values[key]
        return self._thunks[key]()

    def __setitem__(self, key: str, value: Any) -> None:
        self._thunks.pop(key, None)
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self._values:
            del self._values[key]
        else:
            del self._thunks[key]

    def __iter__(self) -> Iterator[str]:
        yield from self._thunks
        yield from self._values

    def __len__(self) -> int:
        return len(self._thunks) + len(self._values)

    def spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        if key in self._values:
            return self._values[key].shape, self._values[key].dtype
        return self._specs[key]

    def put(self, key: str, thunk: Callable[[], torch.Tensor], spec: tuple[torch.Size, torch.dtype]) -> None:
        """``state[key]`` will run ``thunk()``, which returns a tensor of ``spec`` (shape, dtype)."""
        self._values.pop(key, None)
        self._thunks[key], self._specs[key] = thunk, spec

    def alias(self, key: str, target: str) -> None:
        """``state[key]`` reads ``state[target]`` (a tied head reads the embedding)."""
        self.put(key, lambda: self[target], self.spec(target))


def on_host(t: torch.Tensor, key: str) -> torch.Tensor:
    """``t`` (detached) on the CPU, where checkpoints are written and the input's tensors are read: a model on CUDA
    is saved from there. A tensor that holds no values (the meta device: never loaded) is a one-line error."""
    t = t.detach()
    if t.device.type == "meta":
        raise CheckpointError(f"cannot write {key}: it is on the meta device (never loaded or initialised), so there is "
                              "nothing to save; load the model's weights (and init_adapters for LoRA) before saving")
    return t if t.device.type == "cpu" else t.to("cpu")


def spec_of(state, key: str) -> tuple[torch.Size, torch.dtype]:
    """(shape, dtype) of ``state[key]``, without computing it where the mapping can tell."""
    if hasattr(state, "spec"):
        return state.spec(key)
    value = state[key]
    return value.shape, value.dtype


def on_meta(state, keys) -> dict[str, torch.Tensor]:
    """Empty meta-device stand-ins for ``state[key]``: ops run on them check shapes without touching data."""
    out = {}
    for key in keys:
        shape, dtype = spec_of(state, key)
        out[key] = torch.empty(shape, dtype=dtype, device="meta")
    return out


def nbytes(state: Mapping[str, Any], key: str) -> int:
    """Bytes of ``state[key]`` without materialising it where the mapping can tell."""
    shape, dtype = spec_of(state, key)
    return shape.numel() * dtype.itemsize


def local_shard(full: torch.Tensor, like: DTensor, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> DTensor:
    """A DTensor laid out as ``like`` holding ``full``'s values; only this rank's piece is read or moved."""
    local = full
    mesh = like.device_mesh
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            pieces = torch.chunk(local, mesh.size(mesh_dim), dim=placement.dim)
            index = mesh.get_local_rank(mesh_dim)
            local = pieces[index] if index < len(pieces) else local.narrow(placement.dim, 0, 0)
        elif not placement.is_replicate():
            raise ValueError(f"cannot load into a DTensor placed {placement}")
    local = local.to(device=device, dtype=dtype if dtype is not None and local.is_floating_point() else None,
                     copy=True).contiguous()
    return DTensor.from_local(local, mesh, like.placements, run_check=False, shape=full.shape,
                              stride=torch.empty(full.shape, device="meta").stride())


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges this process maps from files (per /proc/self/maps): their pages can be re-read."""
    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError:
        return []
    ranges = []
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and fields[3] != "00:00":
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def release_pages(*tensors: torch.Tensor) -> None:
    """Drop the resident pages of memory-mapped, read-only checkpoint tensors from this process (the page cache
    keeps them; reading a tensor again faults them back in from the file). Whole pages inside each tensor only,
    so neighbours sharing a page are untouched; anything not mapped from a file is left alone."""
    tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if sys.platform != "linux" or not tensors:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    mappings = _file_mappings()  # read once for all the tensors
    for tensor in tensors:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        low, high = -(-start // page) * page, end // page * page
        if high - low >= page and any(a <= start and end <= b for a, b in mappings):
            ctypes.CDLL(None).madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), 4)  # MADV_DONTNEED


def release_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``). Freed temporaries of a few MB
    stay in the allocator's per-thread arenas otherwise, and a loop that makes them per tensor (quantizing a
    checkpoint) grows the process by their fragments: measured, 300 MB for 100 quantized 0.8M-value tensors."""
    if sys.platform == "linux":
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except AttributeError:  # not glibc (musl has no malloc_trim)
            pass
