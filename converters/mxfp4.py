"""MXFP4 (gpt-oss's experts) as a converter op: ``[*_blocks, *_scales]`` <-> the dense tensor, through the codec in
``waypoint.mxfp4`` (its rounding and round-trip facts are stated there).

``MXFP4`` is lossy: ``inverse(forward(x))`` need not give back x's bytes, so a writer should keep the original
bytes of a tensor the run did not change (``checkpointers.quantization``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from waypoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4


@dataclass(frozen=True)
class MXFP4:
    """gpt-oss's ``[*_blocks, *_scales]`` (uint8) <-> the dense ``[..., G * 32]`` tensor in ``dtype``.

    Lossy: ``inverse(forward(x))`` is not guaranteed bitwise (an MXFP4 value has more than one encoding, and a
    trained dense tensor is rounded), so a writer should keep the original bytes of a tensor the run did not change.
    """

    dtype: torch.dtype = torch.bfloat16
    lossy: ClassVar[bool] = True

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) != 2:
            raise ValueError(f"got {len(tensors)} tensors, expected blocks and scales")
        return [dequantize_mxfp4(tensors[0], tensors[1], self.dtype)]

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) != 1:
            raise ValueError(f"got {len(tensors)} tensors to quantize, expected 1")
        return list(quantize_mxfp4(tensors[0]))


__all__ = ["MXFP4", "dequantize_mxfp4", "quantize_mxfp4"]
