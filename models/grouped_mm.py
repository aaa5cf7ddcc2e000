"""Whether this torch's ``grouped_mm`` can run a mixture-of-experts layer's products, probed once per device and
dtype (``grouped_mm_supported``), and whether given weights suit its kernels (``grouped_mm_layout_ok``): what
``models.moe.MoE``'s ``"auto"`` implementation asks before choosing ``"grouped"``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from waypoint.models.packed_weight import PackedWeight

# (device type, device index, dtype) -> whether grouped_mm runs forward and backward there
_GROUPED_MM_SUPPORT: dict[tuple[str, int | None, torch.dtype], bool] = {}


def grouped_mm_fn():
    """``torch.nn.functional.grouped_mm`` (public from torch 2.10), else ``torch._grouped_mm``, else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this torch's ``grouped_mm`` computes a small grouped product and its gradients (an empty group
    included) correctly on ``device`` in ``dtype``. Probed once per (device, dtype) and cached.

    torch 2.13 on CPU: float32, bfloat16 and float16 (forward and backward; no float64). On CUDA the answer
    depends on the GPU and dtype, hence the probe rather than a table.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index, dtype)
    if key not in _GROUPED_MM_SUPPORT:
        # in a thread of its own: the probe's autograd must not count as saved tensors of an activation-checkpointed
        # layer asking from its forward (the hooks are thread-local), whose recomputation would then save fewer
        with ThreadPoolExecutor(1) as pool:
            _GROUPED_MM_SUPPORT[key] = pool.submit(_probe_grouped_mm, device, dtype).result()
    return _GROUPED_MM_SUPPORT[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    fn = grouped_mm_fn()
    if fn is None or device.type == "meta":
        return False
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 8]  # an empty group too
    try:
        with torch.inference_mode(False), torch.enable_grad():
            a32 = torch.randn(sum(counts), 32, generator=gen)
            w32 = torch.randn(len(counts), 16, 32, generator=gen)  # [groups, out, in], like the expert weights
            g32 = torch.randn(sum(counts), 16, generator=gen)
            a = a32.to(device, dtype).requires_grad_()
            w = w32.to(device, dtype).requires_grad_()
            offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
            out = fn(a, w.transpose(-2, -1), offs=offs)
            grad_a, grad_w = torch.autograd.grad(out, (a, w), g32.to(device, dtype))
            # the reference, from the same rounded inputs, in fp32 on the CPU
            a_r, w_r = a.detach().float().cpu(), w.detach().float().cpu()
            g_r = g32.to(dtype).float()
            ends = torch.tensor(counts).cumsum(0).tolist()
            starts = [0] + ends[:-1]
            ref = torch.cat([a_r[s:e] @ w_r[i].T for i, (s, e) in enumerate(zip(starts, ends))])
            ref_ga = torch.cat([g_r[s:e] @ w_r[i] for i, (s, e) in enumerate(zip(starts, ends))])
            ref_gw = torch.stack([g_r[s:e].T @ a_r[s:e] for s, e in zip(starts, ends)])
            tol = 1e-4 if dtype == torch.float32 else 0.1  # the products are O(10); half-precision rounding
            return all(torch.allclose(got.float().cpu(), want, rtol=tol, atol=tol)
                       for got, want in ((out, ref), (grad_a, ref_ga), (grad_w, ref_gw)))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def grouped_mm_layout_ok(*weights: torch.Tensor) -> bool:
    """grouped_mm's layout rules (CUDA's kernels; CPU's in torch <= 2.10): operands 16-byte aligned (a memory-mapped
    checkpoint's may not be; a packed weight's operand is its freshly dequantized copy) and each matrix's rows a
    multiple of 16 bytes long."""
    return all((isinstance(w, PackedWeight) or w.data_ptr() % 16 == 0) and w.shape[-1] * w.element_size() % 16 == 0
               and w.shape[-2] * w.element_size() % 16 == 0 for w in weights)
