"""What every checkpointer shares: step directories committed atomically, with the model in the
format's own files and, beside it, module extra state and the recipe state.

A format implements ``_load_model()`` (native state dict) and ``_model_writer(native)``
(validates everything about the save up front and returns the function that writes
the model files into the staged directory), and names the files it writes itself.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from waypoint.checkpointers.commit import MANIFEST, StagedDir
from waypoint.checkpointers.extra_state import EXTRA_STATE_FILE, load_extra_state, split_extra_state
from waypoint.checkpointers.shard_layout import WEIGHT_SUFFIXES
from waypoint.errors import CheckpointError
from waypoint.lazy import spec_of
from waypoint.models.dtypes import parse_dtype

log = logging.getLogger(__name__)

RECIPE_STATE_FILE = "recipe_state.pt"
SMALL_FILE_LIMIT = 100 * 2**20  # non-weight files up to this size travel with the model (tokenizer, README, ...)


def read_json(path: Path) -> dict:
    """A checkpoint's description file (config.json, params.json, ...); one-line errors naming it."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (this checkpoint format needs {path.name})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid json ({e})") from e


class Checkpointer:
    """Base of the HF, Meta and native checkpointers (``load_checkpoint`` / ``save_checkpoint``)."""

    own_files: frozenset[str] = frozenset()  # files the format writes itself, never copied from the input
    format_label = ""  # "Hugging Face", "Meta", "native": for messages
    loads_with = "waypoint.checkpointers.load_model('{path}')"  # what else reads the format, for messages

    def __init__(self, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                 output_dtype: str | torch.dtype | None = None) -> None:
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

    # -- to implement -------------------------------------------------------------
    def _load_model(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _model_writer(self, native: Mapping[str, torch.Tensor]) -> Callable[[StagedDir], None]:
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------
    @property
    def notes(self) -> list[str]:
        """What the load report adds about how the files were read."""
        if not self.unmapped:
            return []
        names = ", ".join(sorted(self.unmapped)[:3]) + (f" and {len(self.unmapped) - 3} more" if len(self.unmapped) > 3 else "")
        return [f"note: read into memory, not memory-mapped: {names} (legacy non-zip PyTorch files cannot be mapped)"]

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
        names = "/".join(sorted(_dtype_name(d) for d in self.output_dtypes())) or "the input's dtype"
        return f"{names} (output_dtype)" if self.output_dtype else f"{names} like the input (output_dtype changes it)"

    def narrows(self, native: Mapping[str, Any]) -> bool:
        """Whether writing ``native`` in the output dtypes can lose precision: a run resuming from it then needs the
        model as it trained, which ``recipe_state.pt`` (or a sharded checkpoint's shards) then carries."""
        targets = self.output_dtypes()
        sources = {spec_of(native, k)[1] for k in native}
        return any(narrows(s, t) for s in sources if s.is_floating_point for t in targets)

    def describe_output(self, path: str | os.PathLike) -> str:
        """What a checkpoint written at ``path`` is and how to use it, for the last line of a run."""
        dtypes = "/".join(sorted(_dtype_name(d) for d in self.output_dtypes()))
        return (f"{path} ({self.format_label} format{', ' + dtypes if dtypes else ''}): {self.loads_with.format(path=path)} "
                f"loads it; python scripts/convert.py {path} OUT --to hf|meta|native converts it")

    def load_checkpoint(self) -> dict[str, Any]:
        """``{"model": native state dict}``: tensors memory-mapped where the format allows, in the file's dtype,
        with the modules' extra state (``*._extra_state``) when the checkpoint has it."""
        native = self._load_model()
        if (self.checkpoint_dir / EXTRA_STATE_FILE).is_file():
            native.update(load_extra_state(self.checkpoint_dir / EXTRA_STATE_FILE))
        return {"model": native}

    def save_checkpoint(self, state_dict: Mapping[str, Any], step: int) -> Path:
        """Write ``output_dir/step_{step}``: ``state_dict["model"]`` in the input's format and layout, and
        ``state_dict["recipe_state"]`` (when given) as ``recipe_state.pt``.

        Everything about the model is checked before anything is written; the directory is
        committed atomically with a manifest; an existing ``step_{step}`` is never touched.
        """
        return self.save_to(state_dict, self.output_dir / f"step_{step}")

    def save_to(self, state_dict: Mapping[str, Any], target: str | os.PathLike,
                check: Callable[[Path], Any] | None = None) -> Path:
        """``save_checkpoint`` into a directory of your choosing (it must not exist yet). ``check(staged_dir)`` runs
        on the written files before they are committed (an ``ExportCheck``); if it raises, nothing is committed."""
        target = Path(target)
        write = self.writer(state_dict)
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

    def writer(self, state_dict: Mapping[str, Any]) -> Callable[[StagedDir], None]:
        """Check everything about ``state_dict`` now; return what writes it into a staged directory
        (the model in the format's files, the input's side files, extra state, recipe state).

        ``state_dict["model"]`` may be lazy (a sharded model's :class:`~waypoint.checkpointers.dtensor_state.GatheredState`):
        its tensors are read file by file, as each output file is written.
        """
        native, extra = split_extra_state(state_dict["model"])
        write_model = self._model_writer(native)

        files = dict(self.output_files)

        def write(stage: StagedDir) -> None:
            write_model(stage)
            self._copy_side_files(stage, skip=set(files))
            for name, data in files.items():
                stage.write_bytes(name, data)
            if extra:
                stage.write(EXTRA_STATE_FILE, lambda f: torch.save(extra, f))
            recipe_state = state_dict.get("recipe_state")
            if recipe_state is not None:
                if self.narrows(native):  # the files hold less than the model: resuming needs the model as it trained
                    recipe_state = recipe_state | {"model": dict(native)}
                stage.write(RECIPE_STATE_FILE, lambda f: torch.save(recipe_state, f))
        return write

    def _copy_side_files(self, stage: StagedDir, skip: set[str] = frozenset()) -> None:
        """The input's small non-weight files (tokenizer, generation config, README, ...), but those in ``skip``."""
        skip = {MANIFEST, RECIPE_STATE_FILE, EXTRA_STATE_FILE} | set(self.own_files) | set(skip)
        for src in sorted(self.checkpoint_dir.iterdir()):
            if (src.is_file() and src.name not in skip and not src.name.startswith(".")
                    and not src.name.endswith(WEIGHT_SUFFIXES) and src.stat().st_size <= SMALL_FILE_LIMIT):
                stage.copy_file(src)


def narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` to ``target`` can lose information (fp32 -> bf16 does, bf16 -> fp32 does not)."""
    widening = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float64),
                (torch.bfloat16, torch.float64), (torch.float16, torch.float64)}
    return source != target and (source, target) not in widening


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
