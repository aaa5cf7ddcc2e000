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
from waypoint.converters.errors import CheckpointError

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

    def __init__(self, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.output_dir = Path(output_dir)
        if not self.checkpoint_dir.is_dir():
            raise CheckpointError(f"{self.checkpoint_dir}: checkpoint directory not found")

    # -- to implement -------------------------------------------------------------
    def _load_model(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _model_writer(self, native: Mapping[str, torch.Tensor]) -> Callable[[StagedDir], None]:
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------
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

    def save_to(self, state_dict: Mapping[str, Any], target: str | os.PathLike) -> Path:
        """``save_checkpoint`` into a directory of your choosing (it must not exist yet)."""
        target = Path(target)
        write = self.writer(state_dict)
        try:
            with StagedDir(target) as stage:
                write(stage)
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

        def write(stage: StagedDir) -> None:
            write_model(stage)
            self._copy_side_files(stage)
            if extra:
                stage.write(EXTRA_STATE_FILE, lambda f: torch.save(extra, f))
            if state_dict.get("recipe_state") is not None:
                stage.write(RECIPE_STATE_FILE, lambda f: torch.save(state_dict["recipe_state"], f))
        return write

    def _copy_side_files(self, stage: StagedDir) -> None:
        """The input's small non-weight files (tokenizer, generation config, README, ...)."""
        skip = {MANIFEST, RECIPE_STATE_FILE, EXTRA_STATE_FILE} | set(self.own_files)
        for src in sorted(self.checkpoint_dir.iterdir()):
            if (src.is_file() and src.name not in skip and not src.name.startswith(".")
                    and not src.name.endswith(WEIGHT_SUFFIXES) and src.stat().st_size <= SMALL_FILE_LIMIT):
                stage.copy_file(src)
