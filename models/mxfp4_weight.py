"""``quantize_base: mxfp4``: a MoE's stacked expert weights held in MXFP4 (gpt-oss's own format) while LoRA trains.

:class:`MXFP4Weight` is a frozen ``[E, out, in]`` (or one expert's ``[out, in]``) weight in a compute dtype that
holds only ``blocks`` (uint8 ``[..., out, in / 32, 16]``, two FP4 codes a byte) and ``scales`` (uint8
``[..., out, in / 32]``, one E8M0 exponent per block of 32): 4.25 bits a value (``waypoint.mxfp4``). It is a
wrapper subclass, as torchao's ``NF4Tensor``, and follows the same life as an NF4 weight (``models.nf4``):

- **placeholder**: :func:`quantize_experts` makes every MoE's ``w1``, ``w3``, ``w2`` of a meta-built model a meta
  ``MXFP4Weight`` (shape and dtype; no data) before the checkpoint loads;
- **module_load**: ``load_state_dict`` with swapping on asks the destination how to take the incoming dense tensor:
  it is quantized with ``quantize_mxfp4`` on its own device, so only the packed bytes are kept. A dense source that
  came out of an MXFP4 checkpoint is rebuilt with exactly the file's values (the round trip D(Q(D(b, s))) == D(b, s)
  of ``waypoint.mxfp4``; the bytes may differ, which is why merged/ writes the input's own bytes);
- **compute**: ``packed_weight.PackedMatmul``, used by the MoE's three implementations, dequantizes inside its
  forward and again inside its backward (the input's gradient; the weight is frozen, so it has none): autograd saves
  the packed weight, never the dense copy of any layer's experts.

Supported ops, in ``__torch_dispatch__``: ``detach`` / ``alias``, ``_to_copy`` (``.to(device)``, ``.cuda()``,
``.cpu()``, and a float ``.to(dtype)``, which changes the compute dtype: the bytes are moved, never dequantized),
``clone``, ``empty_like`` (``Module.to_empty``), ``copy_`` into one (re-quantized), ``select`` / ``unbind`` along the
experts (one expert's packed slice). Any other op dequantizes its MXFP4 arguments and runs on the dense values; an
in-place op on an MXFP4Weight other than ``copy_`` is refused. Single-process only: FSDP2 cannot shard it (no
``fsdp_pre_all_gather``), and ``training.quantize`` refuses ``quantize_base: mxfp4`` under torchrun.
"""

from __future__ import annotations

import torch
from torch import nn

from waypoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from waypoint.models.nf4 import QuantizedBase
from waypoint.models.packed_weight import PackedWeight

BLOCK = 32  # values sharing one scale byte, along the input features
EXPERT_WEIGHTS = ("w1", "w3", "w2")
aten = torch.ops.aten


class MXFP4Weight(PackedWeight):
    """A frozen weight ``[..., out, in]`` in ``dtype`` held as MXFP4 ``blocks`` and ``scales`` (module docstring)."""

    @staticmethod
    def __new__(cls, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
        shape = (*scales.shape[:-1], scales.shape[-1] * BLOCK)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=blocks.device, requires_grad=requires_grad)

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False) -> None:
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
                or blocks.shape[-1] != 16 or blocks.device != scales.device:
            raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                             f"{scales.dtype} do not belong together")
        self.blocks, self.scales = blocks, scales

    @classmethod
    def from_dense(cls, t: torch.Tensor, dtype: torch.dtype | None = None) -> MXFP4Weight:
        """``t`` (float, last dim a multiple of 32) quantized on its device; computes in ``dtype`` (default t's)."""
        blocks, scales = quantize_mxfp4(t.detach())
        return cls(blocks, scales, dtype or t.dtype)

    @classmethod
    def placeholder(cls, shape: torch.Size, dtype: torch.dtype) -> MXFP4Weight:
        """A meta-device MXFP4Weight of ``shape`` (no data): what a load fills."""
        *lead, inputs = shape
        return cls(torch.empty(*lead, inputs // BLOCK, 16, dtype=torch.uint8, device="meta"),
                   torch.empty(*lead, inputs // BLOCK, dtype=torch.uint8, device="meta"), dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense values, in ``dtype`` (default the compute dtype)."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype or self.dtype)

    @property
    def held_nbytes(self) -> int:
        """The bytes actually held (blocks and scales): about 0.53 a value."""
        return self.blocks.numel() + self.scales.numel()

    def __repr__(self) -> str:
        return f"MXFP4Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def __reduce_ex__(self, protocol):
        return MXFP4Weight, (self.blocks, self.scales, self.dtype)

    def __tensor_flatten__(self):
        return ["blocks", "scales"], (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(inner, metadata, outer_size, outer_stride):
        return MXFP4Weight(inner["blocks"], inner["scales"], metadata[0])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.module_load:
            return _module_load(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _module_load(dest: MXFP4Weight, src: torch.Tensor, assign: bool = False) -> torch.Tensor:
    """How ``load_state_dict`` (swapping on) puts ``src`` into ``dest``: a dense ``src`` is quantized on its device,
    an MXFP4 one taken as it is; computing in ``dest``'s dtype. A new tensor, never ``dest`` or ``src``."""
    new = src.detach() if isinstance(src, MXFP4Weight) else MXFP4Weight.from_dense(src, dest.dtype)
    new = MXFP4Weight(new.blocks, new.scales, dest.dtype)
    if assign or dest.is_meta:
        return new
    dest.copy_(new)
    return dest.detach()


def _like(t: MXFP4Weight, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> MXFP4Weight:
    return MXFP4Weight(blocks, scales, dtype or t.dtype)


def _to_copy(t, dtype=None, device=None, non_blocking=False, **_):
    if dtype is not None and not dtype.is_floating_point:
        return NotImplemented  # to an integer dtype: the dense values, converted
    move = dict(device=device or t.device, non_blocking=non_blocking, copy=True)
    return _like(t, t.blocks.to(**move), t.scales.to(**move), dtype)


def _empty_like(t, dtype=None, device=None, **_):
    if dtype is not None and not dtype.is_floating_point:
        return NotImplemented
    device = device or t.device
    return _like(t, torch.empty_like(t.blocks, device=device), torch.empty_like(t.scales, device=device), dtype)


def _copy_(dest, src, non_blocking=False):
    if not isinstance(dest, MXFP4Weight):
        return NotImplemented  # into a dense tensor: the fallback copies the dense values
    if not isinstance(src, MXFP4Weight):
        src = MXFP4Weight.from_dense(src.to(dest.device))
    dest.blocks.copy_(src.blocks, non_blocking=non_blocking)
    dest.scales.copy_(src.scales, non_blocking=non_blocking)
    return dest


def _select(t, dim, index):
    if dim not in (0, -t.dim()) or t.dim() < 3:
        return NotImplemented  # along the experts only: the packed dims are not the tensor's
    return _like(t, t.blocks[index], t.scales[index])


def _unbind(t, dim=0):
    if dim not in (0, -t.dim()) or t.dim() < 3:
        return NotImplemented
    return [_like(t, b, s) for b, s in zip(t.blocks.unbind(0), t.scales.unbind(0))]


_OPS = {
    aten.detach.default: lambda t: _like(t, t.blocks, t.scales),
    aten.alias.default: lambda t: _like(t, t.blocks, t.scales),
    aten.clone.default: lambda t, **_: _like(t, t.blocks.clone(), t.scales.clone()),
    aten._to_copy.default: _to_copy,
    aten.empty_like.default: _empty_like,
    aten.copy_.default: _copy_,
    aten.select.int: _select,
    aten.unbind.int: _unbind,
}
MXFP4Weight.ops = _OPS


# -- quantize_base: mxfp4 ----------------------------------------------------------------------------------------------------
def quantize_experts(model: nn.Module, dtype: torch.dtype) -> QuantizedBase:
    """Make every MoE's w1, w3, w2 of a model an MXFP4Weight computing in ``dtype``: a meta placeholder on a
    meta-built model (filled as the checkpoint loads), quantized at once where loaded. Returns what was quantized,
    and what was kept in ``dtype`` and why (an input dim that is not a multiple of 32)."""
    result = QuantizedBase()
    for name, module in model.named_modules():
        if not all(isinstance(getattr(module, leaf, None), torch.Tensor) and getattr(module, leaf).ndim == 3
                   for leaf in EXPERT_WEIGHTS):  # a MoE (models.moe imports this module): its stacked experts
            continue
        for leaf in EXPERT_WEIGHTS:
            weight, key = getattr(module, leaf), f"{name}.{leaf}".lstrip(".")
            if isinstance(weight, MXFP4Weight):
                continue
            if weight.shape[-1] % BLOCK:
                result.kept[key] = f"its {weight.shape[-1]} input features are not a multiple of MXFP4's blocks of {BLOCK}"
                continue
            held = MXFP4Weight.placeholder(weight.shape, dtype) if weight.is_meta else MXFP4Weight.from_dense(weight, dtype)
            setattr(module, leaf, nn.Parameter(held, requires_grad=False))
            result.quantized.append(key)
    return result


__all__ = ["MXFP4Weight", "quantize_experts"]
