"""Block FP8 (DeepSeek-V3's release, Qwen3's ``-FP8``) as a converter op, and the rules it wraps.

Unlike MXFP4, which one family declares as an on-disk layout of its experts, block FP8 quantizes whatever linear
weights a checkpoint says (``X.weight`` in ``float8_e4m3fn`` beside its ``X.weight_scale_inv``, or packed experts
``mlp.experts.gate_up_proj`` beside ``mlp.experts.gate_up_proj_scale_inv``; embeddings, norms, gates and heads
usually stay in bf16, per ``modules_to_not_convert``). So it is a wrapper over any family's table:
``fp8_rules`` gives each rule whose keys the checkpoint holds quantized a twin that reads the weights with their
scales, dequantizes them (``FP8Blocks``) and then applies the rule's own op (a rename, the RoPE permutation, a
split of fused projections, a stack of experts), and on save runs the same chain backwards.

Each dense tensor the chain makes out of whole rows of one FP8 weight carries where its values come from
(``fp8_source``, an :class:`FP8Source`): block FP8 does not survive dequantize -> quantize (each block's scale is
recomputed from its max), so a holder of FP8 weights (``quantize_base: fp8``, ``models.fp8_weight``) takes those
bytes instead of re-quantizing the values. ``KeepSource`` passes it through the rule's op where that op only
picks and orders rows, or stacks whole experts (found by running it on the rows' numbers); the values are
untouched either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from waypoint.converters.ops import Chain
from waypoint.converters.table import Rule, compile_pattern
from waypoint.fp8 import FP8_SOURCE, FP8Source, StackedFP8Source, carry_source, dequantize_fp8, encode_fp8, quantize_fp8


def _row_probes(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Per input of ``shapes``: ``[..., R, 1]`` whose value is the input's number times 2**32 plus the row (dim -2)."""
    big = 1 << 32
    return [torch.arange(s[-2], dtype=torch.int64).add_(j * big).view(-1, 1).expand(*s[:-1], 1).contiguous()
            for j, s in enumerate(shapes)]


def row_plan(op, shapes: list[tuple[int, ...]], block: tuple[int, int]) -> list[tuple[int, int, int, torch.Tensor | None] | str]:
    """For each output of ``op`` on dense inputs of ``shapes`` (2-D, or ``[E, R, C]`` packed experts): ``(j, lo, hi,
    order)`` where it is rows ``lo:hi`` (dim -2) of input ``j`` (of each expert alike), starting and ending on whole
    blocks of ``block[0]`` rows (or the input's end), in the order ``order`` (None: as they are); otherwise why not.
    Found by running ``op`` on each input's row numbers."""
    if not shapes or any(len(s) < 2 for s in shapes):
        return []
    big = 1 << 32
    try:
        outs = op.forward(_row_probes(shapes))
    except (ValueError, RuntimeError, IndexError, TypeError):
        return []
    plans: list[tuple[int, int, int, torch.Tensor | None] | str] = []
    for out in outs:
        if out.ndim < 2 or out.shape[-1] != 1 or not out.numel():
            plans.append("its conversion does not keep whole rows")
            continue
        per_expert = out.reshape(-1, out.shape[-2])
        j = int(per_expert[0, 0]) // big
        rows = per_expert[0] - j * big
        lo, hi = int(rows.min()), int(rows.max()) + 1
        if not bool((per_expert // big == j).all()) or tuple(out.shape[:-2]) != tuple(shapes[j][:-2]):
            plans.append("its rows come from several tensors of the file")
        elif not bool((per_expert == per_expert[0]).all()):
            plans.append("its experts' rows are not alike")
        elif hi - lo != len(rows) or not torch.equal(rows.sort().values, torch.arange(lo, hi)):
            plans.append("its rows are not a range of the file's rows")
        elif lo % block[0] or (hi % block[0] and hi != shapes[j][-2]):
            plans.append(f"rows {lo}:{hi} of the file's {shapes[j][-2]} are not whole blocks of {block[0]}")
        else:
            plans.append((j, lo, hi, None if torch.equal(rows, torch.arange(lo, hi)) else rows - lo))
    return plans


def stack_plan(op, shapes: list[tuple[int, ...]]) -> bool:
    """Whether ``op`` on 2-D inputs of ``shapes`` (one per expert) gives one tensor stacking them whole, in order (a
    MoE's ``Stack``): its source is then the experts' sources (``StackedFP8Source``)."""
    if not shapes or any(len(s) != 2 for s in shapes) or len(set(shapes)) != 1:
        return False
    probes = _row_probes(shapes)
    try:
        outs = op.forward(probes)
    except (ValueError, RuntimeError, IndexError, TypeError):
        return False
    return len(outs) == 1 and torch.equal(outs[0], torch.stack(probes))


@dataclass(frozen=True)
class KeepSource:
    """A rule's ``op`` after ``FP8Blocks``, passing each input's ``fp8_source`` on to each output made of whole block
    rows of one input (``row_plan``: the RoPE permutation of q/k, a split of fused projections on block boundaries,
    packed experts' gate/up split alike), with those rows' bytes and scales, or, to a stack of whole experts
    (``stack_plan``), the experts' sources. The values are ``op``'s, bitwise."""

    op: object

    def __getattr__(self, name: str):
        if name == "count":  # the experts a Stack inside gathers (what a rule with {e} in its keys asks its op)
            return getattr(self.op, name)
        raise AttributeError(name)

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = self.op.forward(tensors)
        sources = [getattr(t, FP8_SOURCE, None) for t in tensors]
        if not sources or any(not isinstance(s, FP8Source) or s.rows is not None for s in sources):
            return out
        shapes = [tuple(t.shape) for t in tensors]
        if len(out) == 1 and out[0].ndim == 3 and stack_plan(self.op, shapes):
            setattr(out[0], FP8_SOURCE, StackedFP8Source(tuple(sources)))
            return out
        for t, plan in zip(out, row_plan(self.op, shapes, sources[0].block)):
            if not isinstance(plan, tuple):
                continue
            j, lo, hi, order = plan
            if t.ndim == tensors[j].ndim and t.shape[-1] == tensors[j].shape[-1] and (order is None or t.ndim == 2):
                s, (bm, _) = sources[j], sources[j].block
                setattr(t, FP8_SOURCE, FP8Source(s.weight[..., lo:hi, :], s.scale_inv[..., lo // bm: -(-hi // bm), :],
                                                 s.block, s.dtype, order))
        return out

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.op.inverse(tensors)


@dataclass(frozen=True)
class FP8Blocks:
    """``[w_1 .. w_n, s_1 .. s_n]`` (FP8 weights, then their block scales) <-> the n dense tensors in ``dtype``.

    Lossy: ``inverse(forward(x))`` is not guaranteed bitwise, so a writer keeps the original bytes of a tensor the
    run did not change (``checkpointers.quantization``)."""

    block: tuple[int, int] = (128, 128)
    dtype: torch.dtype = torch.bfloat16
    scale_dtype: torch.dtype = torch.float32  # the input's scales' (fp32, or bf16 as some releases store them)
    lossy: ClassVar[bool] = True

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) % 2:
            raise ValueError(f"got {len(tensors)} tensors, expected FP8 weights and as many scales")
        n = len(tensors) // 2
        out = [dequantize_fp8(w, s, self.block, self.dtype, finite=True) for w, s in zip(tensors[:n], tensors[n:])]
        for t, w, s in zip(out, tensors[:n], tensors[n:]):  # its origin, for a holder of FP8 weights (module docstring)
            setattr(t, FP8_SOURCE, FP8Source(w, s, self.block, self.dtype))
        return out

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        pairs = [quantize_fp8(t, self.block, self.scale_dtype) for t in tensors]
        return [w for w, _ in pairs] + [s for _, s in pairs]

    def encode(self, tensors: list[torch.Tensor], scales: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """``inverse`` for given scales (the input's): the FP8 weights and ``scales`` if the weights read back as
        ``tensors`` exactly (then they are the input's bytes, whatever rounding made them), else None."""
        weights = [encode_fp8(t, s, self.block) for t, s in zip(tensors, scales)]
        loaded = self.forward(weights + list(scales))
        if all(t.shape == d.shape and torch.equal(t, d.to(t.dtype)) for t, d in zip(tensors, loaded)):
            return weights + list(scales)
        return None


def input_bytes(op, values: list[torch.Tensor], scales: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """For a rule's FP8 op (``Chain(FP8Blocks, KeepSource(op))``: ``fp8_rules``) and the native ``values`` it
    writes: the FP8 weights and scales to write when ``scales`` (the input's, kept beside a converted checkpoint:
    ``checkpointers.hf_source``) give back these very values, else None (re-quantize them)."""
    if not isinstance(op, Chain) or not op.ops or not isinstance(op.ops[0], FP8Blocks):
        return None
    dense = Chain(*op.ops[1:]).inverse([v.detach().cpu() for v in values])
    if len(dense) != len(scales):
        return None
    return op.ops[0].encode(dense, scales)


def scale_key(key: str) -> str:
    """The key of ``key``'s block scales: ``X.weight_scale_inv`` beside ``X.weight``, and beside packed experts
    (``mlp.experts.gate_up_proj [E, 2I, H]``) ``mlp.experts.gate_up_proj_scale_inv``, as transformers names them."""
    return key + "_scale_inv"


def fp8_rules(rules: list[Rule], hf_keys: Iterable[str], block: tuple[int, int],
              dtypes: Mapping[str, torch.dtype] | None = None) -> list[Rule]:
    """``rules`` with each rule whose weights the checkpoint holds in FP8 (a ``scale_key`` beside each) reading them
    with their scales (re-quantized ones stored in the dtype ``dtypes`` gives its scales: fp32 by default); the
    others as they are."""
    keys = list(hf_keys)
    out = []
    for rule in rules:
        scales = tuple(scale_key(p) for p in rule.hf)
        matched = [[k for k in keys if compile_pattern(s).match(k)] for s in scales]
        if not all(matched):
            out.append(rule)
            continue
        held = {dtypes[k] for ks in matched for k in ks if dtypes and k in dtypes}
        scale_dtype = held.pop() if len(held) == 1 else torch.float32
        out.append(Rule(rule.hf + scales, rule.native, Chain(FP8Blocks(block, scale_dtype=scale_dtype), KeepSource(rule.op))))
    return out


def is_scale_key(key: str) -> bool:
    return key.endswith("_scale_inv")


def nonfinite(key: str, tensor: torch.Tensor) -> str | None:
    """Why an FP8 checkpoint's ``key`` (a block scale, or a ``float8_e4m3fn`` weight) cannot be read: nan or inf
    scales, NaN weight bytes (e4m3fn has no inf); None where it is fine. A scale tensor is 1/16384 of its weight's
    values for 128x128 blocks: checking every one at load costs next to nothing."""
    if tensor.is_meta or not tensor.is_floating_point():
        return None
    if tensor.dtype == torch.float8_e4m3fn:
        bad = int(((tensor.view(torch.uint8) & 0x7F) == 0x7F).sum())
        return f"{bad} of its {tensor.numel()} float8_e4m3fn values are NaN" if bad else None
    bad = int((~torch.isfinite(tensor)).sum())
    return f"{bad} of its {tensor.numel()} block scales are nan or inf" if bad else None


__all__ = ["FP8Blocks", "FP8Source", "FP8_SOURCE", "KeepSource", "StackedFP8Source", "carry_source", "fp8_rules",
           "input_bytes", "is_scale_key", "nonfinite", "row_plan", "scale_key", "stack_plan"]
