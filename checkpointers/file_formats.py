"""Reading and writing one weight file: safetensors or a PyTorch pickle (``.bin``/``.pt``).

Reads are memory-mapped and lazy (pages are read when a tensor is touched, and
the mapping is private, so writing to a loaded tensor never writes the file).
Pickles are opened with ``weights_only=True``: a checkpoint is data, never code.
Writes go to a file object (``commit.StagedDir`` provides one that hashes and
fsyncs inside a temporary directory renamed into place once complete).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from waypoint.checkpointers.safetensors_writer import write_safetensors

from waypoint.converters.errors import CheckpointError

SAFETENSORS = "safetensors"
TORCH = "torch"


def format_of(path: str | Path) -> str:
    name = Path(path).name
    if name.endswith(".safetensors"):
        return SAFETENSORS
    if name.endswith((".bin", ".pt", ".pth")):
        return TORCH
    raise CheckpointError(f"{path}: not a weight file (expected .safetensors, .bin, .pt or .pth)")


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of one file, memory-mapped; a damaged file is a one-line error naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file not found")
    try:
        if format_of(path) == SAFETENSORS:
            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (SafetensorError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable weight file ({str(e).splitlines()[0]})") from e
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a flat dict of tensors")
    return dict(state)


def read_metadata(path: str | Path) -> dict[str, str] | None:
    """The safetensors header metadata (``{"format": "pt"}`` for HF files); None for pickles."""
    if format_of(path) != SAFETENSORS:
        return None
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata()
    except SafetensorError as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({str(e).splitlines()[0]})") from e


def write_tensors(f, tensors: Mapping[str, torch.Tensor], file_format: str, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to the binary file object ``f`` as safetensors or a PyTorch pickle."""
    if file_format == SAFETENSORS:
        write_safetensors(f, tensors, metadata)
    else:
        torch.save({k: v.contiguous() for k, v in tensors.items()}, f)
