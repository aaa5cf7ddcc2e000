"""Writing a native state dict in another format than it came in (``scripts/convert.py``).

Same-format saves go through each checkpointer's ``save_to`` and reproduce the
input's files exactly; this module is for changing format (or sharding): HF
(``config.json`` + ``model-0000X-of-0000N.safetensors`` + index), Meta
(``params.json`` + ``consolidated.NN.pth`` model-parallel files) and native.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from waypoint.checkpointers.commit import StagedDir
from waypoint.checkpointers.file_formats import write_tensors
from waypoint.checkpointers.hf_source import SOURCE_FILE, HFSource
from waypoint.checkpointers.meta_checkpointer import meta_hidden_dim
from waypoint.checkpointers.native_checkpointer import ALIASES_KEY, MODEL_FILE, describe, native_converter
from waypoint.checkpointers.shard_layout import ShardLayout
from waypoint.converters import CheckpointError
from waypoint.converters.meta import meta_converter, model_parallel_dim, vocab_parallel
from waypoint.families import detect_model_type, get_converter, hf_config_for
from waypoint.models import ModelArgs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def plan_shards(sizes: Mapping[str, int], num_shards: int | None = None, max_shard_bytes: int | None = None) -> list[list[str]]:
    """Keys, in order, cut into ``num_shards`` files of about equal bytes, or into files of at most
    ``max_shard_bytes`` (a tensor larger than that gets a file of its own)."""
    keys = list(sizes)
    if max_shard_bytes:
        shards, current, size = [], [], 0
        for key in keys:
            if current and size + sizes[key] > max_shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append(key)
            size += sizes[key]
        return shards + ([current] if current else [])
    n = max(1, min(num_shards or 1, len(keys)))
    total = sum(sizes.values())
    shards, current, size = [], [], 0
    for key in keys:
        current.append(key)
        size += sizes[key]
        if len(shards) < n - 1 and size >= total * (len(shards) + 1) / n:
            shards.append(current)
            current = []
    return shards + ([current] if current else [])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write_sharded(stage: StagedDir, tensors: Mapping[str, torch.Tensor], shards: list[list[str]],
                   metadata: Mapping[str, str], aliases: Mapping[str, str] | None = None) -> None:
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name, keys in tqdm(list(zip(names, shards)), desc="write", unit="file", leave=False):
        file_metadata = dict(metadata)
        if aliases and any(target in keys for target in aliases.values()):
            file_metadata[ALIASES_KEY] = json.dumps(dict(aliases))
        stage.write(name, lambda f: write_tensors(f, {k: tensors[k] for k in keys}, "safetensors", file_metadata))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in sorted(keys)}}
        stage.write_bytes("model.safetensors.index.json", (json.dumps(index, indent=2) + "\n").encode())


def hf_config(args: ModelArgs, model_type: str, dtype: torch.dtype, special_tokens: dict | None = None) -> dict:
    """A config.json for a model that came without one: every field from what the weights' shapes, the ModelArgs
    and the tokenizer (``special_tokens``: bos/eos ids) say, in the family's own terms."""
    config = hf_config_for(args, model_type)
    return {**config, **(special_tokens or {}), "dtype": _DTYPE_NAMES.get(dtype, "float32")}


def _write_layout(stage: StagedDir, tensors: Mapping[str, torch.Tensor], layout: ShardLayout) -> None:
    """The files, key -> file map and index metadata of a source checkpoint, for these tensors."""
    for name in tqdm(layout.files, desc="write", unit="file", leave=False):
        keys = [k for k, f in layout.weight_map.items() if f == name]
        stage.write(name, lambda f, keys=keys: write_tensors(f, {k: tensors[k] for k in keys}, layout.file_format, {"format": "pt"}))
    if layout.index_name:
        metadata = dict(layout.index_metadata, total_size=sum(_nbytes(t) for t in tensors.values()))
        if "total_parameters" in metadata:
            metadata["total_parameters"] = sum(t.numel() for t in tensors.values())
        index = {"metadata": metadata, "weight_map": dict(sorted(layout.weight_map.items()))}
        stage.write_bytes(layout.index_name, (json.dumps(index, indent=2) + "\n").encode())


def _source_layout(layout: ShardLayout | None, keys) -> ShardLayout | None:
    """The source's layout where it places exactly these keys (a headless source: without the ``model.`` prefix)."""
    if layout is None or layout.weight_map is None:
        return None
    if set(layout.weight_map) == set(keys):
        return layout
    return None


def meta_params(args: ModelArgs) -> dict:
    """params.json whose derived FFN width is the model's (multiple_of chosen to reproduce it)."""
    params = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
              "vocab_size": args.vocab_size, "norm_eps": args.norm_eps, "rope_theta": args.rope_theta}
    for multiple_of in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if meta_hidden_dim(args.dim, multiple_of, None) == args.hidden_dim:
            return {**params, "multiple_of": multiple_of, "ffn_dim_multiplier": None}
    return params  # no Meta rule gives this width: the loader takes it from the tensors


def export(native: Mapping[str, torch.Tensor], args: ModelArgs, model_type: str, to: str, target: str | os.PathLike,
           side_files: list[Path] = (), num_shards: int | None = None, max_shard_bytes: int | None = None,
           source: HFSource | None = None, input_files: int = 1, special_tokens: dict | None = None,
           check: Callable[[Path], Any] | None = None) -> Path:
    """Write ``native`` as a new ``to``-format checkpoint at ``target`` (committed atomically).

    ``source``: the HF checkpoint the weights came from (``hf_source.source_of``). HF output then has its
    config.json and, unless ``num_shards``/``max_shard_bytes`` ask otherwise, its files and key -> file map; Meta
    and native outputs keep it for converting back. Without one, config.json is derived (``hf_config``) and the
    output has ``num_shards`` (default: ``input_files``) files."""
    tensors_native = {k: v for k, v in native.items() if isinstance(v, torch.Tensor)}
    dtypes = {t.dtype for t in tensors_native.values() if t.is_floating_point()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
    resharded = bool(num_shards or max_shard_bytes)
    num_shards = num_shards or (None if max_shard_bytes else input_files)
    with StagedDir(target) as stage:
        if to == "hf":
            config = dict(source.config) if source else hf_config(args, model_type, dtype, special_tokens)
            converter = get_converter(detect_model_type(config) if source else model_type, config)
            if source and source.layout and source.layout.weight_map:
                converter.plan(list(source.layout.weight_map), "hf")  # the source's expert layout, if it has a choice
            tensors = converter.from_native(tensors_native)
            layout = None if resharded else _source_layout(source.layout if source else None, tensors)
            if layout is not None:
                _write_layout(stage, tensors, layout)
            else:
                _write_sharded(stage, tensors, plan_shards({k: _nbytes(t) for k, t in tensors.items()}, num_shards, max_shard_bytes),
                               {"format": "pt"})
            stage.write_bytes("config.json", (json.dumps(config, indent=2) + "\n").encode())
        elif to == "native":
            tensors = native_converter(args.tie_embeddings).from_native(tensors_native)
            aliases = {"output.weight": "tok_embeddings.weight"} if args.tie_embeddings else None
            _write_sharded(stage, tensors, plan_shards({k: _nbytes(t) for k, t in tensors.items()}, num_shards, max_shard_bytes),
                           {"format": "pt"}, aliases)
            stage.write_bytes(MODEL_FILE, (json.dumps(describe(args, model_type, source), indent=2) + "\n").encode())
        elif to == "meta":
            # model-parallel files are not shards: one unless asked (--num-shards)
            try:
                meta = meta_converter().from_native(tensors_native)
            except CheckpointError as e:  # a key Llama's reference layout has no place for
                raise CheckpointError(f"--to meta: Meta's reference layout holds Llama-architecture models; this "
                                      f"{model_type} model has more ({e}); convert it to hf or native") from e
            _write_meta(stage, meta, args, num_shards if resharded else 1)
            if source:
                stage.write_bytes(SOURCE_FILE, (json.dumps(source.to_json(), indent=2) + "\n").encode())
        else:
            raise CheckpointError(f"--to {to!r}: expected hf, meta or native")
        for path in side_files:
            if not (to == "meta" and Path(path).name == SOURCE_FILE):
                stage.copy_file(Path(path))
        if check is not None:  # read back before the commit: a mismatch leaves nothing committed
            check(stage.path)
    return Path(target)


def _write_meta(stage: StagedDir, meta: Mapping[str, torch.Tensor], args: ModelArgs, n: int) -> None:
    splits = {key: model_parallel_dim(key, vocab_parallel(args.vocab_size)) for key in meta}
    for key, t in meta.items():
        split = splits[key]
        if split is not None and t.shape[split] % n:
            raise CheckpointError(f"--num-shards {n}: {key} {tuple(t.shape)} does not split evenly into {n} model-parallel files")
    for index in tqdm(range(n), desc="write", unit="file", leave=False):
        shard = {}
        for key, t in meta.items():
            split = splits[key]
            shard[key] = t.chunk(n, dim=split)[index].clone() if split is not None and n > 1 else t.contiguous()
        stage.write(f"consolidated.{index:02d}.pth", lambda f: torch.save(shard, f))
    stage.write_bytes("params.json", (json.dumps(meta_params(args), indent=2) + "\n").encode())


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1500KB' / '123' -> bytes (decimal units, as transformers' max_shard_size)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if text.endswith(unit):
            return math.floor(float(text[: -len(unit)]) * factor)
    return int(text)
