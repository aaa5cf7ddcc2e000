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


@dataclass(frozen=True)
class HFSource:
    config: Mapping[str, Any]  # the config.json as it was
    layout: ShardLayout | None = None  # its files and key -> file map (keys as on disk)
    # a block-FP8 input's weight_scale_inv tensors (keys as on disk), kept in SCALES_FILE beside the converted
    # checkpoint: from the dequantized weights and these, converting back writes untouched weights' very bytes
    scales: Mapping[str, torch.Tensor] | None = None

    def write_scales(self, stage) -> None:
        """SCALES_FILE into a staged checkpoint directory (``commit.StagedDir``), if there are scales."""
        if self.scales:
            from waypoint.checkpointers.file_formats import write_safetensors

            stage.write(SCALES_FILE, lambda f: write_safetensors(f, dict(self.scales), {"format": "pt"}))

    def with_scales_from(self, directory: Path) -> HFSource:
        """This source with the scales kept in ``directory``'s SCALES_FILE (memory-mapped), if it has one."""
        path = Path(directory) / SCALES_FILE
        if not path.is_file():
            return self
        from dataclasses import replace

        from waypoint.checkpointers.file_formats import read_tensors

        return replace(self, scales=read_tensors(path))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": dict(self.config)}
        if self.layout is not None and self.layout.weight_map is not None:
            out["layout"] = {"files": list(self.layout.files), "weight_map": dict(self.layout.weight_map),
                             "index_name": self.layout.index_name, "index_metadata": dict(self.layout.index_metadata)}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> HFSource | None:
        if not data or "config" not in data:
            return None
        layout = data.get("layout")
        return cls(dict(data["config"]), ShardLayout(tuple(layout["files"]), dict(layout["weight_map"]), layout.get("index_name"),
                                                     dict(layout.get("index_metadata") or {})) if layout else None)

    @classmethod
    def read(cls, directory: Path) -> HFSource | None:
        """The source kept beside a Meta checkpoint, if any."""
        path = Path(directory) / SOURCE_FILE
        return cls.from_json(json.loads(path.read_text())) if path.is_file() else None
