"""Where a converted checkpoint came from, kept so that converting it back to HF reproduces the original.

An HF checkpoint converted to Meta or native format loses its ``config.json`` (generation ids, positions, rope
parameters, ...) and its shard layout (file names, the key -> file map transformers chose, the index's
metadata). ``HFSource`` keeps both: inside ``waypoint_model.json`` for native checkpoints, as ``hf_source.json``
beside ``params.json`` for Meta ones. Converting back writes that config and that layout again. Each format
answers ``hf_source()`` for its input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from waypoint.checkpointers.shard_layout import ShardLayout

SOURCE_FILE = "hf_source.json"
SCALES_FILE = "hf_source_scales.safetensors"  # a block-FP8 input's scales (HFSource.scales)
PASSTHROUGH_FILE = "hf_source_passthrough.safetensors"  # tensors outside the converted model (HFSource.passthrough)
SIDE_FILES = (SCALES_FILE, PASSTHROUGH_FILE)  # what travels beside a converted checkpoint, when there


def converter_key(prefixes: Mapping[str, str], disk_key: str) -> str:
    """An on-disk key as the converter names it (``prefixes``: {prefix on disk: the converter's}); others unchanged."""
    for disk, ours in prefixes.items():
        if disk_key.startswith(disk):
            return ours + disk_key[len(disk):]
    return disk_key


def disk_key(prefixes: Mapping[str, str], key: str) -> str:
    """A converter key as the checkpoint stores it (the inverse of ``converter_key``)."""
    for disk, ours in prefixes.items():
        if key.startswith(ours):
            return disk + key[len(ours):]
    return key


@dataclass(frozen=True)
class HFSource:
    config: Mapping[str, Any]  # the config.json as it was
    layout: ShardLayout | None = None  # its files and key -> file map (keys as on disk)
    # a block-FP8 input's weight_scale_inv tensors (keys as on disk), kept in SCALES_FILE beside the converted
    # checkpoint: from the dequantized weights and these, converting back writes untouched weights' very bytes
    scales: Mapping[str, torch.Tensor] | None = None
    # the tensors of the input outside the model converted (a multimodal repo's vision tower, MTP layers), keys as on
    # disk, kept in PASSTHROUGH_FILE: converting back writes them where they were
    passthrough: Mapping[str, torch.Tensor] | None = None
    prefixes: Mapping[str, str] | None = None  # how the input nested the converter's keys ({prefix on disk: ours})

    def write_tensors(self, stage) -> None:
        """SCALES_FILE and PASSTHROUGH_FILE into a staged checkpoint directory (``commit.StagedDir``), where there
        are such tensors."""
        from waypoint.checkpointers.file_formats import write_safetensors

        for name, tensors in ((SCALES_FILE, self.scales), (PASSTHROUGH_FILE, self.passthrough)):
            if tensors:
                stage.write(name, lambda f, t=tensors: write_safetensors(f, dict(t), {"format": "pt"}))

    def with_tensors_from(self, directory: Path) -> HFSource:
        """This source with the scales and passthrough tensors kept in ``directory`` (memory-mapped), where it has them."""
        from dataclasses import replace

        from waypoint.checkpointers.file_formats import read_tensors

        found = {field: read_tensors(Path(directory) / name) for field, name in (("scales", SCALES_FILE), ("passthrough", PASSTHROUGH_FILE))
                 if (Path(directory) / name).is_file()}
        return replace(self, **found) if found else self

    def converter_key(self, key: str) -> str:
        return converter_key(self.prefixes or {}, key)

    def disk_key(self, key: str) -> str:
        return disk_key(self.prefixes or {}, key)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": dict(self.config)}
        if self.layout is not None and self.layout.weight_map is not None:
            out["layout"] = {"files": list(self.layout.files), "weight_map": dict(self.layout.weight_map),
                             "index_name": self.layout.index_name, "index_metadata": dict(self.layout.index_metadata)}
        if self.prefixes:
            out["prefixes"] = dict(self.prefixes)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> HFSource | None:
        if not data or "config" not in data:
            return None
        layout = data.get("layout")
        return cls(dict(data["config"]), ShardLayout(tuple(layout["files"]), dict(layout["weight_map"]), layout.get("index_name"),
                                                     dict(layout.get("index_metadata") or {})) if layout else None,
                   prefixes=dict(data["prefixes"]) if data.get("prefixes") else None)

    @classmethod
    def read(cls, directory: Path) -> HFSource | None:
        """The source kept beside a Meta checkpoint, if any."""
        path = Path(directory) / SOURCE_FILE
        return cls.from_json(json.loads(path.read_text())) if path.is_file() else None
