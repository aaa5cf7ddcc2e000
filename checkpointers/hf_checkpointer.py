"""HFCheckpointer: reads a Hugging Face checkpoint directory and writes one just like it.

A thin composition of three parts: the file format (``file_formats``), the input's shard layout
(``shard_layout``) and the family's converter (``converters``). What comes in as
``model-0000X-of-0000N.safetensors`` with an index goes out under the same names, with the same keys in each file.
A conversion from another format (``write_new``) writes the config.json and layout of the HF checkpoint the
weights came from when it is known, else a config.json derived from the model and files of about equal size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import torch

from waypoint.checkpointers.base import Checkpointer, Conversion
from waypoint.checkpointers.commit import StagedDir
from waypoint.checkpointers.file_formats import SAFETENSORS, TORCH, json_bytes, read_json
from waypoint.checkpointers.hf_source import HFSource, converter_key, disk_key
from waypoint.checkpointers.load_report import fold_keys
from waypoint.checkpointers.quantization import QuantizedOutput, dequantizing_to
from waypoint.checkpointers.shard_layout import ShardLayout, discover, plan_files, plan_layout, read_files, write_files
from waypoint.converters import CheckpointError, Converter
from waypoint.families import detect_model_type, family_named, get_converter, model_args_from_hf_config
from waypoint.lazy import nbytes
from waypoint.models import ModelArgs
from waypoint.models.dtypes import HF_DTYPES, dtype_name

CONFIG_FILE = "config.json"
BASE_MODEL_PREFIX = "model."  # transformers' name of the backbone inside *ForCausalLM


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
        output_quantization: for a quantized input (``quantization_config``, e.g. gpt-oss's MXFP4), ``input`` (the
            default) writes it back quantized the same way, untouched tensors byte for byte and a LoRA merge's
            changed ones unquantized; ``requantize`` re-quantizes those too; ``none`` writes the dequantized model
            (``checkpointers.quantization``).
        recipe_checkpoint, adapter_checkpoint, resume_from_checkpoint, should_load_recipe_state: torchtune's resume
            options, accepted so that its checkpointer sections work as they are; a Waypoint run resumes from its
            own ``step_N`` (``resume=auto``), which one note says when they are set (``torchtune_compat``).

    ``checkpoint_files`` may also be torchtune's ``{filename_format: model-{}-of-{}.safetensors, max_filename:
    "00004"}`` or absolute paths inside ``checkpoint_dir`` (``shard_layout.listed_files``).
    """

    name, label = "hf", "Hugging Face"
    description_files = frozenset({CONFIG_FILE})

    @property
    def loads_with(self) -> str:
        """A multimodal repo's own class (``Gemma3ForConditionalGeneration``) loads it whole; a text model's the Auto one."""
        architecture = next(iter(self.config.get("architectures") or []), "")
        if architecture.endswith("ForConditionalGeneration"):
            return f"transformers' {architecture}.from_pretrained('{{path}}')"
        return "transformers' AutoModelForCausalLM.from_pretrained('{path}')"

    def __init__(self, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                 checkpoint_files: list[str] | str = "auto", model_type: str | None = None,
                 safe_serialization: bool | None = None, output_dtype: str | torch.dtype | None = None,
                 output_quantization: str | None = None, *,
                 recipe_checkpoint: str | None = None, adapter_checkpoint: str | None = None,
                 resume_from_checkpoint: bool = False, should_load_recipe_state: bool = False) -> None:
        super().__init__(checkpoint_dir, output_dir, output_dtype, recipe_checkpoint=recipe_checkpoint,
                         adapter_checkpoint=adapter_checkpoint, resume_from_checkpoint=resume_from_checkpoint,
                         should_load_recipe_state=should_load_recipe_state)
        self.config = read_json(self.checkpoint_dir / CONFIG_FILE)
        self.model_type = model_type or detect_model_type(self.config, str(self.checkpoint_dir / CONFIG_FILE))
        self.family = family_named(self.model_type)
        self.converter: Converter = dequantizing_to(get_converter(self.model_type, self.config), self.config)
        self.quantized = QuantizedOutput(self.converter, self.config, output_quantization, str(self.checkpoint_dir / CONFIG_FILE))
        self.layout: ShardLayout = discover(self.checkpoint_dir, checkpoint_files)
        self.safe_serialization = safe_serialization
        self._file_metadata: dict[str, dict | None] = {}
        self._prefixes: dict[str, str] = {}  # on-disk key prefix -> the converter's (a multimodal repo's, a headless one's)
        self._passthrough: dict[str, tuple[torch.Tensor, str]] = {}  # keys outside the text model: (tensor, file)
        self._source: dict[str, torch.Tensor] = {}  # the input's tensors as read (memory-mapped), by converter key
        self._quantized_notes: list[str] = []  # the load report's lines about quantized tensors read

    def model_args(self) -> ModelArgs:
        return model_args_from_hf_config(self.config)

    def hf_source(self) -> HFSource:
        """The input as a conversion's source: its config and files, every key as on disk; a block-FP8 input's scales
        (so that converting back writes the untouched weights' very bytes); the tensors outside the model (a vision
        tower, MTP layers) and how it nests the model's keys, so that converting back writes them where they were."""
        layout = self.layout
        if layout.weight_map is not None and (self._prefixes or self._passthrough):
            weight_map = {self._disk_key(k): f for k, f in layout.weight_map.items()}
            weight_map.update({k: f for k, (_, f) in self._passthrough.items()})
            layout = ShardLayout(layout.files, weight_map, layout.index_name, dict(layout.index_metadata))
        scales = {self._disk_key(k): t for k, t in self._source.items() if self.quantized.method == "fp8" and k.endswith("_scale_inv")}
        passthrough = {k: t for k, (t, _) in self._passthrough.items()}
        return HFSource(dict(self.config), layout, scales or None, passthrough or None, dict(self._prefixes) or None)

    def hf_converter(self) -> Converter:
        """A block-FP8 input's rules without the scales: transformers' module names (a multimodal repo's, where the
        family says where its text model's modules are)."""
        dense = self.quantized.dense
        nested = self._prefixes and self._prefixes in [dict(n) for n in self.family.hf_prefixes]
        if not (nested and self.family.nested_modules):
            return dense

        def module_key(key: str) -> str:
            for ours, theirs in self.family.nested_modules.items():
                if key.startswith(ours):
                    return theirs + key[len(ours):]
            return key
        return dense.renamed(module_key)

    def adapter_layout(self) -> None:
        return None  # PEFT's keys are the HF ones already

    # -- load ---------------------------------------------------------------------
    def _load_model(self) -> dict[str, torch.Tensor]:
        # the files' own layout: a load below replaces self.layout with the converter's keys (a nested repo's
        # without their prefix), which a second load must not read the files by
        self._disk_layout = getattr(self, "_disk_layout", None) or self.layout
        read = read_files(self.checkpoint_dir, self._disk_layout, self.unmapped, packed=self.quantized.packed)
        self._file_metadata = read.metadata
        hf_state, where = read.tensors, read.where
        # A headless checkpoint (LlamaModel.save_pretrained) lacks the backbone's "model." prefix: add it for the
        # converter, and take it off again on save, as from_pretrained does. A multimodal repo nests the text model
        # under a prefix (Gemma 3's "language_model."): its keys are converted without it, the others (a vision
        # tower) are passed through and written back as they came.
        self._prefixes = self._key_prefixes(list(hf_state))
        if self._prefixes:
            inside = [k for k in hf_state if k.startswith(tuple(self._prefixes))]  # in the files' order
            self._passthrough = {k: (hf_state[k], where[k]) for k in hf_state if not k.startswith(tuple(self._prefixes))}
            hf_state = {self._converter_key(k): hf_state[k] for k in inside}
            where = {self._converter_key(k): where[k] for k in inside}
        # Layers the model does not run (DeepSeek-V3's multi-token prediction) are carried the same way.
        carried = self.family.carried_keys(self.config)
        if carried:
            self._passthrough |= {self._disk_key(k): (hf_state[k], where[k]) for k in hf_state if carried.search(k)}
            hf_state = {k: t for k, t in hf_state.items() if not carried.search(k)}
            where = {k: f for k, f in where.items() if k in hf_state}
        self.layout = self.layout.with_keys({f: [k for k in hf_state if where[k] == f and not self.converter.is_ignored(k)]
                                             for f in self.layout.files})
        self.input_dtypes = {k: t.dtype for k, t in hf_state.items()}
        self._source = hf_state
        self.converter = self.quantized.adopt(list(hf_state), self.input_dtypes)  # block FP8: the rules for the weights it quantizes
        if self.quantized.method == "fp8":  # the scales are small: every one is checked now, in one line naming it
            from waypoint.converters.fp8 import is_scale_key, nonfinite

            for key in (k for k in hf_state if is_scale_key(k)):
                if (why := nonfinite(key, hf_state[key])) is not None:
                    raise CheckpointError(f"{self.checkpoint_dir / where[key]}: {self._disk_key(key)}: {why}; the "
                                          "checkpoint's FP8 weights would load as nan/inf (the file is damaged or was "
                                          "written wrong; re-download or re-export it)")
        native = self.converter.to_native(hf_state, where)
        self._quantized_notes = self.quantized.notes(list(hf_state), native)
        if carried and self._passthrough:
            keys = [k for k in self._passthrough if carried.search(self._converter_key(k))]
            self._quantized_notes.append(f"carried untouched: {len(keys)} tensors of layers the model does not run "
                                         f"({', '.join(fold_keys(keys)[:4])}{' ...' if len(fold_keys(keys)) > 4 else ''}); "
                                         "written back as they came")
        return native

    @property
    def notes(self) -> list[str]:
        return super().notes + self._quantized_notes

    def _key_prefixes(self, keys: list[str]) -> dict[str, str]:
        """{prefix on disk: the one the converter's keys have instead} for these keys: a multimodal repo's nesting
        (the family's ``hf_prefixes``, found by its first prefix), a headless checkpoint's missing ``model.``, or none."""
        for nest in self.family.hf_prefixes:
            if any(k.startswith(next(iter(nest))) for k in keys):
                return dict(nest)
        headless = (not any(k.startswith(BASE_MODEL_PREFIX) for k in keys)
                    and any(k.startswith(("embed_tokens.", "layers.")) for k in keys))
        return {"": BASE_MODEL_PREFIX} if headless else {}

    def _converter_key(self, key: str) -> str:
        return converter_key(self._prefixes, key)

    def _disk_key(self, key: str) -> str:
        return disk_key(self._prefixes, key)

    # -- what an engine serving the input takes --------------------------------------------
    def served_tensors(self, native: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """``native`` as the input's files name and lay out its tensors (the family's table run backwards: fused,
        stacked, permuted as on disk), one conversion group at a time, for an inference engine that loaded the input
        (vLLM's ``load_weights``). A quantized input is refused: what it serves are the quantized tensors."""
        if self.quantized.method is not None:
            raise CheckpointError(f"{self.checkpoint_dir / CONFIG_FILE}: a {self.quantized.method} checkpoint's weights "
                                  "cannot be pushed to an inference engine yet; set generation.engine=native")
        converter = self.converter
        for group in converter.plan(converter.native_keys_to_save(native), "native"):
            for key, tensor in converter.apply_groups([group], native, forward=False, where=None).items():
                yield self._disk_key(key), tensor

    # -- save like the input ------------------------------------------------------------
    def _model_writer(self, native: Mapping[str, torch.Tensor], adapted: frozenset[str] = frozenset()):
        if self.layout.weight_map is None:
            raise CheckpointError("save_checkpoint needs load_checkpoint first: the input's key -> file map is unknown")
        fmt = {None: self.layout.file_format, True: SAFETENSORS, False: TORCH}[self.safe_serialization]
        keys = self.converter.native_keys_to_save(native)
        unquantized = self.quantized.unquantized(keys, frozenset(adapted))  # a LoRA merge's changes, kept
        converter = self.quantized.output_converter(unquantized)
        layout = self.quantized.output_layout(self.layout, keys, unquantized).in_format(fmt)
        plan = plan_files(converter, native, layout)
        source_of = dict(zip(layout.files, self.layout.files))
        dense = converter.dense_targets(keys) if unquantized else set()
        modules = sorted({self._disk_key(k).rsplit(".", 1)[0] for k in dense})  # modules_to_not_convert

        def tensors_of(name: str) -> dict[str, torch.Tensor]:
            converted = converter.apply_groups(plan[name], native, forward=False, where=None)
            converted = self.quantized.keep_unchanged(plan[name], converted, native, self._source)
            tensors = {self._disk_key(k): self._cast(k, converted[k], k in dense) for k in layout.keys_in(name)}
            return tensors | {k: t for k, (t, f) in self._passthrough.items() if f == source_of[name]}

        def write(stage: StagedDir) -> None:
            written = write_files(stage, layout, tensors_of, lambda name, _: self._file_metadata.get(source_of[name]) or {"format": "pt"},
                                  total_bytes=sum(nbytes(native, k) for k in native), is_parameter=converter.is_parameter)
            config = self.quantized.output_config(self.config, modules)
            stage.write_bytes(CONFIG_FILE, json_bytes(config_with_dtype(config, written)))
        return write

    def _cast(self, key: str, tensor: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """``cast_for_output``; a dequantized output's weights (new keys, or FP8 ones; ``dense``: one written
        unquantized in a quantized output) take the dtype of the input's other weights."""
        if (self.quantized.dequantize or dense) and tensor.is_floating_point() and not self.output_dtype \
                and self.input_dtypes.get(key) not in HF_DTYPES:
            floats = [d for d in self.input_dtypes.values() if d in HF_DTYPES]
            return tensor.to(max(set(floats), key=floats.count)) if floats else tensor
        return self.cast_for_output(key, tensor)

    @property
    def rounds(self) -> bool:
        return self.quantized.lossy

    def narrows(self, native: Mapping[str, torch.Tensor]) -> bool:
        """A re-quantized output holds less than the model (``checkpointers.quantization``), as a narrower dtype does."""
        return self.rounds or super().narrows(native)

    def describe_output(self, path) -> str:
        line = super().describe_output(path)
        return line.replace(" format", f" format, {self.quantized.method} like the input", 1) if self.rounds else line

    def as_written(self, model: torch.nn.Module, adapted: frozenset[str] = frozenset()):
        return self.quantized.as_written(model, self._source, frozenset(adapted))

    # -- a new HF checkpoint ------------------------------------------------------------
    @staticmethod
    def _source_output(source: HFSource) -> tuple[dict, Converter, QuantizedOutput | None, dict[str, torch.Tensor]]:
        """How ``write_new`` writes for the HF checkpoint the weights came from: (its config.json, the converter, the
        source's quantization where its files are known, its kept block-FP8 scales by converter key)."""
        passthrough = source.passthrough or {}
        scales = {source.converter_key(k): t for k, t in (source.scales or {}).items()}
        config = dict(source.config)
        converter = get_converter(detect_model_type(config), config)
        quantized = None
        if source.layout and source.layout.weight_map:
            keys = [source.converter_key(k) for k in source.layout.weight_map if k not in passthrough]
            quantized = QuantizedOutput(dequantizing_to(converter, config), config, None)
            converter = quantized.adopt(keys, {k: t.dtype for k, t in scales.items()})  # the source's FP8 weights, if any
            converter.plan(keys, "hf")  # the source's expert layout, if it has a choice
        return config, converter, quantized, scales

    @classmethod
    def new_as_written(cls, conversion: Conversion):
        """A source quantized as it came (block FP8, MXFP4) is written so again: the weights a run changed re-quantized,
        those the kept input scales give back as they were (``QuantizedOutput.as_written``)."""
        if conversion.source is None:
            return None
        _, _, quantized, scales = cls._source_output(conversion.source)
        if quantized is None or not quantized.lossy:
            return None
        return lambda model: quantized.as_written(model, {}, scales=scales)

    @classmethod
    def write_new(cls, stage: StagedDir, native: Mapping[str, torch.Tensor], conversion: Conversion) -> None:
        source: HFSource | None = conversion.source
        passthrough = dict(source.passthrough or {}) if source is not None else {}
        scales, quantized = {}, None
        if source is not None:
            config, converter, quantized, scales = cls._source_output(source)
        else:
            dtypes = {t.dtype for t in native.values() if t.is_floating_point()}
            dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
            family = family_named(conversion.model_type)
            config = {**family.hf_config(conversion.args), **conversion.special_tokens,
                      "dtype": dtype_name(dtype) if dtype in HF_DTYPES else "float32"}
            converter = get_converter(conversion.model_type, config)
        tensors = converter.from_native(native)
        if scales and quantized is not None:  # block FP8: untouched weights as they came
            groups = converter.plan(converter.native_keys_to_save(native), "native")
            tensors = quantized.keep_input_scales(groups, tensors, native, scales)
        if source is not None:  # nested as the source was (a multimodal repo), beside what it held outside the model
            tensors = {source.disk_key(k): t for k, t in tensors.items()} | passthrough
        layout = None
        if source is not None and not conversion.resharded and source.layout and source.layout.weight_map \
                and set(source.layout.weight_map) == set(tensors):
            layout = source.layout  # the very files and key -> file map the weights came in
        sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
        layout = layout or plan_layout(sizes, conversion.files, conversion.max_shard_bytes)
        write_files(stage, layout, lambda name: {k: tensors[k] for k in layout.keys_in(name)},
                    lambda name, _: {"format": "pt"}, total_bytes=sum(sizes.values()), is_parameter=converter.is_parameter)
        stage.write_bytes(CONFIG_FILE, json_bytes(config))


def config_with_dtype(config: Mapping, written: set[torch.dtype]) -> dict:
    """config.json, its dtype made true to what was written."""
    config = dict(config)
    dtypes = {d for d in written if d.is_floating_point}
    if len(dtypes) == 1 and next(iter(dtypes)) in HF_DTYPES:
        for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
            config[key] = dtype_name(next(iter(dtypes)))
    return config
