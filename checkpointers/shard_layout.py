"""Which keys live in which file: discovered from a checkpoint directory, reproduced on save.

An HF checkpoint is one weight file, or several shards listed by an index json
(``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``) whose
``weight_map`` sends each key to a file. The layout remembers the file order,
the key -> file map and the index's metadata, so the output can be split
exactly like the input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from waypoint.checkpointers.file_formats import SAFETENSORS, TORCH, format_of
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
    An explicit list names the files; the index is used when it covers exactly them.
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
    if isinstance(checkpoint_files, str):
        checkpoint_files = [checkpoint_files]
    names = [safe_member(directory, str(n), "checkpointer.checkpoint_files") for n in checkpoint_files]
    if not names:
        raise CheckpointError("checkpointer.checkpoint_files is empty")
    for name in names:
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory / name}: weight file not found (listed in checkpointer.checkpoint_files)")
    index = directory / INDEX_NAMES[format_of(names[0])]
    if index.is_file():
        layout = _from_index(directory, index)
        if set(layout.files) == set(names):
            return layout
    return ShardLayout(tuple(names))
