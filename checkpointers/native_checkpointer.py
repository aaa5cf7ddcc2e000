"""NativeCheckpointer: this project's own format, native keys with no conversion.

A native checkpoint directory holds ``waypoint_model.json`` (the ModelArgs, and the family and HF checkpoint it
was converted from), the weights under native keys in safetensors (one ``model.safetensors`` or shards with
``model.safetensors.index.json``; ``.pt``/``.bin`` files are read too), and the tokenizer files. A tied output
projection is stored once: the file holding ``tok_embeddings.weight`` records ``output.weight`` as its alias in
the safetensors metadata, and loading re-ties the two (safetensors refuses tensors that share memory). A conversion
of a block-FP8 HF checkpoint keeps its ``weight_scale_inv`` tensors in ``hf_source_scales.safetensors`` (not model
weights: converting back to HF writes the untouched weights' very bytes from them), which every save carries.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import torch

from waypoint.checkpointers.base import Checkpointer, Conversion
from waypoint.checkpointers.commit import StagedDir
from waypoint.checkpointers.file_formats import SAFETENSORS, TORCH, json_bytes, read_json
from waypoint.checkpointers.hf_source import SIDE_FILES, HFSource
from waypoint.checkpointers.shard_layout import ShardLayout, discover, plan_files, plan_layout, read_files, write_files
from waypoint.converters import CheckpointError, Converter, Rule
from waypoint.families import MODEL_TYPES, family_named
from waypoint.lazy import nbytes
from waypoint.models import ModelArgs
from waypoint.models.vision_args import vision_args

MODEL_FILE = "waypoint_model.json"
FORMAT_NAME, FORMAT_VERSION = "waypoint-native", 1
ALIASES_KEY = "waypoint_aliases"
TIED = {"output.weight": "tok_embeddings.weight"}  # the tied head, stored once as the embedding


def native_converter(tied: bool) -> Converter:
    """Keys as they are; the tied head is written once, as the embedding."""
    return Converter([Rule("{key}", "{key}")], tied_embeddings=tied)


def model_args_of(config: Mapping) -> ModelArgs:
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(config.get("model_args", {})) - fields)  # written by a newer version
    if config.get("format") != FORMAT_NAME or unknown:
        raise CheckpointError(f"{MODEL_FILE}: not a {FORMAT_NAME} model description"
                              + (f" (unknown fields {', '.join(unknown)})" if unknown else ""))
    fields = dict(config["model_args"])
    if isinstance(fields.get("vision"), dict):  # a vision-language model's image side, rebuilt by its tower
        fields["vision"] = vision_args(fields["vision"])
    return ModelArgs(**fields)


def describe(args: ModelArgs, model_type: str | None = None, source: HFSource | None = None) -> dict:
    """waypoint_model.json: the ModelArgs, and the family and HF checkpoint it came from (its config.json and shard
    layout, for converting back)."""
    description = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "model_args": dataclasses.asdict(args)}
    kept = source.to_json() if source is not None else {}
    return (description | ({"model_type": model_type} if model_type else {})
            | ({"hf_config": kept["config"]} if "config" in kept else {}) | ({"hf_layout": kept["layout"]} if "layout" in kept else {})
            | ({"hf_prefixes": kept["prefixes"]} if "prefixes" in kept else {}))


def file_metadata(tied: bool, keys, metadata: Mapping[str, str] | None = None) -> dict[str, str]:
    """A weight file's safetensors header metadata: ``metadata`` (HF writes {"format": "pt"}), and in the file holding
    the embedding of a tied model, where the head is."""
    out = dict(metadata or {"format": "pt"})
    if tied and any(target in keys for target in TIED.values()):
        out[ALIASES_KEY] = json.dumps(TIED)
    return out


class NativeCheckpointer(Checkpointer):
    """Load and save native checkpoints (``checkpoint_files``, ``safe_serialization``, ``output_dtype`` and torchtune's
    resume options as for ``HFCheckpointer``; ``model_type``, which a torchtune section gives, is checked against
    the family the checkpoint records)."""

    name, label = "native", "native"
    description_files = frozenset({MODEL_FILE})

    def __init__(self, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                 checkpoint_files: list[str] | str = "auto", safe_serialization: bool | None = None,
                 output_dtype: str | torch.dtype | None = None, model_type: str | None = None, *,
                 recipe_checkpoint: str | None = None, adapter_checkpoint: str | None = None,
                 resume_from_checkpoint: bool = False, should_load_recipe_state: bool = False) -> None:
        super().__init__(checkpoint_dir, output_dir, output_dtype, recipe_checkpoint=recipe_checkpoint,
                         adapter_checkpoint=adapter_checkpoint, resume_from_checkpoint=resume_from_checkpoint,
                         should_load_recipe_state=should_load_recipe_state)
        if not (self.checkpoint_dir / MODEL_FILE).is_file() and any(self.checkpoint_dir.glob("*.pt")):
            raise CheckpointError(f"{self.checkpoint_dir}: no {MODEL_FILE}, so not a Waypoint native checkpoint (a "
                                  "torchtune-format one, FullModelTorchTuneCheckpointer's, is not read); start from the "
                                  "HF or Meta checkpoint it was trained from (checkpointer=hf or checkpointer=meta)")
        self.config = read_json(self.checkpoint_dir / MODEL_FILE)
        self.args = model_args_of(self.config)
        self.model_type = self.config.get("model_type", "NATIVE")
        if model_type is not None and self.model_type in MODEL_TYPES \
                and family_named(model_type) != family_named(self.model_type):
            raise CheckpointError(f"checkpointer.model_type={model_type}: {self.checkpoint_dir / MODEL_FILE} records a "
                                  f"{self.model_type} model; set model_type: null (a native checkpoint says its own)")
        # the family it was converted from (a native checkpoint written without one: Llama's names for PEFT)
        self.family = family_named(self.model_type if self.model_type in MODEL_TYPES else "llama")
        self.converter = native_converter(self.args.tie_embeddings)
        self.layout: ShardLayout = discover(self.checkpoint_dir, checkpoint_files)
        self.safe_serialization = safe_serialization
        self._file_metadata: dict[str, dict | None] = {}

    def model_args(self) -> ModelArgs:
        return self.args

    def hf_source(self) -> HFSource | None:
        if "hf_config" not in self.config:
            return None
        source = HFSource.from_json({"config": self.config["hf_config"], "layout": self.config.get("hf_layout"),
                                     "prefixes": self.config.get("hf_prefixes")})
        return source.with_tensors_from(self.checkpoint_dir)

    # -- load ---------------------------------------------------------------------
    def _load_model(self) -> dict[str, torch.Tensor]:
        read = read_files(self.checkpoint_dir, self.layout, self.unmapped)
        self._file_metadata = read.metadata
        self.layout = self.layout.with_keys({f: [k for k in read.tensors if read.where[k] == f] for f in self.layout.files})
        self.input_dtypes = {k: t.dtype for k, t in read.tensors.items()}
        return self.converter.to_native(read.tensors, read.where)

    # -- save like the input ------------------------------------------------------------
    def _model_writer(self, native: Mapping[str, torch.Tensor], adapted: frozenset[str] = frozenset()):  # nothing quantized
        if self.layout.weight_map is None:
            raise CheckpointError("save_checkpoint needs load_checkpoint first: the input's key -> file map is unknown")
        layout = self.layout.in_format({None: self.layout.file_format, True: SAFETENSORS, False: TORCH}[self.safe_serialization])
        plan = plan_files(self.converter, native, layout)
        source_of = dict(zip(layout.files, self.layout.files))

        def tensors_of(name: str) -> dict[str, torch.Tensor]:
            converted = self.converter.apply_groups(plan[name], native, forward=False, where=None)
            return {k: self.cast_for_output(k, converted[k]) for k in layout.keys_in(name)}

        def write(stage: StagedDir) -> None:
            write_files(stage, layout, tensors_of,
                        lambda name, tensors: file_metadata(self.args.tie_embeddings, tensors, self._file_metadata.get(source_of[name])),
                        total_bytes=sum(nbytes(native, k) for k in native))
            stage.write_bytes(MODEL_FILE, json_bytes(self.config))
            for side in SIDE_FILES:  # a block-FP8 source's scales, a multimodal one's vision tower, travel with it
                if (self.checkpoint_dir / side).is_file():
                    stage.copy_file(self.checkpoint_dir / side)
        return write

    # -- a new native checkpoint ----------------------------------------------------------
    @classmethod
    def write_new(cls, stage: StagedDir, native: Mapping[str, torch.Tensor], conversion: Conversion) -> None:
        args = conversion.args
        tensors = native_converter(args.tie_embeddings).from_native(native)
        sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
        layout = plan_layout(sizes, conversion.files, conversion.max_shard_bytes)
        write_files(stage, layout, lambda name: {k: tensors[k] for k in layout.keys_in(name)},
                    lambda name, written: file_metadata(args.tie_embeddings, written), total_bytes=sum(sizes.values()))
        stage.write_bytes(MODEL_FILE, json_bytes(describe(args, conversion.model_type, conversion.source)))
        if conversion.source is not None:
            conversion.source.write_tensors(stage)
