"""The formats, found by name or by the files in a directory, and conversion between them.

    checkpointer_for(path)                    # the checkpointer of whatever format `path` holds
    convert(checkpointer, state, "meta", target, conversion_of(checkpointer, "meta"))  # as another format (or re-sharded)

A new format is one file with a ``Checkpointer`` subclass, added to ``FORMATS``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from waypoint.checkpointers.base import Checkpointer, Conversion, write_directory
from waypoint.checkpointers.commit import StagedDir
from waypoint.checkpointers.hf_checkpointer import HFCheckpointer
from waypoint.checkpointers.meta_checkpointer import MetaCheckpointer
from waypoint.checkpointers.native_checkpointer import NativeCheckpointer
from waypoint.errors import CheckpointError

FORMATS: dict[str, type[Checkpointer]] = {cls.name: cls for cls in (NativeCheckpointer, HFCheckpointer, MetaCheckpointer)}
DESCRIPTION_FILES = frozenset().union(*(cls.description_files for cls in FORMATS.values()))


def detect_format(path: str | os.PathLike) -> str:
    """'hf', 'meta' or 'native', from the files in a checkpoint directory."""
    path = Path(path)
    for name, cls in FORMATS.items():  # native first: it may keep an HF config beside its own
        if cls.recognises(path):
            return name
    raise CheckpointError(f"{path}: not a recognised checkpoint directory (no config.json, params.json + "
                          f"consolidated.*.pth, or {next(iter(NativeCheckpointer.description_files))})")


def checkpointer_for(path: str | os.PathLike, output_dir: str | os.PathLike | None = None, **kwargs) -> Checkpointer:
    """The checkpointer that reads ``path``'s format (writing to ``output_dir``, default ``path``)."""
    return FORMATS[detect_format(path)](path, output_dir=output_dir if output_dir is not None else path, **kwargs)


def write_checkpoint(native: Mapping[str, Any], conversion: Conversion, to: str, target: str | os.PathLike,
                     side_files: list[Path] = (), check: Callable[[Path], Any] | None = None) -> Path:
    """``native`` as a new ``to``-format checkpoint at ``target``, with ``side_files`` (the tokenizer) beside it,
    checked by ``check(staged path)`` and committed atomically."""
    if to not in FORMATS:
        raise CheckpointError(f"--to {to!r}: expected {', '.join(sorted(FORMATS))}")
    tensors = {k: v for k, v in native.items() if isinstance(v, torch.Tensor)}

    def write(stage: StagedDir) -> None:
        FORMATS[to].write_new(stage, tensors, conversion)
        for path in side_files:
            stage.copy_file(Path(path))
    return write_directory(target, write, check)


def conversion_of(checkpointer: Checkpointer, to: str, model_type: str | None = None, num_shards: int | None = None,
                  max_shard_bytes: int | None = None, special_tokens: Mapping[str, int] | None = None) -> Conversion | None:
    """What ``convert`` writes a new ``to``-format checkpoint of ``checkpointer``'s input from; None where it writes
    the input's very files, keys and split (``to`` its format, no other sharding asked for)."""
    if to == checkpointer.name and not (num_shards or max_shard_bytes):
        return None
    return Conversion(checkpointer.model_args(), model_type or checkpointer.model_type, checkpointer.hf_source(),
                      dict(special_tokens or {}), len(checkpointer.files), num_shards, max_shard_bytes)


def written_as(to: str, conversion: Conversion | None) -> Callable[[torch.nn.Module], Any] | None:
    """For ``convert``'s export check (``ExportCheck(model, written=...)``): a context within which a model holds what
    the output's files will load as, where they round it (back to a block-FP8 source: the weights that changed since,
    re-quantized); None where they hold the model as it is (the input's own files hold what it loaded)."""
    return None if conversion is None or to not in FORMATS else FORMATS[to].new_as_written(conversion)


def convert(checkpointer: Checkpointer, state: Mapping[str, Any], to: str, target: str | os.PathLike,
            conversion: Conversion | None | str = "derived", check: Callable[[Path], Any] | None = None) -> Path:
    """The loaded ``state`` of ``checkpointer``'s input written at ``target`` in the format ``to``: with no
    ``conversion`` (``conversion_of``) its very files, keys and split; otherwise a new checkpoint that remembers the
    HF checkpoint it came from (so that converting back reproduces it). Left out: ``conversion_of(checkpointer, to)``,
    the plain conversion to ``to``."""
    if conversion == "derived":
        conversion = conversion_of(checkpointer, to)
    if conversion is None:
        return checkpointer.save_to(state, target, check=check)
    return write_checkpoint(state["model"], conversion, to, target, checkpointer.side_files(skip=DESCRIPTION_FILES), check)
