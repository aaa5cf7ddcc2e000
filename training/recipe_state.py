"""recipe_state.pt: everything beside the model that an exact resume needs.

Tensors and plain Python values only, so it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from waypoint.checkpointers.base import RECIPE_STATE_FILE
from waypoint.checkpointers.file_formats import load_pickle
from waypoint.errors import CheckpointError
from waypoint.training.rng_state import capture_rng

FORMAT_VERSION = 1
# Import names before everything moved under `waypoint` (a saved config's `_target_: checkpointers.build_model`).
LEGACY_PACKAGES = ("checkpointers.", "converters.", "models.", "training.")
# builders and config readers that moved into their family's file (waypoint.families.<family>)
MOVED = {f"waypoint.models.{name}": f"waypoint.families.{family}.{name}" for family, names in (
    ("llama", ("llama2_7b", "llama2_13b", "llama2_70b", "llama3_8b", "llama3_1_8b")), ("mistral", ("mistral_7b",)),
    ("qwen2", ("qwen2_7b",)), ("gemma", ("gemma_2b", "gemma_7b")), ("phi3", ("phi3_mini_4k",))) for name in names}
MOVED["waypoint.models.from_hf_config"] = "waypoint.families.from_hf_config"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class RecipeState:
    """The state to resume from. ``epoch``/``step_in_epoch`` name the next optimizer step to take; the data
    position is kept in samples of the epoch's permutation, so it holds on another number of processes.

    ``optimizer``: the whole optimizer state dict, or None when a sharded checkpoint's files hold its tensors
    (then ``optimizer_param_groups`` holds the rest); ``rng``: rank 0's random states, ``rng_per_rank`` every
    rank's under torchrun. Saved as a plain dict (``as_dict``), so it loads with ``weights_only=True``."""

    global_step: int
    epoch: int
    step_in_epoch: int
    steps_per_epoch: int
    total_steps: int
    epochs: int
    seed: int
    global_batch: int
    config: dict
    lr_scheduler: dict
    optimizer: dict | None
    rng: dict | None
    world_size: int = 1
    rng_per_rank: list | None = None
    optimizer_param_groups: list | None = None

    def as_dict(self) -> dict[str, Any]:
        plain = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "global_batch"}
        plain = {k: v for k, v in plain.items() if v is not None or k in ("optimizer", "rng")}
        return {"format_version": FORMAT_VERSION} | plain | {
            "data_position": {"epoch": self.epoch, "samples_seen_in_epoch": self.step_in_epoch * self.global_batch,
                              "global_batch_size": self.global_batch, "permutation_seed": self.seed},
            "versions": {"waypoint": _version("waypoint"), "torch": str(torch.__version__)}}


def capture_recipe_state(plan, global_step: int, epoch: int, step_in_epoch: int, scheduler, config: dict,
                         dist) -> RecipeState:
    """The recipe state after ``global_step`` (the ``step_in_epoch``-th of ``epoch``), for the checkpoint saved
    there: the next position, the scheduler, every rank's random states (a collective under torchrun). The
    optimizer state is added by what writes the step (whole, or in a sharded checkpoint's files)."""
    next_epoch, next_step = plan.next_position(epoch, step_in_epoch)
    rng = dist.gather(capture_rng())
    return RecipeState(global_step=global_step, epoch=next_epoch, step_in_epoch=next_step,
                       steps_per_epoch=plan.steps_per_epoch, total_steps=plan.total_steps, epochs=plan.epochs,
                       seed=plan.seed, global_batch=plan.global_batch, config=config,
                       lr_scheduler=scheduler.state_dict(), optimizer=None, rng=rng[0] if rng else None,
                       world_size=dist.world_size, rng_per_rank=rng if dist.enabled else None)


def load_recipe_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / RECIPE_STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {checkpoint_dir} is a model checkpoint, not a resumable one")
    state = load_pickle(path)  # memory-mapped: optimizer tensors are paged in on use
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a recipe state (a {type(state).__name__})")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {state.get('format_version')!r}, expected {FORMAT_VERSION}")
    state["config"] = current_names(state.get("config") or {})
    return state


def current_name(target: str) -> str:
    """``models.x`` -> ``waypoint.models.x``; a builder that moved -> its family's (``waypoint.families.llama.llama2_7b``)."""
    target = "waypoint." + target if target.startswith(LEGACY_PACKAGES) else target
    return MOVED.get(target, target)


def current_names(config: Any) -> Any:
    """A saved config with each ``_target_`` under its current import name (see ``current_name``)."""
    if isinstance(config, dict):
        return {k: (current_name(v) if k == "_target_" and isinstance(v, str) else current_names(v)) for k, v in config.items()}
    if isinstance(config, list):
        return [current_names(v) for v in config]
    return config
