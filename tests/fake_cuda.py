"""A CUDA device, as far as the save path can tell, on a CPU-only torch: the device-placement bugs that only a GPU
used to show (a LoRA merge mixing the model's CUDA adapters with the input's CPU base) fail here as they do there.

``with fake_cuda():`` makes ``tensor.to("cuda")`` / ``.cuda()`` / ``module.to("cuda")`` give :class:`OnCuda` tensors:
their ``device`` is ``cuda:0``, they compute among themselves (the values are real, held on the CPU), an op that
mixes one with a CPU tensor of one or more dimensions raises CUDA's error ("Expected all tensors to be on the same
device, ..."), and ``.to("cpu")`` / ``.cpu()`` gives back a plain CPU tensor. ``torch.cuda.synchronize`` is a no-op
within, as there is nothing to wait for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

MIXED = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:0`` and refuses to meet CPU tensors, as a CUDA tensor would."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
                                                   dtype=data.dtype, device=torch.device("cuda", 0),
                                                   requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor) -> None:
        self.data_on_cpu = data

    def __repr__(self) -> str:
        return f"OnCuda({self.data_on_cpu!r})"

    def __tensor_flatten__(self):
        return ["data_on_cpu"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return OnCuda(inner["data_on_cpu"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_cpu: list[torch.Tensor] = []

        def unwrap(x):
            if isinstance(x, OnCuda):
                return x.data_on_cpu
            if isinstance(x, torch.Tensor) and x.dim() > 0 and x.device.type == "cpu":
                on_cpu.append(x)
            return x
        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        to_cpu = func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.device) and \
            torch.device(kwargs.get("device") or "cuda").type == "cpu"
        if to_cpu:
            return func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default and on_cpu:  # cuda_tensor.copy_(cpu_tensor): a host-to-device copy
            on_cpu.clear()
        if on_cpu:
            raise RuntimeError(MIXED)
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default:
            return args[0] if not isinstance(args[0], torch.Tensor) else _wrap_like(out)
        return tree_map(_wrap_like, out)


def _wrap_like(x):
    return OnCuda(x) if isinstance(x, torch.Tensor) and not isinstance(x, OnCuda) else x


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


class _FakeCuda(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            device = kwargs.get("device")
            rest = [a for a in args[1:] if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool)]
            device = device if device is not None else (rest[0] if rest else None)
            if _is_cuda(device):
                plain = [a for a in args[1:] if a is not None and not isinstance(a, (str, torch.device, int)) or isinstance(a, bool)]
                kw = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking")}
                moved = args[0].to(*plain, **kw)
                return moved if isinstance(moved, OnCuda) else OnCuda(moved.detach().requires_grad_(moved.requires_grad))
        if func is torch.Tensor.__getitem__ and isinstance(args[0], OnCuda):  # indexing takes a CUDA device guard first
            index = tree_map(lambda x: x.data_on_cpu if isinstance(x, OnCuda) else x, args[1])
            return OnCuda(args[0].data_on_cpu[index])
        if func is not torch.Tensor.to and _is_cuda(kwargs.get("device")):  # a factory (torch.arange(..., device=x.device))
            return tree_map(_wrap_like, func(*args, **(kwargs | {"device": "cpu"})))
        if func in (torch.Tensor.untyped_storage, torch.Tensor.data_ptr) and isinstance(args[0], OnCuda):
            return func(args[0].data_on_cpu)  # where the values are (safetensors asks, to find shared tensors)
        if func is torch.Tensor.cuda:
            return args[0] if isinstance(args[0], OnCuda) else OnCuda(args[0])
        try:
            return func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as e:
            # a composite op that allocates on the device itself (scaled_dot_product_attention): checked for mixed
            # devices, then run on the values
            if MIXED in str(e) or not any(isinstance(x, OnCuda) for x in _leaves((args, kwargs))):
                raise
            if any(isinstance(x, torch.Tensor) and not isinstance(x, OnCuda) and x.dim() > 0 for x in _leaves((args, kwargs))):
                raise RuntimeError(MIXED) from None
            unwrapped = tree_map(lambda x: x.data_on_cpu if isinstance(x, OnCuda) else x, (args, kwargs))
            return tree_map(_wrap_like, func(*unwrapped[0], **unwrapped[1]))


def _leaves(tree) -> list:
    from torch.utils._pytree import tree_leaves
    return tree_leaves(tree)


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Within: ``.to("cuda")`` makes :class:`OnCuda` tensors (module docstring)."""
    from waypoint.models import moe

    synchronize, grouped = torch.cuda.synchronize, moe.grouped_mm_supported
    torch.cuda.synchronize = lambda *a, **k: None
    moe.grouped_mm_supported = lambda *a, **k: False  # its probe runs a kernel on the device, in another thread
    try:
        with _FakeCuda():
            yield
    finally:
        torch.cuda.synchronize, moe.grouped_mm_supported = synchronize, grouped


def to_fake_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every parameter and buffer an :class:`OnCuda` tensor (``module.to("cuda")`` on a GPU)."""
    with torch.no_grad():
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and not isinstance(p, OnCuda):
                    sub._parameters[name] = torch.nn.Parameter(OnCuda(p.detach()), requires_grad=p.requires_grad)
            for name, b in list(sub._buffers.items()):
                if b is not None and not isinstance(b, OnCuda):
                    sub._buffers[name] = OnCuda(b)
    return module
