"""NativeCheckpointer: this project's own format, native keys with no conversion.

A native checkpoint directory holds ``waypoint_model.json`` (the ModelArgs), the
weights under native keys in safetensors (one ``model.safetensors`` or shards with
``model.safetensors.index.json``; ``.pt``/``.bin`` files are read too), and the
tokenizer files. A tied output projection is stored once: the file holding
``tok_embeddings.weight`` records ``output.weight`` as its alias in the safetensors
metadata, and loading re-ties the two (safetensors refuses tensors that share memory).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from waypoint.checkpointers.base import Checkpointer
from waypoint.checkpointers.commit import StagedDir
from waypoint.checkpointers.file_formats import write_tensors
from waypoint.checkpointers.hf_checkpointer import HFCheckpointer
from waypoint.checkpointers.shard_layout import INDEX_NAMES
from waypoint.converters import CheckpointError, Converter, Rule
from waypoint.families import MODEL_TYPES, family_named
from waypoint.models import ModelArgs

MODEL_FILE = "waypoint_model.json"
FORMAT_NAME, FORMAT_VERSION = "waypoint-native", 1
ALIASES_KEY = "waypoint_aliases"


def native_converter(tied: bool) -> Converter:
    """Keys as they are; the tied head is written once, as the embedding."""
    return Converter([Rule("{key}", "{key}")], tied_embeddings=tied)


def model_args_of(config: Mapping) -> ModelArgs:
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(config.get("model_args", {})) - fields)  # written by a newer version
    if config.get("format") != FORMAT_NAME or unknown:
        raise CheckpointError(f"{MODEL_FILE}: not a {FORMAT_NAME} model description"
                              + (f" (unknown fields {', '.join(unknown)})" if unknown else ""))
    return ModelArgs(**config["model_args"])


def describe(args: ModelArgs, model_type: str | None = None, source=None) -> dict:
    """waypoint_model.json: the ModelArgs, and the family and HF checkpoint it came from (``hf_source.HFSource``:
    its config.json and shard layout, for converting back)."""
    description = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "model_args": dataclasses.asdict(args)}
    kept = source.to_json() if source is not None else {}
    return (description | ({"model_type": model_type} if model_type else {})
            | ({"hf_config": kept["config"]} if "config" in kept else {}) | ({"hf_layout": kept["layout"]} if "layout" in kept else {}))


class NativeCheckpointer(HFCheckpointer):
    """Load and save native checkpoints (same constructor and methods as HFCheckpointer, no model_type)."""

    own_files = frozenset({MODEL_FILE, *INDEX_NAMES.values()})
    format_label = "native"
    loads_with = Checkpointer.loads_with
    config_file = MODEL_FILE
    base_model_prefix = ""  # native keys have no backbone prefix

    def __init__(self, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                 checkpoint_files: list[str] | str = "auto", safe_serialization: bool | None = None,
                 output_dtype: str | torch.dtype | None = None) -> None:
        super().__init__(checkpoint_dir, output_dir, checkpoint_files=checkpoint_files, safe_serialization=safe_serialization,
                         output_dtype=output_dtype)

    def _make_converter(self, model_type: str | None) -> Converter:
        self.model_args = model_args_of(self.config)
        self.model_type = self.config.get("model_type", "NATIVE")
        # the family it was converted from (a native checkpoint written without one: Llama's names for PEFT)
        self.family = family_named(self.model_type if self.model_type in MODEL_TYPES else "llama")
        return native_converter(self.model_args.tie_embeddings)

    def _metadata_for(self, source_file: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
        metadata = dict(super()._metadata_for(source_file, tensors))
        if self.model_args.tie_embeddings and "tok_embeddings.weight" in tensors:
            metadata[ALIASES_KEY] = json.dumps({"output.weight": "tok_embeddings.weight"})
        return metadata

    def _write_config(self, written, stage: StagedDir) -> None:
        stage.write_bytes(MODEL_FILE, (json.dumps(self.config, indent=2) + "\n").encode())


def write_native_checkpoint(directory: str | os.PathLike, model_state: Mapping[str, torch.Tensor], args: ModelArgs,
                            side_files: list[Path] = ()) -> Path:
    """A new single-file native checkpoint at ``directory`` (committed atomically; refuses an existing path)."""
    converter = native_converter(args.tie_embeddings)
    tensors = converter.from_native({k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)})
    metadata = {"format": "pt"}
    if args.tie_embeddings:
        metadata[ALIASES_KEY] = json.dumps({"output.weight": "tok_embeddings.weight"})
    with StagedDir(directory) as stage:
        stage.write("model.safetensors", lambda f: write_tensors(f, tensors, "safetensors", metadata))
        stage.write_bytes(MODEL_FILE, (json.dumps(describe(args), indent=2) + "\n").encode())
        for path in side_files:
            stage.copy_file(Path(path))
    return Path(directory)
