"""``quantize_base: nf4`` in a LoRA config (QLoRA): the frozen base's linear weights held in 4 bits.

Set up on the meta-built model before the base loads (``waypoint.models.nf4``), so each weight is quantized
as it is read and the full-precision base never exists in memory. ``nf4.block_size`` values share a scale
(64 in the QLoRA paper), ``nf4.scaler_block_size`` scales share the double quantization's (256); ``nf4.output``
also holds the output head in 4 bits. A weight whose size does not divide into those blocks stays in the
compute dtype, named in the run's first lines.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from waypoint.checkpointers.load_report import fold_keys
from waypoint.errors import CheckpointError
from waypoint.models import parse_dtype
from waypoint.models.nf4 import quantize_linears


@dataclass(frozen=True)
class NF4Options:
    """The config's ``nf4`` section (the QLoRA paper's blocks by default)."""

    block_size: int = 64
    scaler_block_size: int = 256
    output: bool = False


def quantize_base(model: nn.Module, dtype: str, nf4: NF4Options | None, shards: int = 1) -> list[str]:
    """Make the base's frozen linears NF4 placeholders when ``nf4`` is given (``quantize_base: nf4``), the rest held in
    ``dtype``; the lines to print."""
    if nf4 is None:
        return []
    done = quantize_linears(model, parse_dtype(dtype), nf4.block_size, nf4.scaler_block_size, nf4.output, shards)
    if not done.quantized:
        first, why = next(iter(done.kept.items()), ("(no linear layer)", "none found"))
        raise CheckpointError(f"quantize_base=nf4: no base weight can be held in NF4 ({first}: {why}); choose a smaller "
                              "nf4.block_size or nf4.scaler_block_size")
    lines = [f"nf4: {len(done.quantized)} frozen base weights held in 4 bits (blocks of {nf4.block_size}, "
             f"scales in blocks of {nf4.scaler_block_size}); the rest in {dtype}"]
    reasons: dict[str, list[str]] = {}
    for key, why in done.kept.items():
        reasons.setdefault(why, []).append(key)
    for why, keys in reasons.items():
        lines.append(f"nf4: kept in {dtype}: {', '.join(fold_keys(keys))} ({why})")
    return lines
