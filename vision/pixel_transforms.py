"""transformers' ``image_transforms.rescale`` and ``normalize`` as its image processors apply them, bit for bit: the
rescale a float64 product cast to float32, the normalization in float32; every family's processor uses them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rescale_and_normalize(pixels: np.ndarray, rescale: float | None, mean: Sequence[float] | None,
                          std: Sequence[float] | None) -> np.ndarray:
    """``pixels`` [..., channels] scaled by ``rescale`` (None: not), then ``(x - mean) / std`` (None: not), float32."""
    if rescale is not None:
        pixels = (pixels.astype(np.float64) * rescale).astype(np.float32)
    if mean is not None:
        pixels = pixels if np.issubdtype(pixels.dtype, np.floating) else pixels.astype(np.float32)
        pixels = (pixels - np.array(mean, dtype=pixels.dtype)) / np.array(std, dtype=pixels.dtype)
    return np.asarray(pixels, dtype=np.float32)
