"""Block FP8 (DeepSeek-V3's release, Qwen3's ``-FP8``) as a converter op, and the rules it wraps.

Unlike MXFP4, which one family declares as an on-disk layout of its experts, block FP8 quantizes whatever linear
weights a checkpoint says (``X.weight`` in ``float8_e4m3fn`` beside its ``X.weight_scale_inv``; embeddings, norms,
gates and heads usually stay in bf16, per ``modules_to_not_convert``). So it is a wrapper over any family's table:
``fp8_rules`` gives each rule whose keys the checkpoint holds quantized a twin that reads the weights with their
scales, dequantizes them (``FP8Blocks``) and then applies the rule's own op (a rename, the RoPE permutation, a
split of fused projections, a stack of experts), and on save runs the same chain backwards.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch

from waypoint.converters.ops import Chain
from waypoint.converters.table import Rule, compile_pattern
from waypoint.fp8 import dequantize_fp8, quantize_fp8

SCALE = "weight_scale_inv"


@dataclass(frozen=True)
class FP8Blocks:
    """``[w_1 .. w_n, s_1 .. s_n]`` (FP8 weights, then their block scales) <-> the n dense tensors in ``dtype``.

    Lossy: ``inverse(forward(x))`` is not guaranteed bitwise, so a writer keeps the original bytes of a tensor the
    run did not change (``checkpointers.quantization``)."""

    block: tuple[int, int] = (128, 128)
    dtype: torch.dtype = torch.bfloat16
    lossy: ClassVar[bool] = True

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) % 2:
            raise ValueError(f"got {len(tensors)} tensors, expected FP8 weights and as many scales")
        n = len(tensors) // 2
        return [dequantize_fp8(w, s, self.block, self.dtype) for w, s in zip(tensors[:n], tensors[n:])]

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        pairs = [quantize_fp8(t, self.block) for t in tensors]
        return [w for w, _ in pairs] + [s for _, s in pairs]


def fp8_rules(rules: list[Rule], hf_keys: Iterable[str], block: tuple[int, int]) -> list[Rule]:
    """``rules`` with each rule whose weights the checkpoint holds in FP8 (a ``weight_scale_inv`` beside them)
    reading them with their scales; the others as they are."""
    keys = list(hf_keys)
    out = []
    for rule in rules:
        scales = tuple(p.removesuffix("weight") + SCALE for p in rule.hf)
        quantized = all(p.endswith(".weight") for p in rule.hf) and all(
            any(compile_pattern(s).match(k) for k in keys) for s in scales)
        out.append(Rule(rule.hf + scales, rule.native, Chain(FP8Blocks(block), rule.op)) if quantized else rule)
    return out


def is_scale_key(key: str) -> bool:
    return bool(re.search(rf"\.{SCALE}$", key))


__all__ = ["FP8Blocks", "SCALE", "fp8_rules", "is_scale_key"]
