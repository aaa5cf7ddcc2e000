"""``quantize_base`` in a LoRA config: the frozen base held quantized, set up on the meta-built model before the base
loads, so each weight is quantized as it is read and the full-precision base never exists in memory.

- ``nf4`` (QLoRA): the linear weights in 4 bits (``waypoint.models.nf4``). ``nf4.block_size`` values share a scale
  (64 in the QLoRA paper), ``nf4.scaler_block_size`` scales share the double quantization's (256); ``nf4.output``
  also holds the output head in 4 bits. A weight whose size does not divide into those blocks stays in the compute
  dtype, named in the run's first lines.
- ``mxfp4``: the mixture-of-experts weights (every MoE's w1, w3, w2) in MXFP4, gpt-oss's own format
  (``waypoint.models.mxfp4_weight``): an MXFP4 checkpoint's experts keep exactly their values, at 4.25 bits each.
  Attention, embeddings, norms, router and head stay in the compute dtype. One process only (FSDP2 cannot shard it).
- ``fp8``: a block-FP8 checkpoint's (Qwen3 ``-FP8``, DeepSeek-V3) linear weights held in FP8
  (``waypoint.models.fp8_weight``), as the file's own bytes and scales wherever the conversion only picks and orders
  whole rows (a rename, q/k's RoPE permutation, a split on block boundaries) or stacks whole experts, re-quantized
  otherwise (named, with why); about one byte a value. The attention and MLP projections and a MoE's experts the
  checkpoint holds in FP8, and the head if it does; the rest in the compute dtype.
  One process only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from waypoint.checkpointers.load_model import map_prefixes
from waypoint.checkpointers.load_report import fold_keys
from waypoint.checkpointers.quantization import is_lossy
from waypoint.converters.fp8 import KeepSource, row_plan, stack_plan
from waypoint.errors import CheckpointError
from waypoint.models import parse_dtype
from waypoint.models.fp8_weight import quantize_fp8_linears
from waypoint.models.mxfp4_weight import quantize_experts
from waypoint.models.nf4 import QUANTIZE_BASE, QuantizedBase, quantize_linears


@dataclass(frozen=True)
class NF4Options:
    """The config's ``nf4`` section (the QLoRA paper's blocks by default)."""

    block_size: int = 64
    scaler_block_size: int = 256
    output: bool = False


def quantize_base(model: nn.Module, dtype: str, method: str | None, nf4: NF4Options | None = None, shards: int = 1,
                  checkpointer=None) -> list[str]:
    """Make the base's frozen weights quantized placeholders as ``method`` (``quantize_base``: None, ``nf4``,
    ``mxfp4`` or ``fp8``) says, the rest held in ``dtype``; the lines to print. ``shards``: the FSDP2 world size;
    ``checkpointer``: the input's, loaded (``fp8`` reads its format, block and keys)."""
    if method is None:
        return []
    if method not in QUANTIZE_BASE:
        raise CheckpointError(f"quantize_base={method}: expected null or one of {', '.join(QUANTIZE_BASE)}")
    if method == "mxfp4":
        return _mxfp4(model, dtype, shards)
    if method == "fp8":
        return _fp8(model, dtype, shards, checkpointer)
    nf4 = nf4 or NF4Options()
    done = quantize_linears(model, parse_dtype(dtype), nf4.block_size, nf4.scaler_block_size, nf4.output, shards)
    if not done.quantized:
        first, why = next(iter(done.kept.items()), ("(no linear layer)", "none found"))
        raise CheckpointError(f"quantize_base=nf4: no base weight can be held in NF4 ({first}: {why}); choose a smaller "
                              "nf4.block_size or nf4.scaler_block_size")
    return [f"nf4: {len(done.quantized)} frozen base weights held in 4 bits (blocks of {nf4.block_size}, "
            f"scales in blocks of {nf4.scaler_block_size}); the rest in {dtype}"] + _kept("nf4", done, dtype)


def _mxfp4(model: nn.Module, dtype: str, shards: int) -> list[str]:
    if shards > 1:
        raise CheckpointError("quantize_base=mxfp4 is single-process; under torchrun (FSDP2) set quantize_base=null "
                              "(the experts sharded in dtype) or run one process")
    done = quantize_experts(model, parse_dtype(dtype))
    if not done.quantized:
        if not done.kept:
            raise CheckpointError("quantize_base=mxfp4 holds mixture-of-experts weights (each MoE layer's w1, w2, w3) "
                                  "in MXFP4, and this model has none; quantize_base=nf4 holds its linear layers in 4 bits")
        first, why = next(iter(done.kept.items()))
        raise CheckpointError(f"quantize_base=mxfp4: no expert weight can be held in MXFP4 ({first}: {why})")
    return [f"mxfp4: {len(done.quantized)} expert weights held in MXFP4 (4.25 bits a value: blocks of 32 sharing a "
            f"scale); the rest in {dtype}"] + _kept("mxfp4", done, dtype)


def _fp8(model: nn.Module, dtype: str, shards: int, checkpointer) -> list[str]:
    if shards > 1:
        raise CheckpointError("quantize_base=fp8 is single-process; under torchrun (FSDP2) set quantize_base=null "
                              "(the base dequantized and sharded in dtype) or run one process")
    quantized = getattr(checkpointer, "quantized", None)
    method = getattr(quantized, "method", None)
    if method != "fp8":
        where = getattr(checkpointer, "checkpoint_dir", "the input")
        hint = ("quantize_base=mxfp4 holds its experts as they are" if method == "mxfp4" else
                "quantize_base=nf4 holds a dense base in 4 bits" if method is None else "quantize_base=null")
        raise CheckpointError(f"quantize_base=fp8 holds a block-FP8 checkpoint's weights as its own bytes, and {where} "
                              f"is {f'{method}, not block FP8' if method else 'not quantized'}; {hint}")
    plan = _fp8_plan(model, checkpointer)
    done = quantize_fp8_linears(model, parse_dtype(dtype), quantized.block, set(plan))
    for key in sorted(plan.keys() - set(done.quantized) - done.kept.keys()):  # FP8 in the file, not a base linear here
        done.kept[key] = "not one of the frozen base linears"
    if not done.quantized:
        raise CheckpointError("quantize_base=fp8: none of the base's linear layers is held in block FP8 by the checkpoint")
    exact = [k for k in done.quantized if plan[k] is None]
    why: dict[str, list[str]] = {}
    for key in done.quantized:
        if plan[key] is not None:
            why.setdefault(plan[key], []).append(key)
    again = "; ".join(f"{', '.join(fold_keys(keys))}: {reason}" for reason, keys in why.items())
    return [f"fp8: {len(exact)} weights held as the file's bytes, {len(done.quantized) - len(exact)} re-quantized"
            f"{f' ({again})' if again else ''}; block FP8 in blocks of {list(quantized.block)}, the rest in {dtype}"] \
        + _kept("fp8", done, dtype)


def _fp8_plan(model: nn.Module, checkpointer) -> dict[str, str | None]:
    """The model keys the checkpoint holds in block FP8 -> None where the load takes the file's bytes (its conversion
    keeps whole block rows: ``converters.fp8.row_plan``, as ``KeepSource`` will when the tensors are read), else why
    it is re-quantized. Shapes only: the hf-side ones from the model's, through each rule's inverse on meta."""
    converter, block = checkpointer.converter, checkpointer.quantized.block
    if not getattr(checkpointer, "input_dtypes", None):
        raise CheckpointError("quantize_base=fp8 reads the checkpoint's keys: load_checkpoint() it first")
    groups = [g for g in converter.plan(list(checkpointer.input_dtypes), "hf") if is_lossy(g.rule.op)]
    params = dict(model.named_parameters())
    mapping = map_prefixes([t for g in groups for t in g.targets], list(params))
    plan: dict[str, str | None] = {}
    for g in groups:
        keep = next((op for op in getattr(g.rule.op, "ops", ()) if isinstance(op, KeepSource)), None)
        if keep is None or not all(mapping[t] in params for t in g.targets):
            continue
        natives = [torch.empty(params[mapping[t]].shape, device="meta") for t in g.targets]
        shapes = [tuple(t.shape) for t in keep.op.inverse(natives)]
        if len(g.targets) == 1 and stack_plan(keep.op, shapes):  # a MoE's experts, stacked whole: their bytes
            plan[mapping[g.targets[0]]] = None
            continue
        rows = row_plan(keep.op, shapes, block) or ["its conversion does not keep whole rows"] * len(g.targets)
        for target, native, how in zip(g.targets, natives, rows):
            if isinstance(how, tuple) and native.shape[-1] != shapes[how[0]][-1]:
                how = "its conversion does not keep whole rows"
            plan[mapping[target]] = None if isinstance(how, tuple) else how
    return plan


def _kept(method: str, done: QuantizedBase, dtype: str) -> list[str]:
    reasons: dict[str, list[str]] = {}
    for key, why in done.kept.items():
        reasons.setdefault(why, []).append(key)
    return [f"{method}: kept in {dtype}: {', '.join(fold_keys(keys))} ({why})" for why, keys in reasons.items()]
