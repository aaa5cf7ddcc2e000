"""Streaming safetensors writer: header, then each tensor's bytes straight from its memory.

``safetensors.torch.save_file`` first copies every tensor into a bytes buffer; this
writer hands the tensors' own memory to the file object, so a save needs no
second copy of a shard and the bytes can be hashed as they are written. The
output is byte-identical to ``safetensors.torch.save`` (tests check it), and any
safetensors reader loads it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import torch

# The library's header order: tensors sorted by dtype (this rank, highest first), then by name.
_DTYPE_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
                "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
_NAMES = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64", torch.float32: "F32",
    torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16",
    torch.int16: "I16", torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
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
        write_payload(_raw_bytes(tensors[name]))
