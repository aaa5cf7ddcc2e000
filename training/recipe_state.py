"""recipe_state.pt: everything beside the model that an exact resume needs.

Tensors and plain Python values only, so it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from waypoint.checkpointers.base import RECIPE_STATE_FILE
from waypoint.checkpointers.file_formats import load_pickle
from waypoint.errors import CheckpointError
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


def build_recipe_state(*, optimizer, lr_scheduler, global_step: int, epoch: int, step_in_epoch: int,
                       steps_per_epoch: int, total_steps: int, seed: int, epochs: int, data_position: dict,
                       rng: dict, config: dict, **more: Any) -> dict[str, Any]:
    """The state to resume from: ``epoch``/``step_in_epoch`` name the next optimizer step to take.

    ``optimizer``: an optimizer, its state dict, or None when a sharded checkpoint holds its tensors;
    ``more``: further plain entries (``rng_per_rank``, ``optimizer_param_groups``, ``world_size``).
    """
    return {
        "format_version": FORMAT_VERSION,
        "optimizer": optimizer if optimizer is None or isinstance(optimizer, dict) else optimizer.state_dict(),
        "lr_scheduler": lr_scheduler.state_dict(),
        "global_step": global_step,
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
        "epochs": epochs,
        "seed": seed,
        "data_position": data_position,
        "rng": rng,
        "config": config,
        "versions": {"waypoint": _version("waypoint"), "torch": str(torch.__version__)},
    } | more


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
