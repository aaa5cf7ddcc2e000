"""MXFP4 codec (gpt-oss experts): dequantization against transformers, quantization against hand-worked codes, the
round-trip facts stated in waypoint/mxfp4.py, the converter op, meta tensors and errors."""

import ast
import contextlib
import dataclasses
import importlib.metadata
import math

import pytest
import torch

import waypoint.mxfp4 as mxfp4
from waypoint.converters import CheckpointError, Converter, Rule
from waypoint.converters.mxfp4 import MXFP4, dequantize_mxfp4, quantize_mxfp4

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def pack(codes) -> torch.Tensor:
    """Codes [..., 32] -> blocks [..., 16]: element 2j in the low nibble, 2j+1 in the high one."""
    codes = torch.as_tensor(codes, dtype=torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(blocks: torch.Tensor) -> torch.Tensor:
    return torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(BITS[a.dtype]),
                                                                      b.contiguous().view(BITS[b.dtype]))


# -- dequantization ------------------------------------------------------------------------------------------------
def transformers_convert_moe_packed_tensors():
    """transformers' own ``_convert_moe_packed_tensors`` (with ``FP4_VALUES``), compiled from the installed
    transformers/integrations/mxfp4.py: importing that module pulls in its quantizers and torchao (~2 s)."""
    try:
        path = importlib.metadata.distribution("transformers").locate_file("transformers/integrations/mxfp4.py")
        tree = ast.parse(open(path).read())
    except (importlib.metadata.PackageNotFoundError, OSError):
        pytest.skip("transformers is not installed")
    wanted = [node for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name == "_convert_moe_packed_tensors"
              or isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FP4_VALUES" for t in node.targets)]
    assert len(wanted) == 2, "transformers' mxfp4.py changed: FP4_VALUES or _convert_moe_packed_tensors is gone"
    namespace = {"torch": torch, "math": math, "on_device": lambda device: contextlib.nullcontext()}
    exec(compile(ast.Module(wanted, type_ignores=[]), str(path), "exec"), namespace)
    return lambda blocks, scales, dtype: namespace["_convert_moe_packed_tensors"](blocks, scales, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_is_bitwise_transformers_for_every_byte_and_scale(dtype):
    convert = transformers_convert_moe_packed_tensors()
    # Every scale byte 0..255 (the extremes: subnormal 2**-127 in fp32, overflow, 255) times every block byte.
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16).expand(256, 16, 16).reshape(1, 256, 16, 16).clone()
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 16).clone()
    ref = convert(blocks, scales, dtype=dtype).transpose(1, 2)
    assert same_bits(dequantize_mxfp4(blocks, scales, dtype), ref)
    # Random experts-like stacks [E, rows, G, 16], scale bytes over 100..150.
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 151, (3, 10, 4), dtype=torch.uint8, generator=g)
    out = dequantize_mxfp4(blocks, scales, dtype)
    assert out.shape == (3, 10, 128)
    assert same_bits(out, convert(blocks, scales, dtype=dtype).transpose(1, 2))


def test_dequantize_hand_worked_values_and_chunks(monkeypatch):
    codes = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] * 2
    blocks, scales = pack(codes).view(1, 16), torch.tensor([128], dtype=torch.uint8)  # 2**(128 - 127) = 2
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expected = torch.tensor([2 * v for v in grid] + [-2 * v for v in grid], dtype=torch.float32).repeat(2)
    assert same_bits(dequantize_mxfp4(blocks, scales, torch.float32), expected)  # -0.0 included
    # s = 255: ldexp semantics (0 stays 0, 0.5 * 2**128 = 2**127 is finite, larger overflows), never NaN.
    top = dequantize_mxfp4(pack([0, 8, 1, 9, 2, 10] + [0] * 26).view(1, 16), torch.tensor([255], dtype=torch.uint8),
                           torch.float32)
    assert top[:6].tolist() == [0.0, -0.0, 2.0 ** 127, -(2.0 ** 127), float("inf"), -float("inf")]
    # Chunk boundaries and strided inputs change nothing.
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (4, 5, 7, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (4, 5, 7), dtype=torch.uint8, generator=g)
    whole = dequantize_mxfp4(blocks, scales)
    monkeypatch.setattr(mxfp4, "_CHUNK", 3)
    assert same_bits(dequantize_mxfp4(blocks, scales), whole)
    assert same_bits(dequantize_mxfp4(blocks.transpose(0, 1), scales.transpose(0, 1)), whole.transpose(0, 1))


# -- quantization --------------------------------------------------------------------------------------------------
def test_quantize_hand_worked_block_with_exact_six_times_power_of_two():
    # max|x| = 48 = 6 * 2**3: 48 / 6 = 8 = 0x41000000 exactly, rounding up leaves it: scale byte 130; q = x / 8.
    # Codes from the bit rules (e = exponent of q, m = mantissa, code = min(((e' << 2 | m >> 21) + 1) >> 1, 7)):
    #   q = 6 (48):       e = 129, m = 0x400000 -> ((3 << 2 | 2) + 1) >> 1 = 7
    #   q = 0.25 (2):     e = 125 < 127, m = (0x400000 | 0) >> 1 = 0x200000, e' = 0 -> (0 | 1) + 1 >> 1 = 1 (0.5)
    #   q = 0.75 (6):     e = 126, m = (0x400000 | 0x200000) >> 0 = 0x600000 -> (0 | 3) + 1 >> 1 = 2 (1.0)
    #   q = 1.25 (10):    e = 127, m = 0x200000, e' = 1 -> (4 | 1) + 1 >> 1 = 3 (1.5)
    #   q = 1.75 (14):    m = 0x600000 -> (4 | 3) + 1 >> 1 = 4 (2.0)
    #   q = 2.5 (20):     e = 128, e' = 2, m = 0x200000 -> (8 | 1) + 1 >> 1 = 5 (3.0)
    #   q = 3.5 (28):     m = 0x600000 -> (8 | 3) + 1 >> 1 = 6 (4.0)
    #   q = 5 (40):       e = 129, e' = 3, m = 0x200000 -> (12 | 1) + 1 >> 1 = 7 (6.0)   [ties go away from zero]
    #   q = 1.2 (9.6):    m >> 21 = 0 (0.2 < 0.25) -> (4 | 0) + 1 >> 1 = 2 (1.0)
    #   q = 1.3 (10.4):   m >> 21 = 1 (0.25 <= 0.3 < 0.5) -> 3 (1.5)
    #   q = 0.1 (0.8):    e = 123, m = (0x400000 | m >> 1) >> 3 < 0x200000 -> (0 | 0) + 1 >> 1 = 0
    #   q = 0.5, 1.5, 3, 4 (4, 12, 24, 32): exact -> 1, 3, 5, 6;  q = 0 -> 0
    #   negatives: the same code plus 8 (sign bit 31 -> bit 3); -0.0 -> 8
    x = [48.0, 2.0, 6.0, 10.0, 14.0, 20.0, 28.0, 40.0, 9.6, 10.4, 0.8, 4.0, 12.0, 24.0, 32.0, 0.0,
         -2.0, -6.0, -10.0, -14.0, -20.0, -28.0, -40.0, -48.0, -9.6, -0.8, -0.0, -4.0, -12.0, -24.0, -32.0, -0.0]
    codes = [7, 1, 2, 3, 4, 5, 6, 7, 2, 3, 0, 1, 3, 5, 6, 0,
             9, 10, 11, 12, 13, 14, 15, 15, 10, 8, 8, 9, 11, 13, 14, 8]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):  # 9.6 etc. keep their side of the midpoint in bf16
        blocks, scales = quantize_mxfp4(torch.tensor(x, dtype=dtype))
        assert scales.tolist() == [130]
        assert unpack(blocks).view(-1).tolist() == codes
        assert blocks.view(-1)[:2].tolist() == [7 | (1 << 4), 2 | (3 << 4)]  # element 2j in the low nibble


def test_quantize_hand_worked_scales():
    def quant(values):
        blocks, scales = quantize_mxfp4(torch.tensor(values + [0.0] * (32 - len(values))))
        return scales.item(), unpack(blocks).view(-1)[:len(values)].tolist()

    # max 3 * 2**0: 3 / 6 = 0.5 = 2**-1 exactly -> scale byte 126; q = 2x: 3 -> 6 (7), 1 -> 2 (4), -0.5 -> -1 (10).
    assert quant([3.0, 1.0, -0.5]) == (126, [7, 4, 10])
    # max 5: 5 / 6 = 0.833 rounds up to 1 -> byte 127; q = 5 is the 4 / 6 midpoint -> 6 (7); 0.25 -> 0.5 (1).
    assert quant([5.0, 0.25]) == (127, [7, 1])
    # max 3.2: 3.2 / 6 = 0.533 -> 1, byte 127; q = 3.2: e = 128, m >> 21 = 2 (0.6 * 4) -> (8 | 2) + 1 >> 1 = 5 (3.0).
    assert quant([3.2]) == (127, [5])
    # All zero: max / 6 = 0 -> rounded 0 -> byte 0 and quant scale 0; -0.0 * 0 = -0.0 keeps its sign bit (8).
    assert quant([0.0, -0.0, 0.0, -0.0]) == (0, [0, 8, 0, 8])
    # fp32-subnormal max / 6 (max < 6 * 2**-126): bits (0, m) + 0x7FFFFF carry into exponent 1 -> 2**-126, byte 1,
    # whatever the max: q = x * 2**126. 2**-127 -> 0.5 (1); 1.5 * 2**-128 -> 0.375 -> (0x600000 >> 1) >> 21 = 1 (0.5);
    # 2**-130 -> q = 1/16 -> 0.
    assert quant([2.0 ** -127, 1.5 * 2.0 ** -128, -(2.0 ** -130)]) == (1, [1, 1, 8])
    assert quant([2.0 ** -130]) == (1, [0])  # a block flushed wholly to zero under byte 1
    # 6 * 2**-126 / 6 = 2**-126 is normal and exact: byte 1 again, q = 6 (7).
    assert quant([6 * 2.0 ** -126]) == (1, [7])
    # Near the top: 3e38 / 6 = 5e37 rounds up to 2**126 (byte 253); q = 3.53 -> 4 (6), whose value 2**128 is inf.
    assert quant([3e38]) == (253, [6])


def test_quantize_chunks_strides_and_dtypes(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, 64, generator=g) * torch.exp2(torch.randint(-20, 20, (3, 8, 1), generator=g).float())
    blocks, scales = quantize_mxfp4(x)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2)
    assert blocks.dtype == scales.dtype == torch.uint8
    monkeypatch.setattr(mxfp4, "_CHUNK", 3)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # leading dims do not merge: one expert at a time
    for other in (x, strided, x.double()):
        assert all(torch.equal(u, v) for u, v in zip(quantize_mxfp4(other), (blocks, scales)))
    rows = x[0].t().contiguous().t()
    assert all(torch.equal(u, v) for u, v in zip(quantize_mxfp4(rows), (blocks[0], scales[0])))
    half = x.half()
    assert all(torch.equal(u, v) for u, v in zip(quantize_mxfp4(half), quantize_mxfp4(half.float())))


# -- round trips (the facts in the module docstring) ------------------------------------------------------------------
def every_scale_and_max_code():
    """A block per (scale byte, largest code magnitude): all codes up to that magnitude, both signs."""
    rows = []
    for m in range(8):
        codes = [c | sign for c in range(m + 1) for sign in (0, 8)]
        rows.append((codes * 32)[:32])
    blocks = pack(rows).expand(256, 8, 16).reshape(256, 8, 1, 16).clone()
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1, 1).expand(256, 8, 1).clone()
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_requantized_values_are_unchanged_for_finite_blocks_except_byte_0_halves(dtype):
    blocks, scales = every_scale_and_max_code()
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (256, 64, 32), generator=g)
    codes = torch.where((codes & 7) <= torch.randint(0, 8, (256, 64, 1), generator=g), codes, codes & 8)
    blocks = torch.cat([blocks, pack(codes).view(256, 64, 1, 16)], 1)
    scales = torch.cat([scales, torch.arange(256, dtype=torch.uint8).view(256, 1, 1).expand(256, 64, 1)], 1)
    values = dequantize_mxfp4(blocks, scales, dtype)
    again = dequantize_mxfp4(*quantize_mxfp4(values), dtype)
    same = (again == values).all(-1) & (again.signbit() == values.signbit()).all(-1)
    finite = values.isfinite().all(-1)
    exception = torch.zeros_like(finite)
    if dtype != torch.float16:  # in fp16, byte 0's values all flush to zero
        magnitudes = unpack(blocks)[..., 0, :] & 7
        exception = (scales[..., 0] == 0) & ((magnitudes == 1) | (magnitudes == 3)).any(-1)
    assert same[finite & ~exception].all() and not same[finite & exception].any()  # no claim for inf blocks
    if dtype == torch.float32:
        assert not same[0, 1] and same[0, 0]  # byte 0: 0.5 * 2**-127 comes back as 2**-127; all-zero is fine
        assert same[1:253].all() and finite[:, :2].all() and same[253:, :2].all()  # 0.5 * 2**128 = 2**127 is fine
        assert not finite[255, 2:8].any() and not finite[253, 6:8].any()


def test_requantization_may_change_bytes_and_is_idempotent_after_one_pass():
    # Largest magnitude 3 * 2**k (code 5 under byte s): 3 * 2**k / 6 = 2**(k-1) -> byte s - 1, codes doubled.
    blocks, scales = pack([5, 4, 1] + [0] * 29).view(1, 16), torch.tensor([130], dtype=torch.uint8)
    b, s = quantize_mxfp4(dequantize_mxfp4(blocks, scales, torch.float32))
    assert s.tolist() == [129] and unpack(b)[0, :3].tolist() == [7, 6, 2]
    # All-zero codes under any byte come back with byte 0.
    zeros = torch.zeros(1, 16, dtype=torch.uint8)
    b, s = quantize_mxfp4(dequantize_mxfp4(zeros, torch.tensor([130], dtype=torch.uint8)))
    assert s.tolist() == [0] and not b.any()
    # Largest code 4.0 or 6.0 (Q's own form): bytes unchanged; after one pass Q(D(.)) is a fixed point.
    blocks, scales = every_scale_and_max_code()
    for dtype in (torch.float32, torch.bfloat16):
        b1, s1 = quantize_mxfp4(dequantize_mxfp4(blocks, scales, dtype))
        b2, s2 = quantize_mxfp4(dequantize_mxfp4(b1, s1, dtype))
        finite = dequantize_mxfp4(b1, s1, dtype).isfinite().all(-1)
        kept = (b2 == b1).all(-1) & (s2 == s1)
        assert kept[finite].all() and finite[:253].all()
        unchanged = (b1 == blocks).all(-1) & (s1 == scales)
        assert unchanged[4:250, 6:].all() and not unchanged[4:250, 1:6].any()
        largest = (unpack(b1) & 7).max(-1).values
        canonical = (s1 > 1) & (largest > 0) & dequantize_mxfp4(blocks, scales, dtype).isfinite().all(-1, keepdim=True)
        assert ((largest == 6) | (largest == 7))[canonical].all() and canonical[5:250, 1:].all()
        # Largest magnitude 0.5, 1, 1.5, 2, 3, 4, 6 times 2**(s - 127): the byte moves by -3, -2, -2, -1, -1, 0, 0.
        assert ((s1.int() - scales.int())[4:250, 1:, 0] == torch.tensor([-3, -2, -2, -1, -1, 0, 0])).all()
        assert not s1[:, 0].any()


def test_quantize_is_not_idempotent_on_its_output_exactly_where_the_docstring_says():
    assert not torch.equal(quantize_mxfp4(torch.tensor([3.2] + [0.0] * 31))[1],
                           quantize_mxfp4(dequantize_mxfp4(*quantize_mxfp4(torch.tensor([3.2] + [0.0] * 31))))[1])
    g = torch.Generator().manual_seed(4)
    n = 8192
    x = torch.randn(n, 32, generator=g) * torch.exp2(torch.randint(-150, 129, (n, 1), generator=g).float())
    x = x.clamp(-3.4e38, 3.4e38)
    x[torch.rand(n, 32, generator=g) < 0.1] = 0.0
    x[:64] = torch.where(torch.rand(64, 32, generator=g) < 0.5, -0.0, 0.0)
    for dtype in (torch.float32, torch.bfloat16):
        b, s = quantize_mxfp4(x.to(dtype))
        values = dequantize_mxfp4(b, s, dtype)
        b2, s2 = quantize_mxfp4(values)
        same = ((b2 == b).all(-1) & (s2 == s)).view(-1)
        largest = (unpack(b) & 7).max(-1).values.view(-1)
        s = s.view(-1)
        # (a) largest code 3.0 under byte >= 2, (b) flushed to zero under byte 1, (c) byte 253 (D overflows).
        assert torch.equal(same, ~(((largest == 5) & (s >= 2)) | ((largest == 0) & (s == 1)) | (s == 253)))
        assert 0.1 < (largest == 5).float().mean() < 0.3  # about a fifth of the blocks
        finite = values.isfinite().all(-1).view(-1)
        assert (dequantize_mxfp4(b2, s2, dtype) == values).all(-1).view(-1)[finite].all()  # values still agree


# -- the op, meta tensors, errors ----------------------------------------------------------------------------------
def test_op_forward_inverse_and_converter_table():
    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (2, 6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 130, (2, 6, 2), dtype=torch.uint8, generator=g)
    op = MXFP4()
    assert op.lossy and MXFP4.lossy and op.dtype == torch.bfloat16 and MXFP4(torch.float32) == MXFP4(torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.dtype = torch.float32
    (dense,) = op.forward([blocks, scales])
    assert same_bits(dense, dequantize_mxfp4(blocks, scales))
    b, s = op.inverse([dense])
    assert torch.equal(op.forward([b, s])[0], dense)
    assert all(torch.equal(u, v) for u, v in zip((b, s), quantize_mxfp4(dense)))

    keys = ("model.layers.{i}.mlp.experts.down_proj_blocks", "model.layers.{i}.mlp.experts.down_proj_scales")
    conv = Converter([Rule(keys, "layers.{i}.experts.w2", MXFP4(torch.float32))])
    hf = {"model.layers.0.mlp.experts.down_proj_blocks": blocks, "model.layers.0.mlp.experts.down_proj_scales": scales}
    native = conv.to_native(hf)
    assert same_bits(native["layers.0.experts.w2"], dequantize_mxfp4(blocks, scales, torch.float32))
    saved = conv.from_native({"layers.0.experts.w2": native["layers.0.experts.w2"]})
    assert torch.equal(saved["model.layers.0.mlp.experts.down_proj_scales"], s)
    hf["model.layers.0.mlp.experts.down_proj_scales"] = scales[:, :5]
    message = r"down_proj_blocks .*: blocks \[2, 6, 2, 16\] and scales \[2, 5, 2\] disagree"
    with pytest.raises(CheckpointError, match=message):
        conv.to_native(hf)


def test_meta_tensors():
    blocks = torch.empty(32, 5760, 90, 16, dtype=torch.uint8, device="meta")
    scales = torch.empty(32, 5760, 90, dtype=torch.uint8, device="meta")
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.is_meta and out.shape == (32, 5760, 2880) and out.dtype == torch.float32
    (dense,) = MXFP4().forward([blocks, scales])
    assert dense.is_meta and dense.dtype == torch.bfloat16
    b, s = MXFP4().inverse([dense])
    assert b.is_meta and s.is_meta and b.shape == blocks.shape and s.shape == scales.shape and b.dtype == torch.uint8
    with pytest.raises(ValueError, match="disagree"):
        dequantize_mxfp4(blocks, scales[:, :1])


def test_errors_are_one_line_value_errors():
    b, s = torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)
    cases = [
        (lambda: dequantize_mxfp4(b, s[:, :2]), r"^blocks \[2, 3, 16\] and scales \[2, 2\] disagree$"),
        (lambda: dequantize_mxfp4(b[..., :8], s), r"^blocks \[2, 3, 8\] must be \[\.\.\., groups, 16\]$"),
        (lambda: dequantize_mxfp4(b.to(torch.int8), s),
         r"^blocks and scales must be uint8, got torch.int8 and torch.uint8$"),
        (lambda: dequantize_mxfp4(b, s, torch.int32), r"^cannot dequantize to torch.int32$"),
        (lambda: quantize_mxfp4(torch.zeros(4, 48)), r"^last dim of \[4, 48\] is not a multiple of 32$"),
        (lambda: quantize_mxfp4(torch.zeros(())), r"^last dim of \[\] is not a multiple of 32$"),
        (lambda: quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32)), r"^cannot quantize torch.int32 to MXFP4$"),
        (lambda: MXFP4().forward([b]), r"^got 1 tensors, expected blocks and scales$"),
        (lambda: MXFP4().inverse([]), r"^got 0 tensors to quantize, expected 1$"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
