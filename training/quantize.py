"""``quantize_base`` in a LoRA config: the frozen base held quantized, set up on the meta-built model before the base
loads, so each weight is quantized as it is read and the full-precision base never exists in memory.

- ``nf4`` (QLoRA): the linear weights in 4 bits (``waypoint.models.nf4``). ``nf4.block_size`` values share a scale
  (64 in the QLoRA paper), ``nf4.scaler_block_size`` scales share the double quantization's (256); ``nf4.output``
  also holds the output head in 4 bits. A weight whose size does not divide into those blocks stays in the compute
  dtype, named in the run's first lines.
- ``mxfp4``: the mixture-of-experts weights (every MoE's w1, w3, w2) in MXFP4, gpt-oss's own format
  (``waypoint.models.mxfp4_weight``): an MXFP4 checkpoint's experts keep exactly their values, at 4.25 bits each.
  Attention, embeddings, norms, router and head stay in the compute dtype. One process only (FSDP2 cannot shard it).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from waypoint.checkpointers.load_report import fold_keys
from waypoint.errors import CheckpointError
from waypoint.models import parse_dtype
from waypoint.models.mxfp4_weight import quantize_experts
from waypoint.models.nf4 import QUANTIZE_BASE, QuantizedBase, quantize_linears


@dataclass(frozen=True)
class NF4Options:
    """The config's ``nf4`` section (the QLoRA paper's blocks by default)."""

    block_size: int = 64
    scaler_block_size: int = 256
    output: bool = False


def quantize_base(model: nn.Module, dtype: str, method: str | None, nf4: NF4Options | None = None, shards: int = 1) -> list[str]:
    """Make the base's frozen weights quantized placeholders as ``method`` (``quantize_base``: None, ``nf4`` or
    ``mxfp4``) says, the rest held in ``dtype``; the lines to print. ``shards``: the FSDP2 world size."""
    if method is None:
        return []
    if method not in QUANTIZE_BASE:
        raise CheckpointError(f"quantize_base={method}: expected null or one of {', '.join(QUANTIZE_BASE)}")
    if method == "mxfp4":
        return _mxfp4(model, dtype, shards)
    nf4 = nf4 or NF4Options()
    done = quantize_linears(model, parse_dtype(dtype), nf4.block_size, nf4.scaler_block_size, nf4.output, shards)
    if not done.quantized:
        first, why = next(iter(done.kept.items()), ("(no linear layer)", "none found"))
        raise CheckpointError(f"quantize_base=nf4: no base weight can be held in NF4 ({first}: {why}); choose a smaller "
                              "nf4.block_size or nf4.scaler_block_size")
    return [f"nf4: {len(done.quantized)} frozen base weights held in 4 bits (blocks of {nf4.block_size}, "
            f"scales in blocks of {nf4.scaler_block_size}); the rest in {dtype}"] + _kept("nf4", done, dtype)


def _mxfp4(model: nn.Module, dtype: str, shards: int) -> list[str]:
    if shards > 1:
        raise CheckpointError("quantize_base=mxfp4 is single-process; under torchrun (FSDP2) set quantize_base=null "
                              "(the experts sharded in dtype) or run one process")
    done = quantize_experts(model, parse_dtype(dtype))
    if not done.quantized:
        if not done.kept:
            raise CheckpointError("quantize_base=mxfp4 holds mixture-of-experts weights (each MoE layer's w1, w2, w3) "
                                  "in MXFP4, and this model has none; quantize_base=nf4 holds its linear layers in 4 bits")
        first, why = next(iter(done.kept.items()))
        raise CheckpointError(f"quantize_base=mxfp4: no expert weight can be held in MXFP4 ({first}: {why})")
    return [f"mxfp4: {len(done.quantized)} expert weights held in MXFP4 (4.25 bits a value: blocks of 32 sharing a "
            f"scale); the rest in {dtype}"] + _kept("mxfp4", done, dtype)


def _kept(method: str, done: QuantizedBase, dtype: str) -> list[str]:
    reasons: dict[str, list[str]] = {}
    for key, why in done.kept.items():
        reasons.setdefault(why, []).append(key)
    return [f"{method}: kept in {dtype}: {', '.join(fold_keys(keys))} ({why})" for why, keys in reasons.items()]
