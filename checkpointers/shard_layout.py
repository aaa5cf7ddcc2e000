"""Which keys live in which file: discovered from a checkpoint directory, reproduced on save, or planned anew.

An HF (or native) checkpoint is one weight file, or several shards listed by an index json
(``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``) whose ``weight_map`` sends each key to a
file. The layout remembers the file order, the key -> file map and the index's metadata, so the output can be
split exactly like the input (``read_files`` / ``write_files``: one file's tensors at a time, and the index);
``plan_layout`` cuts a conversion's output into files of about equal size.
"""

from __future__ import annotations

import json
import math
import os
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from waypoint import console
from waypoint.checkpointers.file_formats import (SAFETENSORS, TORCH, format_of, json_bytes, read_metadata, read_tensors,
                                                write_tensors)
from waypoint.errors import CheckpointError

INDEX_NAMES = {SAFETENSORS: "model.safetensors.index.json", TORCH: "pytorch_model.bin.index.json"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class ShardLayout:
    files: tuple[str, ...]  # file names, in order, relative to the checkpoint directory
    weight_map: dict[str, str] | None = None  # key -> file name; None until the files' keys are known
    index_name: str | None = None  # the index json's name, None for an unindexed checkpoint
    index_metadata: dict = field(default_factory=dict)

    @property
    def file_format(self) -> str:
        return format_of(self.files[0])

    def keys_in(self, name: str) -> list[str]:
        """The keys file ``name`` holds, in the map's order."""
        return [k for k, f in self.weight_map.items() if f == name]

    def with_keys(self, keys_by_file: dict[str, list[str]]) -> ShardLayout:
        """The layout with its weight map taken from what the files actually hold."""
        return replace(self, weight_map={k: f for f in self.files for k in keys_by_file[f]})

    def in_format(self, fmt: str) -> ShardLayout:
        """The same split under the file names of another format (``pytorch_model-*.bin`` <-> ``model-*.safetensors``)."""
        if fmt == self.file_format:
            return self
        names = {f: _rename(f, fmt) for f in self.files}
        return ShardLayout(
            files=tuple(names.values()),
            weight_map={k: names[f] for k, f in self.weight_map.items()} if self.weight_map else None,
            index_name=INDEX_NAMES[fmt] if self.index_name else None,
            index_metadata=dict(self.index_metadata),
        )


def _rename(name: str, fmt: str) -> str:
    stem = Path(name).name
    for suffix in WEIGHT_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    if fmt == SAFETENSORS:
        stem = stem.replace("pytorch_model", "model", 1) if stem.startswith("pytorch_model") else stem
        return stem + ".safetensors"
    stem = "pytorch_" + stem if stem.startswith("model") else stem
    return stem + ".bin"


def safe_member(directory: Path, name: str, source: str) -> str:
    """``name`` if it names a file inside ``directory``; an error naming ``source`` otherwise."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{source}: file name {name!r} escapes the checkpoint directory")
    target, inside = (directory / name).resolve(), [directory.resolve()]
    # A hub cache snapshot (.../snapshots/<sha>/) holds symlinks into the repository's ../../blobs/.
    inside += [p.parent / "blobs" for p in directory.absolute().parents if p.name == "snapshots"]
    if not any(target.is_relative_to(d.resolve()) for d in inside):
        raise CheckpointError(f"{source}: file name {name!r} escapes the checkpoint directory")
    return name


FORMATTED_KEYS = ("filename_format", "max_filename")


def formatted_files(spec: Mapping, source: str = "checkpointer.checkpoint_files") -> list[str]:
    """torchtune's ``checkpoint_files: {filename_format: model-{}-of-{}.safetensors, max_filename: "00004"}``, expanded
    as torchtune expands it: the format filled with (i, max_filename) for i = 1 .. max_filename, each i zero-padded
    to max_filename's width. ``max_filename`` must be a string: YAML reads an unquoted 00004 as the number 4 and
    loses the padding the file names have."""
    missing = [k for k in FORMATTED_KEYS if k not in spec]
    unknown = sorted(str(k) for k in spec if k not in FORMATTED_KEYS)
    if missing or unknown:
        raise CheckpointError(f"{source}: a section of file names needs exactly filename_format and max_filename "
                              f"(e.g. {{filename_format: model-{{}}-of-{{}}.safetensors, max_filename: \"00004\"}}); "
                              + (f"it lacks {missing[0]}" if missing else f"it has {unknown[0]}")
                              + "; or list the file names")
    fmt, last = spec["filename_format"], spec["max_filename"]
    if not isinstance(last, str) or not last.isdigit() or int(last) < 1:
        raise CheckpointError(f"{source}.max_filename={last!r}: expected the last file's number as a quoted string, "
                              "such as \"00004\" (its zero padding is the file names')")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(fmt) if f is not None] if isinstance(fmt, str) else []
    except ValueError:
        fields = []
    if len(fields) != 2 or any(f not in ("", "0", "1") for f in fields):
        raise CheckpointError(f"{source}.filename_format={fmt!r}: expected a file name with exactly two {{}} "
                              "placeholders, the file's number and the last one, such as model-{}-of-{}.safetensors")
    return [fmt.format(str(i).zfill(len(last)), last) for i in range(1, int(last) + 1)]


def listed_files(directory: Path, checkpoint_files, source: str = "checkpointer.checkpoint_files") -> list[str]:
    """The weight file names a config lists: a name or a list of names relative to ``directory``, absolute paths
    inside it (made relative: torchtune's tests and some of its configs list them so), or torchtune's
    ``{filename_format, max_filename}`` section (``formatted_files``); each must exist."""
    if isinstance(checkpoint_files, Mapping):
        checkpoint_files = formatted_files(checkpoint_files, source)
    elif isinstance(checkpoint_files, (str, os.PathLike)):
        checkpoint_files = [checkpoint_files]
    names = [safe_member(directory, str(_relative_to(directory, n)), source) for n in checkpoint_files]
    if not names:
        raise CheckpointError(f"{source} is empty")
    for name in names:
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory / name}: weight file not found (listed in {source})")
    return names


def _relative_to(directory: Path, name) -> str:
    """``name`` relative to ``directory`` when it is an absolute path inside it (as written, or once links are
    resolved); anything else as it is (``safe_member`` refuses an absolute path outside)."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not Path(name).is_absolute():
        return name
    path = Path(os.path.normpath(name))
    for base, target in ((Path(os.path.normpath(directory.absolute())), path), (directory.resolve(), path.resolve())):
        if target.is_relative_to(base) and target != base:
            return target.relative_to(base).as_posix()
    return name


def _from_index(directory: Path, index_path: Path) -> ShardLayout:
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: not a valid index json ({e.__class__.__name__}: {e})") from e
    files: dict[str, None] = {}
    for key, name in weight_map.items():
        files[safe_member(directory, name, str(index_path))] = None
    for name in files:
        if not (directory / name).is_file():
            raise CheckpointError(f"{index_path}: names {name!r}, which is not in {directory}")
    return ShardLayout(tuple(files), dict(weight_map), index_path.name, dict(index.get("metadata") or {}))


def discover(directory: str | Path, checkpoint_files: list[str] | str | None = "auto") -> ShardLayout:
    """The layout of an HF checkpoint directory.

    ``checkpoint_files='auto'`` reads the index json (safetensors preferred when the
    directory holds both formats, as many hub repos do), else globs the weight files.
    An explicit list (or torchtune's ``{filename_format, max_filename}``: ``listed_files``) names the files; the
    index is used when it covers exactly them.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    if checkpoint_files in (None, "auto"):
        for fmt in (SAFETENSORS, TORCH):
            index = directory / INDEX_NAMES[fmt]
            if index.is_file():
                return _from_index(directory, index)
        for pattern in ("model*.safetensors", "*.safetensors", "pytorch_model*.bin", "*.bin", "model*.pt"):
            found = sorted(p.name for p in directory.glob(pattern) if p.is_file())
            if found:
                return ShardLayout(tuple(found))
        raise CheckpointError(f"{directory}: no weight files (*.safetensors or pytorch_model*.bin) and no index json")
    names = listed_files(directory, checkpoint_files)
    index = directory / INDEX_NAMES[format_of(names[0])]
    if index.is_file():
        layout = _from_index(directory, index)
        if set(layout.files) == set(names):
            return layout
    return ShardLayout(tuple(names))


# -- reading and writing the files of a layout -----------------------------------------------------------------------
@dataclass
class ReadFiles:
    tensors: dict[str, torch.Tensor]  # every key of every file, memory-mapped
    where: dict[str, str]  # key -> the file holding it
    metadata: dict[str, dict | None]  # file -> its safetensors header metadata (None for pickles)


def read_files(directory: Path, layout: ShardLayout, unmapped: list[str] | None = None,
               packed: Callable[[str], bool] | None = None) -> ReadFiles:
    """Every tensor of the layout's files; a key in two files, or missing from the file the index puts it in, is a
    one-line error naming the file."""
    read = ReadFiles({}, {}, {})
    with console.byte_bar(sum((directory / f).stat().st_size for f in layout.files), "load", leave=False) as bar:
        for name in layout.files:
            path = directory / name
            tensors = read_tensors(path, unmapped, packed)
            read.metadata[name] = read_metadata(path)
            if layout.weight_map is not None:
                absent = sorted({k for k, f in layout.weight_map.items() if f == name} - tensors.keys())
                if absent:
                    raise CheckpointError(f"{path}: lacks {absent[0]!r}{f' and {len(absent) - 1} more keys' if len(absent) > 1 else ''}"
                                          f" that {layout.index_name} puts there")
            for key, t in tensors.items():
                if key in read.tensors:
                    raise CheckpointError(f"{path}: key {key!r} also appears in {read.where[key]}")
                read.tensors[key], read.where[key] = t, name
            bar.update(path.stat().st_size)
    return read


def write_files(stage, layout: ShardLayout, tensors_of: Callable[[str], Mapping[str, torch.Tensor]],
                metadata_of: Callable[[str, Mapping[str, torch.Tensor]], Mapping[str, str] | None],
                total_bytes: int | None = None, is_parameter: Callable[[str], bool] | None = None) -> set[torch.dtype]:
    """Write the layout's files in order, file ``name`` holding ``tensors_of(name)`` (produced, and dropped, one file at
    a time) with ``metadata_of(name, tensors)`` in its safetensors header, then the index json when the layout has one
    (its metadata's ``total_size`` and ``total_parameters`` made true: ``is_parameter(key)`` says which keys count); the
    dtypes written."""
    dtypes: set[torch.dtype] = set()
    weight_map, total_size, total_params = {}, 0, 0
    with console.byte_bar(total_bytes, "save", leave=False) as bar:
        for name in layout.files:
            tensors = tensors_of(name)
            metadata = metadata_of(name, tensors) if layout.file_format == SAFETENSORS else None
            stage.write(name, lambda f, tensors=tensors: write_tensors(f, tensors, layout.file_format, metadata))
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            total_params += sum(t.numel() for k, t in tensors.items() if is_parameter is None or is_parameter(k))
            total_size += size
            dtypes.update(t.dtype for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, name))
            bar.update(size)
            del tensors  # before the next file's tensors are made: one file's worth at a time
    if layout.index_name:
        metadata = dict(layout.index_metadata, total_size=total_size)
        if "total_parameters" in metadata:
            metadata["total_parameters"] = total_params
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        stage.write_bytes(layout.index_name, json_bytes(index))
    return dtypes


def plan_files(converter, native: Mapping[str, torch.Tensor], layout: ShardLayout) -> dict[str, list]:
    """Output file -> the groups of ``converter`` (a ``waypoint.converters.Converter``) that produce its keys from
    ``native``; every key placed exactly where ``layout`` (the input's) has it."""
    groups = converter.plan(converter.native_keys_to_save(native), "native")
    plan: dict[str, list] = {name: [] for name in layout.files}
    produced = set()
    for g in groups:
        for key in g.targets:
            if key not in layout.weight_map:
                raise CheckpointError(f"native key(s) {', '.join(g.sources)} become {key!r}, which the input checkpoint does not have")
            if not plan[layout.weight_map[key]] or plan[layout.weight_map[key]][-1] is not g:
                plan[layout.weight_map[key]].append(g)
        produced.update(g.targets)
    missing = sorted(set(layout.weight_map) - produced)
    if missing:
        raise CheckpointError(f"state dict lacks {missing[0]!r}" + (f" and {len(missing) - 1} more keys" if len(missing) > 1 else "")
                              + " that the input checkpoint has")
    return plan


def plan_layout(sizes: Mapping[str, int], num_shards: int | None = None, max_shard_bytes: int | None = None) -> ShardLayout:
    """A new safetensors layout for keys of these sizes (in order): ``num_shards`` files of about equal bytes, or files
    of at most ``max_shard_bytes`` (a tensor larger than that gets a file of its own); named as transformers names
    them (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with an index)."""
    shards = _cut(sizes, num_shards, max_shard_bytes)
    if len(shards) == 1:
        return ShardLayout(("model.safetensors",), dict.fromkeys(shards[0], "model.safetensors"))
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    return ShardLayout(tuple(names), {k: name for name, keys in zip(names, shards) for k in keys}, INDEX_NAMES[SAFETENSORS])


def _cut(sizes: Mapping[str, int], num_shards: int | None, max_shard_bytes: int | None) -> list[list[str]]:
    keys = list(sizes)
    shards, current, size = [], [], 0
    if max_shard_bytes:
        for key in keys:
            if current and size + sizes[key] > max_shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append(key)
            size += sizes[key]
        return shards + ([current] if current else [])
    n = max(1, min(num_shards or 1, len(keys)))
    total = sum(sizes.values())
    for key in keys:
        current.append(key)
        size += sizes[key]
        if len(shards) < n - 1 and size >= total * (len(shards) + 1) / n:
            shards.append(current)
            current = []
    return shards + ([current] if current else [])


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1500KB' / '123' -> bytes (decimal units, as transformers' max_shard_size)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if text.endswith(unit):
            return math.floor(float(text[: -len(unit)]) * factor)
    return int(text)
