"""What every checkpoint format shares.

A format (one file each: ``hf_checkpointer``, ``meta_checkpointer``, ``native_checkpointer``) reads a checkpoint
directory into a native state dict, writes a state dict back in the input's own files (``load_checkpoint`` /
``save_checkpoint``: torchtune's surface), and writes native weights as a new checkpoint of the format
(``write_new``: conversion). It implements ``_load_model()``, ``_model_writer(native)`` (which checks everything
about a save up front and returns the function that writes the model files into a staged directory) and
``write_new``, and answers what callers need to know about its input through public methods (``model_args``,
``hf_source``, ``hf_converter``, ``adapter_layout``). Beside the model, every save carries the input's small side
files (tokenizer, generation config, ...) and the modules' extra state.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from waypoint.checkpointers.commit import MANIFEST, StagedDir
from waypoint.checkpointers.extra_state import EXTRA_STATE_FILE, load_extra_state, split_extra_state
from waypoint.checkpointers.shard_layout import INDEX_NAMES, WEIGHT_SUFFIXES
from waypoint.checkpointers.torchtune_compat import (ADAPTER_CONFIG_KEY, ADAPTER_KEY, MODEL_KEY, adapter_writer,
                                                     recipe_state_writer, resume_options_note, step_number)
from waypoint.converters import Converter
from waypoint.errors import CheckpointError
from waypoint.lazy import spec_of
from waypoint.models import ModelArgs
from waypoint.models.dtypes import dtype_name, parse_dtype

log = logging.getLogger(__name__)

SMALL_FILE_LIMIT = 100 * 2**20  # non-weight files up to this size travel with the model (tokenizer, README, ...)
RECIPE_STATE = "recipe_state.pt"  # a run's state beside the model (waypoint.run.recipe_state writes the recipes')
RUN_FILES = frozenset({MANIFEST, EXTRA_STATE_FILE, RECIPE_STATE})  # a run's step files, never a model's side files


@dataclass(frozen=True)
class Conversion:
    """What a new checkpoint of another format is written from, beside the native weights: the model, its family,
    the HF checkpoint it came from (``hf_source.HFSource``: its config.json and shard layout, for converting back),
    the tokenizer's bos/eos ids (for a config.json made without a source), and the layout asked for
    (``num_shards`` files of about equal size, or files of at most ``max_shard_bytes``; by default as many files as
    the input had)."""

    args: ModelArgs
    model_type: str | None = None
    source: Any = None  # HFSource | None
    special_tokens: Mapping[str, int] = field(default_factory=dict)
    input_files: int = 1
    num_shards: int | None = None
    max_shard_bytes: int | None = None

    @property
    def resharded(self) -> bool:
        return bool(self.num_shards or self.max_shard_bytes)

    @property
    def files(self) -> int | None:
        """How many files to cut the weights into (None: by ``max_shard_bytes``)."""
        return self.num_shards or (None if self.max_shard_bytes else self.input_files)


class Checkpointer:
    """Base of the HF, Meta and native checkpointers."""

    name: ClassVar[str] = ""  # "hf", "meta", "native": the format's name (convert.py --to, checkpointer=)
    label: ClassVar[str] = ""  # "Hugging Face", "Meta", "native": for messages
    loads_with: ClassVar[str] = "waypoint.checkpointers.load_model('{path}')"  # what else reads the format
    description_files: ClassVar[frozenset[str]] = frozenset()  # the files that describe the model in this format
    copies_description: ClassVar[bool] = False  # a save like the input copies them (Meta's params.json) or rewrites them

    def __init__(self, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                 output_dtype: str | torch.dtype | None = None, *, recipe_checkpoint: str | None = None,
                 adapter_checkpoint: str | None = None, resume_from_checkpoint: bool = False,
                 should_load_recipe_state: bool = False) -> None:
        # torchtune's resume options, as its configs give them: a Waypoint run resumes from its own step_N instead
        # (resume=auto); null/false ones say nothing, the others one note (checkpointers.torchtune_compat)
        note = resume_options_note({"recipe_checkpoint": recipe_checkpoint, "adapter_checkpoint": adapter_checkpoint,
                                    "resume_from_checkpoint": resume_from_checkpoint,
                                    "should_load_recipe_state": should_load_recipe_state})
        self.option_notes: list[str] = [note] if note else []
        self.checkpoint_dir = Path(checkpoint_dir)
        self.output_dir = Path(output_dir)
        if not self.checkpoint_dir.is_dir():
            raise CheckpointError(f"{self.checkpoint_dir}: checkpoint directory not found")
        try:
            self.output_dtype = parse_dtype(output_dtype)  # None: each tensor in its input twin's dtype
        except ValueError as e:
            raise CheckpointError(f"output_dtype: {e}") from None
        self.input_dtypes: dict[str, torch.dtype] = {}  # the format's key -> dtype in the input, filled on load
        self.unmapped: list[str] = []  # weight files read into memory on load (legacy pickles cannot be mapped)
        # files every checkpoint gets in place of the input's of the same name (name -> bytes), e.g. a
        # generation_config.json that stops at a chat template's end of turn
        self.output_files: dict[str, bytes] = {}
        # what the run's last line must say about what was written (an export check found the output's format far
        # from the model that trained: a re-quantized output), each once
        self.output_warnings: list[str] = []

    # -- what each format implements ---------------------------------------------------
    @classmethod
    def recognises(cls, path: Path) -> bool:
        """Whether the directory ``path`` holds a checkpoint of this format (by default: its description file)."""
        return all((path / name).is_file() for name in cls.description_files)

    def _load_model(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _model_writer(self, native: Mapping[str, torch.Tensor], adapted: frozenset[str] = frozenset()
                      ) -> Callable[[StagedDir], None]:
        raise NotImplementedError

    @classmethod
    def write_new(cls, stage: StagedDir, native: Mapping[str, torch.Tensor], conversion: Conversion) -> None:
        """Write ``native`` into ``stage`` as a new checkpoint of this format (its weights and description files)."""
        raise NotImplementedError

    @classmethod
    def new_as_written(cls, conversion: Conversion) -> Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None:
        """For an export check of ``write_new``: ``written(model)``, within which ``model`` holds what the new files
        will load as, where they round what they are given (as ``as_written``); None where they hold it as it is."""
        return None

    @property
    def files(self) -> tuple[str, ...]:
        """The input's weight files (by default: its shard layout's)."""
        return self.layout.files

    def model_args(self) -> ModelArgs:
        """The native model the input describes."""
        raise NotImplementedError

    def hf_source(self):
        """The HF checkpoint the input is or came from (``hf_source.HFSource``), or None."""
        raise NotImplementedError

    def hf_converter(self) -> Converter:
        """The converter whose HF side names transformers' modules for this model (PEFT adapters use those names)."""
        return self.family.converter(self.model_args())

    def adapter_layout(self) -> tuple[str, Converter] | None:
        """A LoRA adapter of this input is also written in the format's own keys, as ``adapter_<name>.safetensors``
        (Meta and native inputs): (name, the converter to those keys), or None."""
        return self.name, self.converter

    # -- reading -------------------------------------------------------------------------
    @property
    def notes(self) -> list[str]:
        """What the load report adds about the options given and how the files were read."""
        if not self.unmapped:
            return list(self.option_notes)
        names = ", ".join(sorted(self.unmapped)[:3]) + (f" and {len(self.unmapped) - 3} more" if len(self.unmapped) > 3 else "")
        return [*self.option_notes,
                f"note: read into memory, not memory-mapped: {names} (legacy non-zip PyTorch files cannot be mapped)"]

    def load_checkpoint(self) -> dict[str, Any]:
        """``{"model": native state dict}``: tensors memory-mapped where the format allows, in the file's dtype,
        with the modules' extra state (``*._extra_state``) when the checkpoint has it."""
        native = self._load_model()
        if (self.checkpoint_dir / EXTRA_STATE_FILE).is_file():
            native.update(load_extra_state(self.checkpoint_dir / EXTRA_STATE_FILE))
        return {"model": native}

    def side_files(self, skip: frozenset[str] = frozenset()) -> list[Path]:
        """The input's small non-weight files that travel with the model (tokenizer, generation config, README, ...):
        not its weights, index or (unless the format copies them) description, nor a run's step files."""
        own = set(INDEX_NAMES.values()) | (set() if self.copies_description else set(self.description_files))
        skip = RUN_FILES | own | set(skip)
        return [p for p in sorted(self.checkpoint_dir.iterdir())
                if p.is_file() and p.name not in skip and not p.name.startswith(".")
                and not p.name.endswith(WEIGHT_SUFFIXES) and p.stat().st_size <= SMALL_FILE_LIMIT]

    # -- writing like the input -------------------------------------------------------------
    def cast_for_output(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the format's ``key``) in the dtype its input twin had, or in ``output_dtype``."""
        if not tensor.is_floating_point():
            return tensor
        dtype = self.output_dtype or self.input_dtypes.get(key, tensor.dtype)
        return tensor if tensor.dtype == dtype else tensor.to(dtype)

    def output_dtypes(self) -> set[torch.dtype]:
        """The floating-point dtypes the model files are written in."""
        return {self.output_dtype} if self.output_dtype else {d for d in self.input_dtypes.values() if d.is_floating_point}

    def output_dtype_note(self) -> str:
        """What the model files are written in, and why, for the log."""
        names = "/".join(sorted(dtype_name(d) for d in self.output_dtypes())) or "the input's dtype"
        return f"{names} (output_dtype)" if self.output_dtype else f"{names} like the input (output_dtype changes it)"

    def narrows(self, native: Mapping[str, Any]) -> bool:
        """Whether writing ``native`` in the output dtypes can lose precision: a run resuming from it then needs the
        model as it trained, which its recipe state (or a sharded checkpoint's shards) then carries."""
        targets = self.output_dtypes()
        sources = {spec_of(native, k)[1] for k in native}
        return any(narrows(s, t) for s in sources if s.is_floating_point for t in targets)

    @property
    def rounds(self) -> bool:
        """Whether the output's format rounds what it is given (a re-quantized output), beyond its dtype."""
        return False

    def as_written(self, model: torch.nn.Module, adapted: frozenset[str] = frozenset()) -> contextlib.AbstractContextManager:
        """A context within which ``model`` holds the values its files will load as, where the format rounds them
        (a quantized output: ``quantization.QuantizedOutput.as_written``; ``adapted`` as for ``writer``); the identity
        for the others."""
        return contextlib.nullcontext()

    def describe_output(self, path: str | os.PathLike) -> str:
        """What a checkpoint written at ``path`` is and how to use it, for the last line of a run."""
        dtypes = "/".join(sorted(dtype_name(d) for d in self.output_dtypes()))
        line = (f"{path} ({self.label} format{', ' + dtypes if dtypes else ''}): {self.loads_with.format(path=path)} "
                f"loads it; python scripts/convert.py {path} OUT --to hf|meta|native converts it")
        return line + "".join(f"; WARNING: {warning}" for warning in dict.fromkeys(self.output_warnings))

    def writer(self, state_dict: Mapping[str, Any], adapted: frozenset[str] = frozenset()) -> Callable[[StagedDir], None]:
        """Check everything about ``state_dict["model"]`` now; return what writes it into a staged directory: the
        model in the input's files, the input's side files (``output_files`` in place of theirs) and the modules'
        extra state. The model may be lazy (a sharded model's ``dtensor_state.GatheredState``): its tensors are read
        file by file, as each output file is written. ``adapted``: the native keys a LoRA merge changed, which a
        quantized format writes unquantized (re-quantizing would erase most of the adapter's update)."""
        native, extra = split_extra_state(state_dict["model"])
        write_model = self._model_writer(native, adapted)
        files = dict(self.output_files)

        def write(stage: StagedDir) -> None:
            write_model(stage)
            for path in self.side_files(skip=frozenset(files)):
                stage.copy_file(path)
            for name, data in files.items():
                stage.write_bytes(name, data)
            if extra:
                stage.write(EXTRA_STATE_FILE, lambda f: torch.save(extra, f))
        return write

    def save_to(self, state_dict: Mapping[str, Any], target: str | os.PathLike,
                check: Callable[[Path], Any] | None = None, adapted: frozenset[str] = frozenset(), *,
                intermediate_checkpoint: bool = False, adapter_only: bool = False) -> Path:
        """``state_dict["model"]`` as a new directory ``target`` (it must not exist yet) in the input's format and
        files, committed atomically with a manifest. ``check(staged_dir)`` runs on the written files before they are
        committed (an ``ExportCheck``); if it raises, nothing is committed. ``adapted``: as for ``writer``.

        What a torchtune loop puts beside the model goes in too, or is refused in one line before anything is
        written: a LoRA ``adapter`` with its ``adapter_config`` as a PEFT adapter (``adapter_only``: that alone), and
        with ``intermediate_checkpoint`` every other entry (optimizer, epochs run, ...) as ``recipe_state.pt``."""
        return write_directory(target, self._state_writer(state_dict, intermediate_checkpoint, adapter_only, adapted), check)

    def save_checkpoint(self, state_dict: Mapping[str, Any], step: int | None = None, *, epoch: int | None = None,
                        intermediate_checkpoint: bool = False, adapter_only: bool = False) -> Path:
        """``save_to(state_dict, output_dir/step_{step})``; an existing ``step_{step}`` is never touched. torchtune's
        ``save_checkpoint(state_dict, epoch=N, intermediate_checkpoint=..., adapter_only=...)`` works too: ``epoch``
        is the step number (the directory is ``step_N``, not torchtune's ``epoch_N``)."""
        step = step_number(step, epoch)
        return self.save_to(state_dict, self.output_dir / f"step_{step}", intermediate_checkpoint=intermediate_checkpoint,
                            adapter_only=adapter_only)

    def _state_writer(self, state_dict: Mapping[str, Any], intermediate: bool, adapter_only: bool,
                      adapted: frozenset[str] = frozenset()) -> Callable[[StagedDir], None]:
        """What writes every entry of ``state_dict`` (``save_to``), each checked now."""
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"save_checkpoint: expected a state dict {{'model': ...}}, "
                                  f"got a {type(state_dict).__name__}")
        rest = {k: v for k, v in state_dict.items() if k not in (MODEL_KEY, ADAPTER_KEY, ADAPTER_CONFIG_KEY)}
        if rest and not intermediate:
            names = ", ".join(repr(k) for k in list(rest)[:4]) + (" ..." if len(rest) > 4 else "")
            raise CheckpointError(f"save_checkpoint: state_dict entries {names} are neither the model nor a LoRA "
                                  "adapter; pass intermediate_checkpoint=True to write them as the step's "
                                  f"{RECIPE_STATE}, or leave them out")
        if ADAPTER_CONFIG_KEY in state_dict and ADAPTER_KEY not in state_dict:
            raise CheckpointError("save_checkpoint: state_dict['adapter_config'] without state_dict['adapter'] "
                                  "(the LoRA tensors it describes)")
        writers = []
        if adapter_only:
            if ADAPTER_KEY not in state_dict:
                raise CheckpointError("save_checkpoint(adapter_only=True): the state dict has no 'adapter' entry "
                                      "(the LoRA tensors to write)")
        elif MODEL_KEY not in state_dict:
            held = ", ".join(repr(k) for k in state_dict) or "nothing"
            raise CheckpointError(f"save_checkpoint: the state dict has no 'model' entry (it has {held}); "
                                  "adapter_only=True writes an adapter alone")
        else:
            writers.append(self.writer(state_dict, adapted))
        if ADAPTER_KEY in state_dict:
            writers.append(adapter_writer(state_dict[ADAPTER_KEY], state_dict.get(ADAPTER_CONFIG_KEY), self.hf_converter(),
                                          str(self.checkpoint_dir), self.adapter_layout()))
        if rest:
            writers.append(recipe_state_writer(rest, RECIPE_STATE))

        def write(stage: StagedDir) -> None:
            for each in writers:
                each(stage)
        return write


def write_directory(target: str | os.PathLike, write: Callable[[StagedDir], None],
                    check: Callable[[Path], Any] | None = None) -> Path:
    """A new directory ``target`` written by ``write(stage)``, checked by ``check(staged path)`` and committed with its
    manifest, or nothing at all."""
    target = Path(target)
    try:
        with StagedDir(target) as stage:
            write(stage)
            if check is not None:
                check(stage.path)
    except OSError as e:
        raise CheckpointError(f"could not write {target}: {e.strerror or e} ({e.__class__.__name__}); "
                              "nothing was committed and earlier checkpoints are intact") from e
    log.info("saved %s", target)
    return target


def narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` to ``target`` can lose information (fp32 -> bf16 does, bf16 -> fp32 does not)."""
    widening = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float64),
                (torch.bfloat16, torch.float64), (torch.float16, torch.float64)}
    return source != target and (source, target) not in widening
