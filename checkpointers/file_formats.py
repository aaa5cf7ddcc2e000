"""Reading and writing one weight file: safetensors or a PyTorch pickle (``.bin``/``.pt``).

Reads are memory-mapped and lazy (pages are read when a tensor is touched, and
the mapping is private, so writing to a loaded tensor never writes the file).
Pickles are opened with ``weights_only=True``: a checkpoint is data, never code.
Writes go to a file object (``commit.StagedDir`` provides one that hashes and
fsyncs inside a temporary directory renamed into place once complete).

Safetensors are written by a streaming writer: header, then each tensor's bytes straight from its memory.
``safetensors.torch.save_file`` first copies every tensor into a bytes buffer; this writer hands the tensors' own
memory to the file object, so a save needs no second copy of a shard and the bytes can be hashed as they are
written. The output is byte-identical to ``safetensors.torch.save`` (tests check it), and any safetensors reader
loads it.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from waypoint.errors import CheckpointError, first_line
from waypoint.lazy import on_host

SAFETENSORS = "safetensors"
TORCH = "torch"


def read_json(path: Path) -> dict:
    """A checkpoint's description file (config.json, params.json, ...); one-line errors naming it."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (this checkpoint format needs {path.name})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid json ({e})") from e


def json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


def format_of(path: str | Path) -> str:
    name = Path(path).name
    if name.endswith(".safetensors"):
        return SAFETENSORS
    if name.endswith((".bin", ".pt", ".pth")):
        return TORCH
    raise CheckpointError(f"{path}: not a weight file (expected .safetensors, .bin, .pt or .pth)")


def load_pickle(path: str | Path, mmap: bool = True, unmapped: list[str] | None = None) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain data, never code. Memory-mapped unless the file has the
    legacy (pre-zip) layout, which cannot be: then it is read into memory and its name added to ``unmapped``. A
    pickle that references a global (a function, a class) is refused in one line naming it."""
    path = Path(path)
    legacy = not zipfile.is_zipfile(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and not legacy)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"references {named.group(1)}, which is not allowed" if named else f"is refused ({first_line(e)})"
        raise CheckpointError(f"refused: pickle in {path} {what} (a checkpoint is data, never code)") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({first_line(e)})") from e
    if legacy and mmap and unmapped is not None:
        unmapped.append(path.name)
    return state


def read_tensors(path: str | Path, unmapped: list[str] | None = None,
                 packed: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of one file, memory-mapped; a damaged file, or one holding other than floating-point tensors,
    is a one-line error naming it (and the key). ``unmapped``: where to name a file read into memory instead;
    ``packed(key)``: whether the key may hold a quantized format's integer bytes (its config says so)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file not found")
    if format_of(path) == SAFETENSORS:
        try:
            state = load_file(path)
        except (SafetensorError, RuntimeError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: unreadable weight file ({first_line(e)})") from e
    else:
        state = load_pickle(path, unmapped=unmapped)
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a flat dict of tensors")
    for key, t in state.items():
        if not t.is_floating_point() and not (packed is not None and packed(key)):
            raise CheckpointError(f"{path}: {key} is {str(t.dtype).removeprefix('torch.')}; weights must be floating point, "
                                  "or a quantized format config.json's quantization_config names: Waypoint reads mxfp4 "
                                  "(uint8 *_blocks and *_scales) and block fp8 (float8_e4m3fn weights, float32 or "
                                  "bfloat16 *_scale_inv)")
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
        # on_host: detached (a new tensor object, without a dequantized FP8 weight's fp8_source to pickle), off its device
        torch.save({k: on_host(v, k).contiguous() for k, v in tensors.items()}, f)


# The library's header order: tensors sorted by dtype (this rank, highest first), then by name.
_DTYPE_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
                "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
_NAMES = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64", torch.float32: "F32",
    torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16",
    torch.int16: "I16", torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _raw_bytes(name: str, t: torch.Tensor) -> memoryview:
    t = on_host(t, name).contiguous()  # one tensor at a time off its device
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(f, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` in the safetensors format to the binary file object ``f``."""
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
    order = sorted(tensors, key=lambda k: (_DTYPE_ORDER.index(_NAMES[tensors[k].dtype]), k))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    write_payload = getattr(f, "write_stable", f.write)  # tensors do not change while they are saved
    for name in order:
        write_payload(_raw_bytes(name, tensors[name]))
