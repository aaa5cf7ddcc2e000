"""``quantize_base: fp8``: a block-FP8 checkpoint's linear weights held in FP8, as the file's own bytes, while LoRA trains.

:class:`FP8Weight` is a frozen linear weight ``[out, in]``, or a MoE's stacked experts ``[E, out, in]``, in a compute
dtype that holds only ``weight`` (``float8_e4m3fn``, same shape) and ``scale_inv`` (fp32, one per ``block`` of
values: ``waypoint.fp8``), and, where a 2-D weight's row order is not the file's, ``rows`` (int32 ``[out]``: row
``i`` is held row ``rows[i]``). About one byte a value. A wrapper subclass with the life of an MXFP4 weight
(``models.mxfp4_weight``):

- **placeholder**: :func:`quantize_fp8_linears` makes the frozen linears (and the experts) of a meta-built model
  meta ``FP8Weight``s before the checkpoint loads;
- **module_load**: ``load_state_dict`` with swapping on asks the destination how to take the incoming dense tensor.
  Block FP8 does not survive dequantize -> quantize (each block's scale is recomputed from its max), so a dense
  tensor that came straight from the file (its ``fp8_source``: ``converters.fp8``, carried through a row-only
  op such as q/k's RoPE permutation, or the experts' stack) gives its bytes and scales, taken as they are
  (checked on a few rows); rows permuted within their blocks are re-ordered once, others keep ``rows``. Any
  other dense tensor is quantized with ``quantize_fp8`` (transformers' rounding) on its device;
- **compute**: ``F.linear(x, w)`` (``nn.Linear``'s and ``LoRALinear``'s forward) reaches
  ``packed_weight.PackedMatmul`` through ``__torch_function__``, and the MoE's products through ``experts_mm``; it
  dequantizes inside its forward and again inside its backward (the input's gradient; the weight is frozen):
  autograd saves the FP8 weight, never a dense copy.

Supported ops, in ``__torch_dispatch__``: ``detach`` / ``alias``, ``_to_copy`` (a device move, or a float dtype:
the compute dtype; the bytes are never dequantized), ``clone``, ``empty_like``, ``copy_`` into one (an FP8Weight's
bytes, or dense values quantized in the held row order), ``select`` / ``unbind`` along the experts (one expert's
bytes). Any other op dequantizes its FP8 arguments and runs on
the dense values; an in-place op other than ``copy_`` is refused. Single-process only (no FSDP2 all-gather
hooks): ``training.quantize`` refuses ``quantize_base: fp8`` under torchrun.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.fp8 import FP8, FP8_SOURCE, dequantize_fp8, quantize_fp8
from waypoint.lazy import release_pages
from waypoint.models.nf4 import LINEARS, QuantizedBase
from waypoint.models.packed_weight import PackedMatmul, PackedWeight

aten = torch.ops.aten
EXPERTS = ("w1", "w3", "w2")  # a MoE's stacked expert weights (models.moe)
log = logging.getLogger(__name__)


class FP8Weight(PackedWeight):
    """A frozen ``[out, in]`` (or ``[E, out, in]``) weight in ``dtype`` held as block FP8 (module docstring).
    ``from_file``: whether the bytes are the checkpoint's own (False: quantized here)."""

    @staticmethod
    def __new__(cls, weight, scale_inv, block, dtype, rows=None, from_file=False, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, weight.shape, dtype=dtype, device=weight.device,
                                                   requires_grad=requires_grad)

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                 rows: torch.Tensor | None = None, from_file: bool = False, requires_grad: bool = False) -> None:
        block = (int(block[0]), int(block[1]))
        grid = (*weight.shape[:-2], *(math.ceil(n / b) for n, b in zip(weight.shape[-2:], block))) \
            if weight.ndim in (2, 3) else None
        if weight.dtype != FP8 or grid is None or tuple(scale_inv.shape) != grid or scale_inv.device != weight.device \
                or (rows is not None and (weight.ndim != 2 or tuple(rows.shape) != weight.shape[:1]
                                          or rows.device != weight.device)):
            raise ValueError(f"FP8 weight {tuple(weight.shape)} {weight.dtype}, scales {tuple(scale_inv.shape)} in blocks "
                             f"of {list(block)}{'' if rows is None else f' and rows {tuple(rows.shape)}'} do not belong together")
        self.weight, self.scale_inv, self.block, self.rows, self.from_file = weight, scale_inv, block, rows, from_file

    @classmethod
    def from_dense(cls, t: torch.Tensor, block: tuple[int, int], dtype: torch.dtype | None = None) -> FP8Weight:
        """``t`` quantized on its device (``quantize_fp8``); computes in ``dtype`` (default t's)."""
        weight, scale_inv = quantize_fp8(t.detach(), block)
        return cls(weight, scale_inv, block, dtype or t.dtype)

    @classmethod
    def from_loaded(cls, t: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> FP8Weight:
        """What a load puts in an FP8 placeholder for the dense ``t``: the file's bytes where ``t`` carries them (its
        ``fp8_source``, in blocks of ``block``, agreeing with ``t``), on ``t``'s device; ``t`` quantized otherwise."""
        source = getattr(t, FP8_SOURCE, None)
        if source is not None and (tuple(source.block) != tuple(block) or not source.agrees_with(t)):
            log.warning("fp8: a weight %s does not match the FP8 bytes it came from; quantized again", tuple(t.shape))
            source = None
        if source is None:
            return cls.from_dense(t, block, dtype)
        rows = source.rows
        if rows is not None and bool((rows // block[0] == torch.arange(len(rows)) // block[0]).all()):
            weight = source.weight.view(torch.uint8).index_select(0, rows).view(FP8).to(t.device)  # re-ordered once
            scale_inv, rows = source.scale_inv.to(t.device, torch.float32, copy=True), None
        else:
            weight, scale_inv = source.held(t.device)  # a copy: the file's pages are not kept
        held = cls(weight, scale_inv, block, dtype, None if rows is None else rows.to(t.device, torch.int32), from_file=True)
        release_pages(*source.pages())  # the file's pages: the copy is what is kept
        return held

    @classmethod
    def placeholder(cls, shape: torch.Size, block: tuple[int, int], dtype: torch.dtype) -> FP8Weight:
        """A meta-device FP8Weight of ``shape`` (no data): what a load fills."""
        return cls(*quantize_fp8(torch.empty(shape, device="meta"), block), block, dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense values in ``dtype`` (default the compute dtype), in the model's row order: bitwise
        ``dequantize_fp8`` (each value times its block's scale in fp32, rounded once), with fewer temporaries (the
        rows' bytes re-ordered before, each row's scales broadcast over its blocks in place)."""
        (rows, cols), (bm, bn) = self.weight.shape[-2:], self.block
        if self.weight.is_meta or cols % bn:
            dense = dequantize_fp8(self.weight, self.scale_inv, self.block, dtype or self.dtype)
            return dense if self.rows is None else dense.index_select(0, self.rows)
        weight, scales = self.weight, self.scale_inv.float().repeat_interleave(bm, -2)[..., :rows, :]  # [..., rows, cols / bn]
        if self.rows is not None:
            weight, scales = weight.view(torch.uint8).index_select(0, self.rows).view(FP8), scales.index_select(0, self.rows)
        dense = weight.float()
        dense.view(*weight.shape[:-1], cols // bn, bn).mul_(scales.unsqueeze(-1))
        return dense.to(dtype or self.dtype)

    @property
    def held_nbytes(self) -> int:
        """The bytes actually held: the FP8 values, their scales, the row order if any."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale_inv, self.rows) if t is not None)

    def __repr__(self) -> str:
        return (f"FP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, block={list(self.block)}, "
                f"device={self.device}, from_file={self.from_file})")

    def __reduce_ex__(self, protocol):
        return FP8Weight, (self.weight, self.scale_inv, self.block, self.dtype, self.rows, self.from_file)

    def __tensor_flatten__(self):
        return ["weight", "scale_inv"] + (["rows"] if self.rows is not None else []), (self.dtype, self.block, self.from_file)

    @staticmethod
    def __tensor_unflatten__(inner, metadata, outer_size, outer_stride):
        dtype, block, from_file = metadata
        return FP8Weight(inner["weight"], inner["scale_inv"], block, dtype, inner.get("rows"), from_file)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.module_load:
            return _module_load(*args, **kwargs)
        if func is F.linear:
            x, weight, bias = _linear_args(*args, **kwargs)
            if isinstance(weight, FP8Weight) and not isinstance(x, FP8Weight) and not isinstance(bias, FP8Weight):
                return PackedMatmul.apply(x, weight, bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _linear_args(input, weight, bias=None):
    return input, weight, bias


def _module_load(dest: FP8Weight, src: torch.Tensor, assign: bool = False) -> torch.Tensor:
    """How ``load_state_dict`` (swapping on) puts ``src`` into ``dest``: an FP8Weight as it is, a dense tensor as
    ``FP8Weight.from_loaded`` takes it; computing in ``dest``'s dtype. A new tensor, never ``dest`` or ``src``."""
    new = src.detach() if isinstance(src, FP8Weight) else FP8Weight.from_loaded(src, dest.block, dest.dtype)
    new = _like(new, new.weight, new.scale_inv, dest.dtype)
    if assign or dest.is_meta:
        return new
    dest.copy_(new)
    return dest.detach()


def _like(t: FP8Weight, weight, scale_inv, dtype=None, rows=False) -> FP8Weight:
    return FP8Weight(weight, scale_inv, t.block, dtype or t.dtype, t.rows if rows is False else rows, t.from_file)


def _to_copy(t, dtype=None, device=None, non_blocking=False, **_):
    if dtype is not None and not dtype.is_floating_point:
        return NotImplemented  # to an integer dtype: the dense values, converted
    move = dict(device=device or t.device, non_blocking=non_blocking, copy=True)
    rows = None if t.rows is None else t.rows.to(**move)
    return _like(t, t.weight.to(**move), t.scale_inv.to(**move), dtype, rows)


def _empty_like(t, dtype=None, device=None, **_):
    if dtype is not None and not dtype.is_floating_point:
        return NotImplemented
    device = device or t.device
    rows = None if t.rows is None else torch.empty_like(t.rows, device=device)
    return _like(t, torch.empty_like(t.weight, device=device), torch.empty_like(t.scale_inv, device=device), dtype, rows)


def _copy_(dest, src, non_blocking=False):
    if not isinstance(dest, FP8Weight):
        return NotImplemented  # into a dense tensor: the fallback copies the dense values
    if isinstance(src, FP8Weight) and src.block == dest.block:
        rows = None if src.rows is None else src.rows.to(dest.device)
        dest.from_file = src.from_file
    else:  # dense values, quantized in the order dest holds its rows
        dense = src.dequantize() if isinstance(src, FP8Weight) else src.detach()
        rows = dest.rows
        if rows is not None:
            dense = torch.empty_like(dense).index_copy_(0, rows.to(dense.device).long(), dense)
        src = FP8Weight.from_dense(dense.to(dest.device), dest.block)
        dest.from_file = False
    dest.weight.copy_(src.weight, non_blocking=non_blocking)
    dest.scale_inv.copy_(src.scale_inv, non_blocking=non_blocking)
    dest.rows = rows
    return dest


def _select(t, dim, index):
    if dim not in (0, -t.dim()) or t.dim() < 3:
        return NotImplemented  # along the experts only
    return _like(t, t.weight[index], t.scale_inv[index])


def _unbind(t, dim=0):
    if dim not in (0, -t.dim()) or t.dim() < 3:
        return NotImplemented
    return [_like(t, w, s) for w, s in zip(t.weight.unbind(0), t.scale_inv.unbind(0))]


_OPS = {
    aten.detach.default: lambda t: _like(t, t.weight, t.scale_inv),
    aten.alias.default: lambda t: _like(t, t.weight, t.scale_inv),
    aten.clone.default: lambda t, **_: _like(t, t.weight.clone(), t.scale_inv.clone(),
                                             rows=None if t.rows is None else t.rows.clone()),
    aten._to_copy.default: _to_copy,
    aten.empty_like.default: _empty_like,
    aten.copy_.default: _copy_,
    aten.select.int: _select,
    aten.unbind.int: _unbind,
}
FP8Weight.ops = _OPS


def quantize_fp8_linears(model: nn.Module, dtype: torch.dtype, block: tuple[int, int], held: set[str]) -> QuantizedBase:
    """Make each frozen base linear weight of a meta-built model whose key is in ``held`` (those the checkpoint holds
    in FP8) an FP8Weight placeholder computing in ``dtype``, and each MoE's stacked experts (w1, w3, w2) in ``held``;
    the output head too where it is in ``held`` and not tied. A loaded weight is quantized at once. Returns what was
    made FP8, and what was kept in ``dtype`` and why."""
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    result = QuantizedBase()

    def hold(module: nn.Module, leaf: str, key: str) -> None:
        weight = getattr(module, leaf)
        new = FP8Weight.placeholder(weight.shape, block, dtype) if weight.is_meta else FP8Weight.from_dense(weight, block, dtype)
        setattr(module, leaf, nn.Parameter(new, requires_grad=False))
        result.quantized.append(key)

    for name, module in model.named_modules():
        experts = [leaf for leaf in EXPERTS if isinstance(getattr(module, leaf, None), torch.Tensor)
                   and getattr(module, leaf).ndim == 3]
        for leaf in experts if len(experts) == len(EXPERTS) else ():  # a MoE's stacked experts
            key = f"{name}.{leaf}".lstrip(".")
            if isinstance(getattr(module, leaf), FP8Weight):
                continue
            if key in held:
                hold(module, leaf, key)
            else:
                result.kept[key] = "not block FP8 in the checkpoint"
        weight, leaf, key = getattr(module, "weight", None), name.rpartition(".")[2], f"{name}.weight"
        if leaf not in LINEARS + ("output",) or not isinstance(weight, torch.Tensor) or isinstance(weight, FP8Weight):
            continue
        if key not in held:
            if leaf != "output":
                result.kept[key] = "not block FP8 in the checkpoint"
            continue
        if leaf == "output" and tied:
            result.kept[key] = "tied to the embedding"
            continue
        if weight.ndim != 2:
            result.kept[key] = f"{weight.ndim}-D (FP8Weight holds 2-D linear weights and stacked experts)"
            continue
        hold(module, "weight", key)
    return result


__all__ = ["FP8Weight", "quantize_fp8_linears"]
