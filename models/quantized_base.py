"""Which weights are a frozen quantized base: NF4 (``quantize_base: nf4``, ``models.nf4``) or a MoE's MXFP4 experts
(``quantize_base: mxfp4``, ``models.mxfp4_weight``). What the loader, the savers and the checks ask."""

from __future__ import annotations

import torch

from waypoint.models.mxfp4_weight import MXFP4Weight
from waypoint.models.nf4 import is_nf4


def is_quantized_base(t: torch.Tensor) -> bool:
    """Whether ``t`` (or the local piece of a sharded ``t``) is a frozen quantized base weight."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return isinstance(local, MXFP4Weight) or is_nf4(local)
