"""Which weights are a frozen quantized base: NF4 (``quantize_base: nf4``, ``models.nf4``), a MoE's MXFP4 experts
(``quantize_base: mxfp4``, ``models.mxfp4_weight``) or block-FP8 linears (``quantize_base: fp8``,
``models.fp8_weight``). What the loader, the savers and the checks ask."""

from __future__ import annotations

import torch

from waypoint.fp8 import carry_source
from waypoint.models.fp8_weight import FP8Weight
from waypoint.models.mxfp4_weight import MXFP4Weight
from waypoint.models.nf4 import is_nf4


def is_quantized_base(t: torch.Tensor) -> bool:
    """Whether ``t`` (or the local piece of a sharded ``t``) is a frozen quantized base weight."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return isinstance(local, (MXFP4Weight, FP8Weight)) or is_nf4(local)


def quantized_format(t: torch.Tensor) -> str:
    """The format a quantized base weight is held in, as a load report names it: NF4, MXFP4 or FP8."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return "FP8" if isinstance(local, FP8Weight) else "MXFP4" if isinstance(local, MXFP4Weight) else "NF4"


__all__ = ["carry_source", "is_quantized_base", "quantized_format"]
