"""Dtype names as configs and config.json files write them."""

from __future__ import annotations

from typing import Any, Mapping

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
DTYPE_NAMES = tuple(_DTYPES)  # what dtype options accept


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """'bf16' / 'bfloat16' / 'torch.bfloat16' / torch.bfloat16 -> torch.bfloat16; None stays None."""
    if name is None or isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def hf_config_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The weights' dtype as recorded in config.json (``dtype`` in v5, ``torch_dtype`` before)."""
    return parse_dtype(config.get("dtype") or config.get("torch_dtype"))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


HF_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes config.json's "dtype" names
