"""Reading and writing one weight file: safetensors or a PyTorch pickle (``.bin``/``.pt``).

Reads are memory-mapped and lazy (pages are read when a tensor is touched, and
the mapping is private, so writing to a loaded tensor never writes the file).
Pickles are opened with ``weights_only=True``: a checkpoint is data, never code.
Writes go to a temporary name in the target's directory, are fsynced, and are
renamed into place, so a reader (or a memory map of the old file) never sees a
half-written file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from converters.errors import CheckpointError

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


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, write) -> None:
    """Call ``write(tmp_path)``, fsync the result, and rename it to ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` in the format named by ``path``'s suffix, atomically."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if format_of(path) == SAFETENSORS:
        write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=dict(metadata) if metadata else None))
    else:
        write_atomic(path, lambda tmp: torch.save(tensors, tmp))


def write_bytes(path: str | Path, data: bytes) -> None:
    def _write(tmp: Path) -> None:
        tmp.write_bytes(data)
    write_atomic(path, _write)
