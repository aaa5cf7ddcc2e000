"""HFCheckpointer: reads a Hugging Face checkpoint directory and writes one just like it.

A thin composition of three parts: the file format (``file_formats``), the
input's shard layout (``shard_layout``) and the family's converter
(``converters``). What comes in as ``model-0000X-of-0000N.safetensors`` with an
index goes out under the same names, with the same keys in each file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
from tqdm import tqdm

from waypoint.checkpointers.base import Checkpointer, read_json
from waypoint.checkpointers.commit import StagedDir
from waypoint.lazy import nbytes
from waypoint.checkpointers.file_formats import SAFETENSORS, TORCH, read_metadata, read_tensors, write_tensors
from waypoint.checkpointers.shard_layout import INDEX_NAMES, ShardLayout, discover
from waypoint.converters import CheckpointError, Converter
from waypoint.families import detect_model_type, family_named, get_converter


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HFCheckpointer(Checkpointer):
    """Load and save checkpoints in the Hugging Face format.

    Args:
        checkpoint_dir: the input directory (config.json, weight files, tokenizer files).
        checkpoint_files: a list of weight file names, or ``"auto"`` (the index json, else a glob).
        output_dir: where ``save_checkpoint`` writes ``step_{N}`` directories.
        model_type: a family's name as ``waypoint.families.MODEL_TYPES`` lists them (``LLAMA3``, ``QWEN3``, ``MIXTRAL``,
            ...); ``None`` detects it from config.json.
        safe_serialization: ``None`` keeps the input's format; ``True`` writes safetensors,
            ``False`` PyTorch ``.bin`` files (file names follow the format).
        output_dtype: ``None`` writes each tensor in the dtype its input twin had (config.json and the index
            say so); ``fp32``/``bf16``/``fp16`` writes every floating-point tensor in that dtype.
    """

    own_files = frozenset({"config.json", *INDEX_NAMES.values()})
    format_label = "Hugging Face"
    loads_with = "transformers' AutoModelForCausalLM.from_pretrained('{path}')"
    config_file = "config.json"
    base_model_prefix = "model."  # transformers' name of the backbone inside *ForCausalLM

    def __init__(self, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                 checkpoint_files: list[str] | str = "auto", model_type: str | None = None,
                 safe_serialization: bool | None = None, output_dtype: str | torch.dtype | None = None) -> None:
        super().__init__(checkpoint_dir, output_dir, output_dtype)
        self.config = read_json(self.checkpoint_dir / self.config_file)
        self.converter: Converter = self._make_converter(model_type)
        self.layout: ShardLayout = discover(self.checkpoint_dir, checkpoint_files)
        self.safe_serialization = safe_serialization
        self._file_metadata: dict[str, dict | None] = {}
        self.disk_prefix = self.added_prefix = ""  # on-disk key = disk_prefix + key[len(added_prefix):]
        self.passthrough: dict[str, tuple[torch.Tensor, str]] = {}  # keys outside the text model: (tensor, file)

    def _make_converter(self, model_type: str | None) -> Converter:
        self.model_type = model_type or detect_model_type(self.config, str(self.checkpoint_dir / self.config_file))
        self.family = family_named(self.model_type)
        return get_converter(self.model_type, self.config)

    # -- load ---------------------------------------------------------------------
    def _load_model(self) -> dict[str, torch.Tensor]:
        hf_state: dict[str, torch.Tensor] = {}
        where: dict[str, str] = {}
        keys_by_file: dict[str, list[str]] = {}
        total = sum((self.checkpoint_dir / f).stat().st_size for f in self.layout.files)
        with tqdm(total=total, unit="B", unit_scale=True, desc="load", leave=False) as bar:
            for name in self.layout.files:
                path = self.checkpoint_dir / name
                tensors = read_tensors(path, self.unmapped)
                self._file_metadata[name] = read_metadata(path)
                self._check_against_index(name, tensors)
                for key, t in tensors.items():
                    if key in hf_state:
                        raise CheckpointError(f"{path}: key {key!r} also appears in {where[key]}")
                    hf_state[key], where[key] = t, name
                keys_by_file[name] = [k for k in tensors if not self.converter.is_ignored(k)]
                bar.update(path.stat().st_size)
        # A headless checkpoint (LlamaModel.save_pretrained) lacks the backbone's "model." prefix: add it for the
        # converter, and take it off again on save, as from_pretrained does. A multimodal repo nests the text model
        # under a prefix (Gemma 3's "language_model."): its keys are converted without it, the others (a vision
        # tower) are passed through and written back as they came.
        self.disk_prefix, self.added_prefix = self._key_prefixes(list(hf_state))
        if self.disk_prefix or self.added_prefix:
            inside = {k for k in hf_state if k.startswith(self.disk_prefix)}
            self.passthrough = {k: (hf_state[k], where[k]) for k in hf_state if k not in inside}
            hf_state = {self._converter_key(k): hf_state[k] for k in inside}
            where = {self._converter_key(k): where[k] for k in inside}
            keys_by_file = {f: [self._converter_key(k) for k in keys if k in inside] for f, keys in keys_by_file.items()}
        self.layout = self.layout.with_keys(keys_by_file)
        self.input_dtypes = {k: t.dtype for k, t in hf_state.items()}
        return self.converter.to_native(hf_state, where)

    def _key_prefixes(self, keys: list[str]) -> tuple[str, str]:
        """(the prefix on disk, the one the converter's keys have instead) for these keys."""
        for nest in self.family.hf_prefixes:
            if any(k.startswith(nest + self.base_model_prefix) for k in keys):
                return nest, ""
        headless = (self.base_model_prefix and not any(k.startswith(self.base_model_prefix) for k in keys)
                    and any(k.startswith(("embed_tokens.", "layers.")) for k in keys))
        return "", self.base_model_prefix if headless else ""

    def _converter_key(self, disk_key: str) -> str:
        return self.added_prefix + disk_key[len(self.disk_prefix):]

    def _disk_key(self, key: str) -> str:
        return self.disk_prefix + key[len(self.added_prefix):]

    def _check_against_index(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        if self.layout.weight_map is None:
            return
        expected = {k for k, f in self.layout.weight_map.items() if f == name}
        absent = sorted(expected - tensors.keys())
        if absent:
            raise CheckpointError(
                f"{self.checkpoint_dir / name}: lacks {absent[0]!r}"
                f"{f' and {len(absent) - 1} more keys' if len(absent) > 1 else ''} that {self.layout.index_name} puts there")

    # -- save ---------------------------------------------------------------------
    def output_layout(self) -> ShardLayout:
        if self.layout.weight_map is None:
            raise CheckpointError("save_checkpoint needs load_checkpoint first: the input's key -> file map is unknown")
        fmt = {None: self.layout.file_format, True: SAFETENSORS, False: TORCH}[self.safe_serialization]
        return self.layout.in_format(fmt)

    def _model_writer(self, native: Mapping[str, torch.Tensor]):
        layout = self.output_layout()
        plan = self._plan_files(native, layout)

        def write(stage: StagedDir) -> None:
            written = self._write_weights(native, layout, plan, stage)
            self._write_config(written, stage)
        return write

    def _plan_files(self, native: Mapping[str, torch.Tensor], layout: ShardLayout) -> dict[str, list]:
        """Output file -> converter groups that produce its keys; every key placed exactly as in the input."""
        groups = self.converter.plan(self.converter.native_keys_to_save(native), "native")
        plan: dict[str, list] = {name: [] for name in layout.files}
        produced = set()
        for g in groups:
            for hf_key in g.targets:
                if hf_key not in layout.weight_map:
                    raise CheckpointError(f"native key(s) {', '.join(g.sources)} become {hf_key!r}, which the input checkpoint does not have")
                if not plan[layout.weight_map[hf_key]] or plan[layout.weight_map[hf_key]][-1] is not g:
                    plan[layout.weight_map[hf_key]].append(g)
            produced.update(g.targets)
        missing = sorted(set(layout.weight_map) - produced)
        if missing:
            raise CheckpointError(f"state dict lacks {missing[0]!r}" + (f" and {len(missing) - 1} more keys" if len(missing) > 1 else "")
                                  + " that the input checkpoint has")
        return plan

    def _write_weights(self, native, layout: ShardLayout, plan, stage: StagedDir) -> set[torch.dtype]:
        """Write the weight files (and the index); the dtypes written."""
        total_size = total_params = 0
        dtypes: set[torch.dtype] = set()
        with tqdm(total=sum(nbytes(native, k) for k in native), unit="B", unit_scale=True, desc="save", leave=False) as bar:
            for src_name, name in zip(self.layout.files, layout.files):
                converted = self.converter.apply_groups(plan[name], native, forward=False, where=None)
                tensors = {self._disk_key(k): self.cast_for_output(k, converted[k])
                           for k in self.layout.weight_map if layout.weight_map[k] == name}
                tensors.update((k, t) for k, (t, f) in self.passthrough.items() if f == src_name)
                dtypes.update(t.dtype for t in tensors.values())
                metadata = self._metadata_for(src_name, tensors) if layout.file_format == SAFETENSORS else None
                stage.write(name, lambda f, tensors=tensors: write_tensors(f, tensors, layout.file_format, metadata))
                size = sum(_tensor_bytes(t) for t in tensors.values())
                total_size += size
                total_params += sum(t.numel() for t in tensors.values())
                bar.update(size)
                del converted, tensors  # before the next file's tensors are read: one file's worth at a time
        if layout.index_name:
            metadata = dict(layout.index_metadata, total_size=total_size)
            if "total_parameters" in metadata:
                metadata["total_parameters"] = total_params
            renamed = dict(zip(self.layout.files, layout.files))
            weight_map = dict(sorted([*((self._disk_key(k), f) for k, f in layout.weight_map.items()),
                                      *((k, renamed[f]) for k, (_, f) in self.passthrough.items())]))
            index = {"metadata": metadata, "weight_map": weight_map}
            stage.write_bytes(layout.index_name, (json.dumps(index, indent=2) + "\n").encode())
        return dtypes

    def _metadata_for(self, source_file: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
        """The safetensors header metadata of an output file: its input twin's (HF writes {"format": "pt"})."""
        return self._file_metadata.get(source_file) or {"format": "pt"}

    def _write_config(self, written: set[torch.dtype], stage: StagedDir) -> None:
        """config.json, its dtype made true to what was written."""
        config = dict(self.config)
        dtypes = {d for d in written if d.is_floating_point}
        if len(dtypes) == 1 and next(iter(dtypes)) in _DTYPE_NAMES:
            name = _DTYPE_NAMES[next(iter(dtypes))]
            for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
                config[key] = name
        stage.write_bytes("config.json", (json.dumps(config, indent=2) + "\n").encode())
