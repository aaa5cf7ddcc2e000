"""What a frozen base weight held in a packed format shares (``mxfp4_weight.MXFP4Weight``, ``fp8_weight.FP8Weight``):
its ``__torch_dispatch__``. The ops of the class's own table (``ops``: moves, casts, copies, views along the experts)
keep it packed; an in-place op other than ``copy_`` is refused; any other op runs on the dequantized values."""

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
