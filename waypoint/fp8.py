"""Block FP8, the format of DeepSeek-V3's release and of Qwen3's ``-FP8`` checkpoints: the codec.

A quantized linear weight ``X.weight`` is ``float8_e4m3fn`` ``[..., R, C]``, and ``X.weight_scale_inv`` holds one
fp32 (or bf16) scale per block of ``block = (bm, bn)`` values (``quantization_config.weight_block_size``, usually
``[128, 128]``): ``[..., ceil(R / bm), ceil(C / bn)]``, a last partial block where a dim does not divide (DeepSeek's
reference ``weight_dequant`` grids the same way). The value is ``weight * scale_inv`` of its block.

``dequantize_fp8`` multiplies in fp32 and rounds once to ``dtype``: for dims the blocks divide, bitwise what
transformers' ``Fp8Dequantize`` gives (which derives the block from the scale grid and needs it to divide).
``quantize_fp8`` is transformers' ``Fp8Quantize`` rounding (what its ``save_pretrained`` of an FP8 model writes):
per block ``scale = 448 / max|x|`` in fp32 (1 for an all-zero block), ``scale_inv = 1 / scale``, and the weight
``clamp(x * scale, -448, 448)`` cast to ``float8_e4m3fn`` (round to nearest even). DeepSeek's own quantizer
divides by ``max|x| / 448`` instead; the two can differ in the last bit of a value.

Both work one slab of rows at a time (a temporary of a few blocks' rows, never a second copy of a large weight)
and, on meta tensors, return empty meta tensors of the right shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_SLAB = 1 << 22  # values per slab of block rows


def _grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def _blockwise(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[rows, cols]`` (padded with zeros to whole blocks) -> ``[grid_r, bm, grid_c, bn]``."""
    rows, cols = t.shape
    gr, gc = _grid(rows, cols, block)
    padded = torch.nn.functional.pad(t, (0, gc * block[1] - cols, 0, gr * block[0] - rows))
    return padded.view(gr, block[0], gc, block[1])


class NonFiniteFP8(ValueError):
    """An FP8 weight of the input that dequantizes to nan/inf: the input's fault, not its conversion's (a reader
    names the file and key: ``converters.table``)."""

    input_fault = True


def _check(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    if weight.ndim < 2:
        raise ValueError(f"an FP8 weight {list(weight.shape)} must have at least 2 dims")
    expected = (*weight.shape[:-2], *_grid(weight.shape[-2], weight.shape[-1], block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight {list(weight.shape)} in blocks of {list(block)} needs scales {list(expected)}, "
                         f"got {list(scale_inv.shape)}")


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype = torch.bfloat16, finite: bool = False) -> torch.Tensor:
    """``float8_e4m3fn`` ``[..., R, C]`` and its block scales -> ``dtype`` ``[..., R, C]``; ``finite``: a ValueError
    where a value comes out nan or inf (NaN bytes, a nan/inf scale, or beyond ``dtype``'s range), checked slab by
    slab as it is made."""
    _check(weight, scale_inv, block)
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    if weight.is_meta or scale_inv.is_meta or not out.numel():
        return out
    rows, cols = weight.shape[-2:]
    flat_w, flat_s, flat_out = weight.reshape(-1, rows, cols), scale_inv.reshape(-1, *scale_inv.shape[-2:]), out.view(-1, rows, cols)
    for m, r0, r1, expanded in _slabs(flat_s, block, rows, cols):
        flat_out[m, r0:r1] = flat_w[m, r0:r1].float() * expanded
        if finite and not bool(torch.isfinite(flat_out[m, r0:r1]).all()):
            row = r0 + int((~torch.isfinite(flat_out[m, r0:r1])).any(1).nonzero()[0, 0])
            at = f"expert {m}, " if flat_w.shape[0] > 1 else ""
            raise NonFiniteFP8(f"dequantizes to nan/inf ({at}row {row} first: NaN bytes, or nan/inf block scales, or "
                               f"values beyond {str(dtype).removeprefix('torch.')}); the checkpoint is damaged "
                               "(re-download or re-export it)")
    return out


def _slabs(flat_s: torch.Tensor, block: tuple[int, int], rows: int, cols: int):
    """(matrix, first row, end row, its block scales expanded to one per value in fp32) for whole block rows at a time
    of each ``[rows, cols]`` matrix whose scales are ``flat_s`` ``[M, ceil(rows/bm), ceil(cols/bn)]``."""
    step = max(1, _SLAB // (block[0] * cols)) * block[0]
    for m in range(flat_s.shape[0]):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            scales = flat_s[m, r0 // block[0]: math.ceil(r1 / block[0])].float()
            yield m, r0, r1, scales.repeat_interleave(block[0], 0)[: r1 - r0].repeat_interleave(block[1], 1)[:, :cols]


def quantize_fp8(x: torch.Tensor, block: tuple[int, int] = (128, 128),
                 scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``[..., R, C]`` -> (``float8_e4m3fn`` ``[..., R, C]``, ``scale_inv`` ``[..., ceil(R/bm), ceil(C/bn)]`` in
    ``scale_dtype``). fp32 scales: transformers' rounding, bitwise. Scales stored narrower (bf16, as some releases
    store them): each block's ``scale_inv`` rounded to ``scale_dtype`` first and the weight divided by the stored
    scale (``encode_fp8``), so that the bytes dequantize as they were meant to."""
    if not x.dtype.is_floating_point or x.ndim < 2:
        raise ValueError(f"cannot quantize {x.dtype} {list(x.shape)} to block FP8")
    rows, cols = x.shape[-2:]
    weight = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale_inv = torch.empty((*x.shape[:-2], *_grid(rows, cols, block)), dtype=torch.float32, device=x.device)
    if x.is_meta or not x.numel():
        return weight, scale_inv.to(scale_dtype)
    flat_x, flat_w, flat_s = x.reshape(-1, rows, cols), weight.view(-1, rows, cols), scale_inv.view(-1, *scale_inv.shape[-2:])
    step = max(1, _SLAB // (block[0] * cols)) * block[0]
    for m in range(flat_x.shape[0]):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            blocks = _blockwise(flat_x[m, r0:r1].float(), block)  # [gr, bm, gc, bn]
            max_abs = blocks.abs().amax(dim=(1, 3))
            scale = torch.where(max_abs > 0, FP8_MAX / torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs)),
                                torch.ones_like(max_abs))
            flat_s[m, r0 // block[0]: math.ceil(r1 / block[0])] = 1.0 / scale
            if scale_dtype != torch.float32:
                continue  # the weight is divided by the rounded scale below
            scaled = (blocks * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            flat_w[m, r0:r1] = scaled.view(-1, scaled.shape[2] * block[1])[: r1 - r0, :cols]
    if scale_dtype != torch.float32:
        scale_inv = scale_inv.to(scale_dtype)
        weight = encode_fp8(x, scale_inv, block)
    return weight, scale_inv


def encode_fp8(x: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Float ``[..., R, C]`` -> ``float8_e4m3fn`` for given block scales: ``clamp(x / scale_inv, -448, 448)`` of each
    block, round to nearest even (0 where a scale is 0). For values that some bytes dequantize to with these scales
    (``dequantize_fp8``, in bf16 or wider), those very bytes: e4m3's neighbours are at least 1/16 apart, bf16's
    rounding at most 1/512."""
    _check(x, scale_inv, block)
    weight = torch.empty(x.shape, dtype=FP8, device=x.device)
    if x.is_meta or scale_inv.is_meta or not x.numel():
        return weight
    rows, cols = x.shape[-2:]
    flat_x, flat_s, flat_w = x.reshape(-1, rows, cols), scale_inv.reshape(-1, *scale_inv.shape[-2:]), weight.view(-1, rows, cols)
    for m, r0, r1, expanded in _slabs(flat_s, block, rows, cols):
        values = flat_x[m, r0:r1].float()
        scaled = torch.where(expanded != 0, values / torch.where(expanded != 0, expanded, torch.ones_like(expanded)),
                             torch.zeros_like(values))
        flat_w[m, r0:r1] = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return weight


# -- where a dense tensor's values come from (the FP8 base held as the file's bytes: models.fp8_weight) -------------------
FP8_SOURCE = "fp8_source"  # the attribute naming a dense tensor's FP8 origin (FP8Source)


@dataclass(frozen=True, eq=False)
class FP8Source:
    """Where a dense ``[..., R, C]`` tensor's values come from: ``weight`` (``float8_e4m3fn``, the file's bytes) with
    its ``scale_inv`` in blocks of ``block``, dequantized into ``dtype``; for a 2-D one, row ``i`` is ``weight``'s row
    ``rows[i]`` (``rows`` None: in order). Set by ``FP8Blocks.forward`` on each tensor it makes; an op after it keeps
    it only through ``KeepSource``; any other op's output (a cast or a copy included) has none."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    dtype: torch.dtype
    rows: torch.Tensor | None = None

    def agrees_with(self, dense: torch.Tensor, samples: int = 3) -> bool:
        """Whether a few rows of ``dense`` (first, middle, last; of the first, middle and last expert) are these bytes
        dequantized (as ``FP8Blocks`` does, then cast to ``dense``'s dtype): a cheap check that no op changed the
        values on the way."""
        if tuple(dense.shape) != tuple(self.weight.shape) or dense.is_meta:
            return tuple(dense.shape) == tuple(self.weight.shape)
        if self.weight.ndim > 2:
            return all(FP8Source(self.weight[e], self.scale_inv[e], self.block, self.dtype).agrees_with(dense[e], samples)
                       for e in _samples(self.weight.shape[0], samples))
        cols = self.weight.shape[1]
        for i in _samples(self.weight.shape[0], samples):
            held = int(self.rows[i]) if self.rows is not None else i
            scales = self.scale_inv[held // self.block[0]].float().repeat_interleave(self.block[1])[:cols]
            row = (self.weight[held].float() * scales).to(self.dtype).to(dense.dtype)
            if not torch.equal(row.to(dense.device), dense[i]):
                return False
        return True

    def held(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The bytes and fp32 scales, copied onto ``device`` (the file's pages are not kept), in the file's row order."""
        return self.weight.to(device, copy=True), self.scale_inv.to(device, torch.float32, copy=True)

    def pages(self) -> tuple[torch.Tensor, ...]:
        """The file's tensors these bytes are read from (``lazy.release_pages`` drops them once copied)."""
        return self.weight, self.scale_inv


@dataclass(frozen=True, eq=False)
class StackedFP8Source:
    """Where a MoE's stacked ``[E, R, C]`` experts come from: one :class:`FP8Source` per expert (each a weight of the
    file, in order), stacked only when a holder asks for the bytes (``held``)."""

    parts: tuple[FP8Source, ...]
    rows = None

    @property
    def block(self) -> tuple[int, int]:
        return self.parts[0].block

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def agrees_with(self, dense: torch.Tensor, samples: int = 3) -> bool:
        if dense.ndim != 3 or dense.shape[0] != len(self.parts):
            return False
        return all(self.parts[e].agrees_with(dense[e], samples) for e in _samples(len(self.parts), samples))

    def held(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.stack([p.weight.view(torch.uint8) for p in self.parts]).view(FP8)  # stack is a copy already
        return weight.to(device), torch.stack([p.scale_inv.float() for p in self.parts]).to(device)

    def pages(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for p in self.parts for t in p.pages())


def _samples(n: int, samples: int) -> list[int]:
    return sorted({0, n // 2, n - 1})[:samples] if n else []


def carry_source(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``after`` (``before`` moved or cast: the same values) with ``before``'s ``fp8_source``, if any."""
    source = getattr(before, FP8_SOURCE, None)
    if source is not None and after is not before:
        setattr(after, FP8_SOURCE, source)
    return after


__all__ = ["FP8", "FP8_MAX", "FP8_SOURCE", "FP8Source", "NonFiniteFP8", "StackedFP8Source", "carry_source", "dequantize_fp8",
           "encode_fp8", "quantize_fp8"]
