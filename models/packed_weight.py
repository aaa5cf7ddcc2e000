"""What a frozen base weight held in a packed format shares (``mxfp4_weight.MXFP4Weight``, ``fp8_weight.FP8Weight``):
its ``__torch_dispatch__`` and its products.

- **dispatch**: the ops of the class's own table (``ops``: moves, casts, copies, views along the experts) keep it
  packed; an in-place op other than ``copy_`` is refused; any other op runs on the dequantized values.
- **products**: :class:`PackedMatmul` dequantizes inside its forward and again inside its backward (the input's
  gradient; the weight is frozen, so it has none): autograd saves the packed weight, never a dense copy. ``linear``
  (one weight ``[out, in]``) and ``experts_mm`` (a MoE's stacked ``[E, out, in]``) route a packed weight through it
  and a dense one to the plain product.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch.utils._pytree import tree_map_only


class PackedWeight(torch.Tensor):
    """Base of the packed frozen weights: a subclass defines ``dequantize()`` and its ``ops`` table."""

    ops: ClassVar[dict[Callable, Callable]] = {}

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in cls.ops:
            result = cls.ops[func](*args, **kwargs)
            if result is not NotImplemented:
                return result
        if func._schema.is_mutable and args and isinstance(args[0], PackedWeight):
            raise RuntimeError(f"{func}: an {type(args[0]).__name__} is a frozen base weight; only copy_ writes into it")
        args, kwargs = tree_map_only(PackedWeight, lambda t: t.dequantize(), (args, kwargs))  # the fallback
        return func(*args, **kwargs)


class PackedMatmul(torch.autograd.Function):
    """``x @ W.T`` for a packed ``W``: one weight's ``[n, in] x [out, in]`` (``F.linear``, with ``bias``), every
    expert's ``[E, n, in] x [E, out, in]`` (bmm), or sorted rows ``[S, in]`` with the experts' ends ``offs`` (the
    ``grouped_mm`` function given). The dense weight is a temporary of the forward and of the backward: autograd
    saves the packed weight only. Gradient for ``x`` (and a bias that wants one); none for the frozen weight."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, offs=None, grouped_mm=None):
        if bias is not None and weight.dim() != 2:
            raise ValueError("PackedMatmul adds a bias to a 2-D weight's product only")
        ctx.save_for_backward(weight, offs)
        ctx.grouped_mm = grouped_mm
        dense = weight.dequantize(x.dtype)
        if weight.dim() == 2:
            return torch.nn.functional.linear(x, dense, bias)
        return _product(x, dense.transpose(-2, -1), offs, grouped_mm)

    @staticmethod
    def backward(ctx, grad):
        weight, offs = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            dense = weight.dequantize(grad.dtype)
            grad_x = grad @ dense if weight.dim() == 2 else _product(grad, dense, offs, ctx.grouped_mm)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None, None


def _product(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, grouped_mm) -> torch.Tensor:
    return torch.bmm(a, b) if offs is None else grouped_mm(a, b, offs=offs)


def experts_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor | None = None, grouped_mm=None) -> torch.Tensor:
    """Each expert's ``x @ weight[e].T``: ``grouped_mm`` over ``offs`` (rows sorted by expert), else a bmm over
    ``[E, rows, in]``; a packed weight through :class:`PackedMatmul`."""
    if isinstance(weight, PackedWeight):
        return PackedMatmul.apply(x, weight, None, offs, grouped_mm)
    return _product(x, weight.transpose(-2, -1), offs, grouped_mm)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with a packed weight (one expert's) through :class:`PackedMatmul`."""
    if isinstance(weight, PackedWeight):
        return PackedMatmul.apply(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


__all__ = ["PackedMatmul", "PackedWeight", "experts_mm", "linear"]
