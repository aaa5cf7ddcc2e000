"""MXFP4, the format of gpt-oss's MoE experts: the codec, shared by the converter op (``converters.mxfp4``) and the
weights held quantized (``models.mxfp4_weight``), which stand side by side and so cannot import each other.

A checkpoint holds ``*_blocks`` uint8 ``[..., G, 16]`` and ``*_scales`` uint8 ``[..., G]``: each byte packs two FP4
E2M1 codes (element 2j in the low nibble, 2j+1 in the high one; codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and bit 3
is the sign), and each block of 32 values shares one E8M0 scale byte s: value = fp4 * 2**(s - 127). Dequantized,
the blocks give ``[..., G * 32]`` (for gpt-oss ``[E, out, in]``; no transpose).

``dequantize_mxfp4`` is bitwise equal to transformers' ``convert_moe_packed_tensors`` (with its final transpose
undone), which uses ``torch.ldexp``: the exact fp4 * 2**(s - 127), rounded once to ``dtype`` (overflow gives ±inf,
never NaN: s = 255 maps 0 to 0 and ±0.5 to ±2**127). ``quantize_mxfp4`` reproduces triton_kernels'
``downcast_to_mxfp_torch(x, torch.uint8, axis=-1)`` with ``ROUND_UP`` (what transformers' ``quantize_to_mxfp4``
calls) bit for bit: in fp32, a block's scale is max|x| / 6 with its fp32 bits rounded up to the next power of two
(an fp32-subnormal max|x| / 6, i.e. max|x| < 6 * 2**-126, always gets 2**-126, scale byte 1; an all-zero block
gets byte 0), and each value is rounded to the nearest E2M1 code, ties away from zero (0.25 -> 0.5, 0.75 -> 1,
2.5 -> 3, 5 -> 6), saturating at 6: its version published with gpt-oss (triton_kernels at knwng/triton@a680798a);
triton-lang's main since rounds exact ties to even, which differs on bf16 values' ties (1.25% of the block bytes of a
Gaussian bf16 tensor, measured 2026-11-25; none of its scales, and nothing for fp32 values, where ties are rare).
transformers' ``quantize_to_mxfp4`` also casts to bf16 first; a model trained in bf16 is bf16 already. Both work chunk by chunk (temporaries of at most ``_CHUNK`` blocks) and, on
meta tensors, return empty meta tensors of the right shape.

Round trips, Q = quantize_mxfp4, D = dequantize_mxfp4 (each checked in tests/test_mxfp4.py):

* Values survive: D(Q(D(b, s))) == D(b, s), in fp32 or bf16, for every block whose values are finite, except a
  block with scale byte 0 holding a code of magnitude 0.5 or 1.5 (its max / 6 is an fp32 subnormal, rounded up to
  2**-126 instead of 2**-127, so 0.5 * 2**-127 becomes q = 0.25 and rounds away to 0.5). In fp16 it holds for every
  block whose fp16 values are finite. The bytes may differ: a block whose largest magnitude is 3, 2, 1.5, 1 or 0.5
  times 2**(s - 127) comes back with a scale byte 1, 1, 2, 2 or 3 lower (not below 1) and larger codes (3 * 2**k
  as 6 * 2**(k - 1)), and an all-zero block with byte 0. Q(D(b, s)) has largest code 4 or 6 (outside byte 1 and
  all-zero blocks), which Q(D(.)) keeps: Q(D(.)) is idempotent after one application.
* Bytes do not: Q(D(Q(x))) == Q(x) holds block by block except for (a) a block whose largest code is ±3.0 under
  a scale byte >= 2, i.e. max|x| strictly between 3 and 3.5 times the block's rounded scale (about a fifth of the
  blocks of a Gaussian tensor): D gives 3 * 2**j, which Q encodes as 6 * 2**(j - 1); (b) a block that Q flushes
  wholly to zero under scale byte 1 (max|x| < 2**-128, max|x| / 6 not 0 in fp32), which comes back with byte 0;
  (c) scale byte 253 (max|x| > 3 * 2**126), where D overflows to inf; and of course non-finite x. The values
  agree wherever D(Q(x)) is finite (first point).

"""

from __future__ import annotations

import torch

_CHUNK = 1 << 16  # blocks of 32 values per chunk: 2M values, a few tens of MiB of temporaries at most
_FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _pair_table(device: torch.device) -> torch.Tensor:
    """byte -> twice the values of its low and high nibbles, fp32 ``[256, 2]`` (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12)."""
    codes = torch.tensor([2 * v for v in _FP4] + [-2 * v for v in _FP4], dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([codes[byte & 0xF], codes[byte >> 4]], dim=-1)


def _scale_table(device: torch.device) -> torch.Tensor:
    """scale byte s -> 2**(s - 128), all finite in fp32 (2**-128 is a subnormal): with the doubled codes, the
    product is the exact 2**(s - 127) * fp4 wherever fp32 can hold it, and rounds to ±inf where it cannot, as
    ``torch.ldexp`` does (s = 255 then gives 0, ±2**127 and ±inf, never NaN)."""
    return torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(-128, 128)).to(torch.float32).to(device)


def _shape(t: torch.Tensor) -> str:
    return f"[{', '.join(map(str, t.shape))}]"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 blocks ``[..., G, 16]`` and scales ``[..., G]`` -> ``dtype`` values ``[..., G * 32]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16:
        raise ValueError(f"blocks {_shape(blocks)} must be [..., groups, 16]")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {_shape(blocks)} and scales {_shape(scales)} disagree")
    if not dtype.is_floating_point:
        raise ValueError(f"cannot dequantize to {dtype}")
    shape = (*blocks.shape[:-2], blocks.shape[-2] * 32)
    out = torch.empty(shape, dtype=dtype, device=blocks.device)
    if blocks.is_meta or scales.is_meta or out.numel() == 0:
        return out
    pairs, powers = _pair_table(blocks.device), _scale_table(blocks.device)
    flat_blocks, flat_scales, flat_out = blocks.reshape(-1, 16), scales.reshape(-1), out.view(-1, 32)
    for r0 in range(0, flat_scales.numel(), _CHUNK):
        r1 = r0 + _CHUNK
        values = pairs[flat_blocks[r0:r1].int()].view(-1, 32)  # 2 * fp4, exact in fp32
        values.mul_(powers[flat_scales[r0:r1].int()].unsqueeze(-1))  # exact in fp32, or ±inf
        flat_out[r0:r1] = values  # one rounding to dtype, as transformers' ldexp into a dtype tensor
    return out


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``[..., K]`` (K a multiple of 32) -> (blocks uint8 ``[..., K/32, 16]``, scales uint8 ``[..., K/32]``).

    Computed in fp32 (a float64 input is rounded to fp32 first, as triton_kernels' function accepts fp32 at most)."""
    if not x.dtype.is_floating_point:
        raise ValueError(f"cannot quantize {x.dtype} to MXFP4")
    if x.ndim == 0 or x.shape[-1] % 32:
        raise ValueError(f"last dim of {_shape(x)} is not a multiple of 32")
    groups = x.shape[-1] // 32
    blocks = torch.empty((*x.shape[:-1], groups, 16), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], groups), dtype=torch.uint8, device=x.device)
    if not x.is_meta and scales.numel():
        _quantize_into(x, blocks, scales)
    return blocks, scales


def _quantize_into(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Fill ``blocks`` and ``scales`` (contiguous) from ``x``, a few rows at a time; a strided ``x`` is copied one
    chunk at a time, never whole."""
    if x.ndim > 2:
        try:
            x = x.view(-1, x.shape[-1])
        except RuntimeError:  # leading dims that do not merge (e.g. a transposed expert stack): one slice at a time
            for i in range(x.shape[0]):
                _quantize_into(x[i], blocks[i], scales[i])
            return
    x = x.view(-1, x.shape[-1])
    flat_blocks, flat_scales = blocks.view(x.shape[0], -1, 16), scales.view(x.shape[0], -1)
    step = max(1, _CHUNK * 32 // x.shape[-1])
    for r0 in range(0, x.shape[0], step):
        xs = x[r0:r0 + step].to(torch.float32).reshape(-1, 32)
        dequant = xs.abs().max(dim=-1).values / 6.0
        # Round the fp32 bits up to a power of two (in int64: a NaN's bits overflow int32, where they wrap to 0).
        bits = (dequant.view(torch.int32).long() + 0x007FFFFF) & 0x7F800000
        flat_scales[r0:r0 + step] = (bits >> 23).view(-1, flat_scales.shape[1])
        rounded = bits.int().view(torch.float32)
        quant = torch.where(rounded == 0, torch.zeros_like(rounded), 1.0 / rounded)
        codes = _e2m1(xs * quant.unsqueeze(-1)).view(-1, flat_blocks.shape[1], 16, 2)
        flat_blocks[r0:r0 + step] = codes[..., 0] | (codes[..., 1] << 4)


def _e2m1(q: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 code (uint8, 0-15) from q's bits: round to nearest, ties away from zero, saturating at 6."""
    bits = q.view(torch.int32)
    sign = (bits >> 31) & 1
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    # |q| < 1: make the implicit 1 explicit and shift it into place (E2M1's subnormal 0.5 has exponent 126).
    subnormal = (0x400000 | (mantissa >> 1)) >> (126 - exponent).clamp(0, 31)
    mantissa = torch.where(exponent < 127, subnormal, mantissa)
    exponent = exponent.clamp(min=126) - 126
    code = ((((exponent << 2) | (mantissa >> 21)) + 1) >> 1).clamp(max=7)
    return (code | (sign << 3)).to(torch.uint8)


__all__ = ["dequantize_mxfp4", "quantize_mxfp4"]
