"""Quantized checkpoints: read as their ``quantization_config`` says, written back the way they came.

A checkpoint's ``config.json`` names its format in ``quantization_config.quant_method`` (gpt-oss's releases:
``mxfp4``). The family declares an on-disk layout of the same name, whose rules' ops are *lossy* (``lossy = True``:
``converters.mxfp4.MXFP4`` dequantizes on load, re-quantizes on save), beside a dense layout (``dense``) of the same
tensors as transformers writes a dequantized model. Loading picks the layout the keys match, as for any layout.

Writing (``QuantizedOutput``), by ``output_quantization``:

- ``input`` (the default): the input's format, keys, shapes, files and ``quantization_config``. A tensor the run
  did not change is written with its original bytes (its dequantized values equal the native tensor's: a LoRA run's
  ``merged/`` that leaves the experts alone reproduces them bitwise); one a full fine-tune changed is re-quantized
  with the format's published rounding. A tensor a LoRA merge changed (``adapted``) is written unquantized, in the
  dtype of the input's other weights, its module named in ``quantization_config.modules_to_not_convert`` (as
  transformers and vLLM read it): re-quantizing would erase most of the adapter's small update.
- ``requantize``: as ``input``, a LoRA merge's changed tensors re-quantized too (the input's format throughout).
- ``none``: the dense layout in the input's files, the dtype of the input's other weights, and no
  ``quantization_config``: what transformers' ``save_pretrained`` writes for a dequantized model.

Re-quantized files hold less than the model that trained, so a resume takes the model from the recipe state
(``narrows``); an export check compares the files with the model as written (``as_written``, the layout's check) and
reports how far that is from the model that trained (the re-quantization's own change).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from waypoint.checkpointers.shard_layout import ShardLayout
from waypoint.converters.table import Converter, Group
from waypoint.errors import CheckpointError

PACKED_KEYS = {"mxfp4": re.compile(r"_(blocks|scales)$"), "fp8": None}  # quant_method -> keys holding integer bytes
FORMATS = {"mxfp4": "MXFP4: FP4 E2M1 values in blocks of 32 along the input features, one E8M0 scale a block",
           "fp8": "block FP8: float8_e4m3fn weights, one weight_scale_inv per block of {block}"}
OUTPUT_QUANTIZATION = ("input", "requantize", "none")
DENSE = "dense"  # the family layout of a dequantized model


def quant_method(config: Mapping[str, Any], source: str = "config.json") -> str | None:
    """The input's quantization format (None: not quantized); one Waypoint cannot read is a one-line error."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    if method not in PACKED_KEYS:
        raise CheckpointError(f"{source}: quantization_config.quant_method {method!r} is not supported; supported: "
                              f"{', '.join(PACKED_KEYS)} (or a checkpoint that is not quantized)")
    return method


def block_size(q: Mapping[str, Any], source: str = "config.json") -> tuple[int, int]:
    """``quantization_config.weight_block_size`` (128x128 where absent): two positive integers, or a one-line error."""
    block = q.get("weight_block_size")
    if block is None:
        return 128, 128
    if not isinstance(block, (list, tuple)) or len(block) != 2 \
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise CheckpointError(f"{source}: quantization_config.weight_block_size {json.dumps(block)}: expected two positive "
                              "integers, the rows and columns of a block (e.g. [128, 128])")
    return block[0], block[1]


def config_dtype(config: Mapping[str, Any]) -> torch.dtype:
    """The dtype config.json names (``dtype`` / ``torch_dtype``), into which transformers dequantizes; bf16 (the
    releases') where it names none."""
    from waypoint.models.dtypes import HF_DTYPES, parse_dtype

    try:
        dtype = parse_dtype(config.get("dtype") or config.get("torch_dtype"))
    except ValueError:
        dtype = None
    return dtype if dtype in HF_DTYPES else torch.bfloat16


def dequantizing_to(converter: Converter, config: Mapping[str, Any]) -> Converter:
    """``converter`` with its lossy ops dequantizing into ``config_dtype(config)``."""
    from waypoint.converters.ops import Chain
    from waypoint.converters.table import Rule

    dtype = config_dtype(config)

    def retyped(op):
        if isinstance(op, Chain):
            return Chain(*(retyped(o) for o in op.ops))
        return replace(op, dtype=dtype) if is_lossy(op) and hasattr(op, "dtype") else op

    variants = {name: [Rule(r.hf, r.native, retyped(r.op)) for r in rules] for name, rules in converter.variants.items()}
    return replace(converter, variants=variants)


def replace_op(rule, kind: type, **fields):
    """``rule`` with its op (or the op of that ``kind`` inside its ``Chain``) given ``fields``."""
    from waypoint.converters.ops import Chain
    from waypoint.converters.table import Rule

    def swap(op):
        if isinstance(op, Chain):
            return Chain(*(swap(o) for o in op.ops))
        return replace(op, **fields) if isinstance(op, kind) else op
    return Rule(rule.hf, rule.native, swap(rule.op))


def is_lossy(op: object) -> bool:
    """Whether an op (or an op inside a ``Chain``) does not give back its input's bytes through a round trip."""
    return bool(getattr(op, "lossy", False)) or any(is_lossy(o) for o in getattr(op, "ops", ()))


class QuantizedOutput:
    """How an HF checkpointer writes a quantized input back (module docstring)."""

    def __init__(self, converter: Converter, config: Mapping[str, Any], output_quantization: str | None,
                 source: str = "config.json") -> None:
        self.method = quant_method(config, source)
        choice = output_quantization or "input"
        if choice not in OUTPUT_QUANTIZATION:
            raise CheckpointError(f"output_quantization={choice!r} is not one of {', '.join(OUTPUT_QUANTIZATION)}")
        if self.method == "mxfp4" and self.method not in converter.variants:
            raise CheckpointError(f"{source}: quantization_config.quant_method {self.method!r} is not a layout of this "
                                  f"model family's checkpoints ({', '.join(converter.variants) or 'it has one layout'})")
        self.block = block_size(config["quantization_config"], source) if self.method == "fp8" else None
        self.source, self.dtype = source, config_dtype(config)
        self.dequantize = self.method is not None and choice == "none"
        self.keeps_adapted = choice == "input"  # a LoRA merge's changed tensors written unquantized
        self.input_unquantized: frozenset[str] = frozenset()  # native keys the input itself holds unquantized
        self.converter = self.dense = converter

    def adopt(self, hf_keys: list[str], dtypes: Mapping[str, torch.dtype] | None = None) -> Converter:
        """The converter for a checkpoint with these keys (and dtypes, where known): for block FP8, the family's rules
        reading the weights the checkpoint holds in FP8 with their scales, re-quantizing into scales of the input's
        dtype (``converters.fp8``); for MXFP4, the family's quantized layout, which also reads the tensors a LoRA merge
        wrote unquantized beside the packed ones (``unquantized``); the family's own otherwise."""
        if self.method == "mxfp4":
            return self._adopt_mxfp4(hf_keys)
        if self.method != "fp8":
            return self.converter
        from waypoint.converters.fp8 import FP8Blocks, fp8_rules, is_scale_key

        if not any(is_scale_key(k) for k in hf_keys):
            raise CheckpointError(f"{self.source}: quantization_config says fp8, but no weight has a weight_scale_inv")
        rules = lambda rs: [replace_op(r, FP8Blocks, dtype=self.dtype) for r in fp8_rules(rs, hf_keys, self.block, dtypes)]  # noqa: E731
        self.converter = replace(self.dense, rules=rules(self.dense.rules),
                                 variants={name: rules(rs) for name, rs in self.dense.variants.items()})
        return self.converter

    def _adopt_mxfp4(self, hf_keys: list[str]) -> Converter:
        quantized, dense = replace(self.converter, variant=self.method), replace(self.converter, variant=DENSE)
        plain = [k for k in hf_keys if not quantized.matches(k, "hf") and dense.matches(k, "hf")]
        if not plain:
            self.converter = quantized
            return self.converter
        # some of the layout's tensors unquantized (modules_to_not_convert, a LoRA's merge): both layouts' rules read
        both = self.converter.variants[self.method] + self.converter.variants[DENSE]
        self.input_unquantized = frozenset(t for g in dense.plan(plain, "hf") for t in g.targets)
        self.converter = replace(self.converter, variants={**self.converter.variants, self.method: both}, variant=self.method)
        return self.converter

    def packed(self, key: str) -> bool:
        """Whether ``key`` may hold the input's quantized integer bytes."""
        pattern = PACKED_KEYS.get(self.method) if self.method else None
        return pattern is not None and bool(pattern.search(key))

    @property
    def lossy(self) -> bool:
        """Whether the output re-quantizes (the files then hold less than the model)."""
        return self.method is not None and not self.dequantize

    # -- the output's converter, layout and config ---------------------------------------------------------
    def unquantized(self, native_keys: list[str], adapted: frozenset[str]) -> frozenset[str]:
        """The native keys written unquantized: every key of a quantized group a LoRA merge changed (``adapted``),
        where ``output_quantization: input`` keeps those."""
        if not self.lossy:
            return frozenset()
        adapted = adapted if self.keeps_adapted else frozenset()
        keep = adapted | self.input_unquantized
        return frozenset(k for g in self.converter.plan(native_keys, "native")
                         if is_lossy(g.rule.op) and keep.intersection(g.sources) for k in g.sources)

    def _dense_converter(self) -> Converter:
        if self.method == "mxfp4":
            return replace(self.converter, variants=self.dense.variants, variant=DENSE)
        return self.dense

    def output_converter(self, unquantized: frozenset[str] = frozenset()):
        if self.dequantize:
            return self._dense_converter()
        return PartlyDense(self.converter, self._dense_converter(), unquantized) if unquantized else self.converter

    def output_layout(self, layout: ShardLayout, native_keys: list[str], unquantized: frozenset[str] = frozenset()) -> ShardLayout:
        """The input's layout, or for a dequantized output (or its ``unquantized`` keys) the dense keys, each in the
        file its quantized twin was in."""
        if not self.dequantize and not unquantized:
            return layout
        quantized = {frozenset(g.sources): g.targets for g in self.converter.plan(native_keys, "native")}
        weight_map = dict(layout.weight_map)
        renamed: dict[str, list[str]] = {}
        for g in self.output_converter(unquantized).plan(native_keys, "native"):
            before = quantized[frozenset(g.sources)]
            if set(before) != set(g.targets):
                file = layout.weight_map[before[0]]
                for key in before:
                    del weight_map[key]
                weight_map.update(dict.fromkeys(g.targets, file))
                renamed[before[0]] = list(g.targets)
        keys_by_file = {f: [new for k in layout.keys_in(f) for new in renamed.get(k, [k] if k in weight_map else [])]
                        for f in layout.files}
        return ShardLayout(layout.files, weight_map, layout.index_name, dict(layout.index_metadata)).with_keys(keys_by_file)

    def output_config(self, config: Mapping[str, Any], unquantized_modules: list[str] = ()) -> dict[str, Any]:
        """config.json: without ``quantization_config`` when dequantized; with the modules written unquantized added
        to its ``modules_to_not_convert``."""
        config = {k: v for k, v in config.items() if not (self.dequantize and k == "quantization_config")}
        if unquantized_modules and "quantization_config" in config:
            q = dict(config["quantization_config"])
            q["modules_to_not_convert"] = list(dict.fromkeys([*(q.get("modules_to_not_convert") or []), *unquantized_modules]))
            config["quantization_config"] = q
        return config

    # -- what a load report and scripts/inspect.py say --------------------------------------------------------
    def notes(self, hf_keys: list[str], native: Mapping[str, torch.Tensor]) -> list[str]:
        """The load report's lines about the quantized tensors read (format, block size, dequantized shapes)."""
        if self.method is None:
            return []
        groups = [g for g in self.converter.plan(hf_keys, "hf") if is_lossy(g.rule.op)]
        from waypoint.checkpointers.load_report import fold_keys
        from waypoint.lazy import spec_of

        shapes: dict[tuple, list[str]] = {}
        for g in groups:
            for key in g.targets:
                shape, dtype = spec_of(native, key)
                shapes.setdefault((tuple(shape), str(dtype).removeprefix("torch.")), []).append(key)
        read = ", ".join(f"{', '.join(fold_keys(keys))} {list(shape)} {dtype}" for (shape, dtype), keys in shapes.items())
        written = "dense (output_quantization: none)" if self.dequantize else \
            f"{self.method} again, untouched tensors byte for byte (output_quantization: none writes them dense)"
        return [f"quantized input ({self.method}): {len(groups)} tensors dequantized as loaded into {read}; "
                f"{FORMATS[self.method].format(block=list(self.block or ()))}; written back {written}"]

    # -- unchanged tensors keep their bytes ------------------------------------------------------------------
    def keep_unchanged(self, groups: list[Group], converted: dict[str, torch.Tensor], native: Mapping[str, torch.Tensor],
                       source: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``converted`` with each lossy group's keys replaced by the input's bytes where the group's native tensors
        equal what those bytes load as (the run did not change them)."""
        if not self.lossy:
            return converted
        for g in groups:
            if is_lossy(g.rule.op) and _unchanged(g, [native[k] for k in g.sources], source):
                converted.update({k: source[k] for k in g.targets})
        return converted

    def keep_input_scales(self, groups: list[Group], converted: dict[str, torch.Tensor],
                          native: Mapping[str, torch.Tensor], scales: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``converted`` (a conversion from another format) with each block-FP8 group whose input scales were kept
        (``scales``: HF key -> the input's ``weight_scale_inv``, ``hf_source.HFSource.scales``) written with those
        scales and the bytes they give back, where these read back as the native tensors (the run left them alone):
        the input's bytes, whatever rounding made them."""
        for g in groups:
            written = _with_input_scales(g, [native[k] for k in g.sources], scales) if is_lossy(g.rule.op) else None
            if written is not None:
                converted.update(zip(g.targets, written))
        return converted

    @contextlib.contextmanager
    def as_written(self, model: torch.nn.Module, source: Mapping[str, torch.Tensor],
                   adapted: frozenset[str] = frozenset(), scales: Mapping[str, torch.Tensor] | None = None) -> Iterator[None]:
        """Within: ``model``'s parameters that the output re-quantizes hold the values the files will load as (each
        round-tripped through the format; those still equal to what the input's bytes (``source``) load as are kept
        with those bytes, so they stay, as do those a conversion's kept input ``scales`` give back exactly
        (``keep_input_scales``); those written unquantized (``adapted``: see ``unquantized``) keep their values), the
        trained values restored on exit."""
        if not self.lossy:
            yield
            return
        params = dict(model.named_parameters())
        keys = [k for k in params if not k.endswith("_extra_state")]
        dense = self.unquantized(keys, adapted)
        groups = [g for g in self.converter.plan(keys, "native") if is_lossy(g.rule.op) and not dense.intersection(g.sources)]
        kept: dict[str, torch.Tensor] = {}
        try:
            with torch.no_grad():
                for g in groups:  # in the same order on every rank: a sharded parameter is gathered whole
                    values = [_whole(params[k].detach()) for k in g.sources]
                    if _unchanged(g, values, source) or (scales and _with_input_scales(g, values, scales) is not None):
                        continue
                    rounded = g.rule.op.forward(g.rule.op.inverse(values))
                    for key, value in zip(g.sources, rounded):
                        kept[key] = _local(params[key]).to("cpu", copy=True)
                        _local(params[key]).copy_(_piece(value, params[key]))
            yield
        finally:
            with torch.no_grad():
                for key, value in kept.items():
                    _local(params[key]).copy_(value)


class PartlyDense:
    """The output converter of a quantized input some of whose tensors are written unquantized: ``dense``'s rules for
    the groups of those native keys (``unquantized``), ``quantized``'s for the rest."""

    def __init__(self, quantized: Converter, dense: Converter, unquantized: frozenset[str]) -> None:
        self.quantized, self.dense, self.unquantized = quantized, dense, unquantized

    def plan(self, keys, side: str, where=None) -> list[Group]:
        keys = list(keys)
        return (self.quantized.plan([k for k in keys if k not in self.unquantized], side, where)
                + self.dense.plan([k for k in keys if k in self.unquantized], side, where))

    def dense_targets(self, keys) -> set[str]:
        """The output keys written unquantized."""
        return {t for g in self.dense.plan([k for k in keys if k in self.unquantized], "native") for t in g.targets}

    def __getattr__(self, name: str):  # native_keys_to_save, apply_groups, is_parameter: the quantized converter's
        return getattr(self.quantized, name)


def _with_input_scales(group: Group, values: list[torch.Tensor], scales: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
    """A block-FP8 group's tensors to write for its native ``values`` with the input's kept ``scales`` (HF key -> its
    ``weight_scale_inv``), where these give back those very values; else None (they are re-quantized)."""
    from waypoint.converters.fp8 import input_bytes, is_scale_key

    keys = [k for k in group.targets if is_scale_key(k)]
    if not keys or not all(k in scales for k in keys):
        return None
    return input_bytes(group.rule.op, values, [scales[k] for k in keys])


def _unchanged(group: Group, values: list[torch.Tensor], source: Mapping[str, torch.Tensor]) -> bool:
    """Whether a lossy group's native ``values`` are what the input's bytes for it (``source``) load as."""
    if not all(k in source for k in group.targets):
        return False
    loaded = group.rule.op.forward([source[k] for k in group.targets])
    return all(_same(v, t) for v, t in zip(values, loaded))


def _same(trained: torch.Tensor, loaded: torch.Tensor) -> bool:
    trained = trained.detach().cpu() if trained.device.type != "meta" else trained
    return trained.shape == loaded.shape and torch.equal(trained, loaded.to(trained.dtype))


def describe_packed(method: str | None, headers: Mapping[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """scripts/inspect.py's lines for a quantized checkpoint's packed tensors: each ``*_blocks`` / ``*_scales`` pair
    with the shape it dequantizes to (``headers``: key -> (shape, dtype) as stored)."""
    if method != "mxfp4":
        return []
    from waypoint.checkpointers.load_report import fold_keys

    shapes: dict[tuple, list[str]] = {}
    for key, (shape, _) in headers.items():
        stem = key.removesuffix("_blocks")
        if key.endswith("_blocks") and stem + "_scales" in headers and len(shape) >= 2:
            shapes.setdefault(tuple(shape[:-2]) + (shape[-2] * shape[-1] * 2,), []).append(stem)
    rows = [f"  {pattern + '_{blocks,scales}':<60} -> {list(shape)} dequantized"
            for shape, stems in shapes.items() for pattern in fold_keys(stems)]
    return [f"quantized ({FORMATS[method]}):"] + sorted(rows) if rows else []


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a sharded (FSDP2) parameter: gathered


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _piece(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole``'s values where ``like`` holds them: this rank's piece of a sharded parameter, in its dtype."""
    if hasattr(like, "device_mesh"):
        from waypoint.lazy import local_shard

        return local_shard(whole, like, device=_local(like).device, dtype=like.dtype).to_local()
    return whole.to(like.dtype)
