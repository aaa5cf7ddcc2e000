"""Which checkpoint a run continues from, and whether the config still fits it.

``resume: auto`` (the default) continues from the newest ``output_dir/step_N`` whose
manifest verifies, reporting and skipping corrupt ones; ``resume: false`` starts
fresh; ``resume: <path>`` pins one checkpoint directory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from waypoint.checkpointers.commit import STEP_DIR, Verification, step_dirs, verify
from waypoint.checkpointers.retention import set_aside_earlier_run
from waypoint.errors import CheckpointError

log = logging.getLogger(__name__)

# Changing these makes the saved optimizer state, data position or model meaningless. batch_size and
# gradient_accumulation_steps may change as long as the global batch (their product times the number
# of processes) does not: check_global_batch.
BREAKING_KEYS = ("model", "checkpointer.checkpoint_dir", "checkpointer.checkpoint_files", "checkpointer.model_type",
                 "tokenizer", "dataset", "packed", "validation.fraction", "seed", "max_steps_per_epoch", "dtype", "optimizer._target_", "lr_scheduler._target_")
SCHEDULE_KEYS = ("optimizer.lr", "epochs")  # beside lr_scheduler.*: what a learning-rate schedule follows
# options added after checkpoints were written: a saved config without one had the option's default
ADDED_DEFAULTS = {"packed": False, "validation": None}


def choose_checkpoint(output_dir: str | Path, resume: Any, overwrite: bool) -> Verification | None:
    """``find_checkpoint``, with the checkpoints after the chosen one set aside (renamed ``.corrupt`` under
    ``resume=auto``, ``.superseded`` when a path was pinned), and a directory whose checkpoints all fail
    verification refused unless ``overwrite``."""
    found = find_checkpoint(output_dir, resume)
    if found:
        set_aside_newer(output_dir, found.path, "corrupt" if resume in (True, "auto") else "superseded")
    elif resume not in (False, "false") and step_dirs(output_dir) and not overwrite:
        raise CheckpointError(f"output_dir {output_dir} holds checkpoints but none verifies; "
                              "set resume=<path> to pick one or overwrite=true to start again")
    return found


def restore_position(recipe_state: Mapping, rank: int, world_size: int, global_batch: int) -> tuple[int, int, int, list[str]]:
    """Restore this rank's random states; return (global step, epoch, step in the epoch, lines to print).

    The position is kept in samples of the epoch's permutation, so it holds on another number of
    processes with the same global batch; random states then continue from rank 0's."""
    from waypoint.training.rng_state import restore_rng

    rng_states = recipe_state.get("rng_per_rank") or [recipe_state["rng"]]
    same_world = len(rng_states) == world_size
    restore_rng(rng_states[rank] if same_world else rng_states[0])
    position = recipe_state["data_position"]
    samples = position.get("samples_seen_in_epoch", recipe_state["step_in_epoch"] * global_batch)
    lines = [] if same_world else [f"note: {len(rng_states)} -> {world_size} processes: same samples per step; "
                                   "random states continue from rank 0's"]
    return recipe_state["global_step"], recipe_state["epoch"], samples // global_batch, lines


def find_checkpoint(output_dir: str | Path, resume: Any) -> Verification | None:
    """The verified checkpoint to resume from, or None to start fresh."""
    if resume in (False, None, "false", "False", "no"):
        return None
    if resume not in (True, "auto", "true", "True"):
        checked = verify(resume)
        if not checked.ok:
            raise CheckpointError(f"resume={resume}: not a usable checkpoint ({checked.problem})")
        return checked
    for path in step_dirs(output_dir):
        checked = verify(path)
        if checked.ok:
            return checked
        log.warning("skipping %s: %s", path, checked.problem)
        print(f"warning: skipping {path.name}: {checked.problem}")
    return None


def _flatten(config: Mapping, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: Mapping, current: Mapping) -> tuple[list[str], list[str]]:
    """(breaking, harmless) dotted keys whose values differ between the saved and the current config."""
    before, after = {**ADDED_DEFAULTS, **_flatten(saved)}, {**ADDED_DEFAULTS, **_flatten(current)}
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k, "<unset>") != after.get(k, "<unset>"))
    breaking = [k for k in changed if any(k == b or k.startswith(b + ".") for b in BREAKING_KEYS)]
    return breaking, [k for k in changed if k not in breaking]


def check_config(saved: Mapping, current: Mapping, checkpoint: Path) -> list[tuple[str, Any, Any]]:
    """Raise on changes that break resuming from ``checkpoint``; return the others as (key, old, new). They all
    take effect from the resumed step on: optimizer and scheduler settings through :func:`apply_changes`."""
    breaking, harmless = config_changes(saved, current)
    if breaking:
        raise CheckpointError(f"cannot resume from {checkpoint}: the config changed {', '.join(breaking)}; "
                              "restore them, or start a new run with another output_dir (or resume=false overwrite=true)")
    before, after = _flatten(saved), _flatten(current)
    return [(k, before.get(k, "<unset>"), after.get(k, "<unset>")) for k in harmless if k not in ("resume", "overwrite")]


def apply_changes(optimizer: Optimizer, scheduler: LRScheduler, changes: list[tuple[str, Any, Any]]) -> None:
    """After the optimizer and scheduler states are restored (which brings back the checkpoint's settings): the
    changed ``optimizer.*`` settings go into every param group, and a LambdaLR-family scheduler (``warmup_cosine``)
    recomputes the learning rate for the resumed step from the new ``lr`` and schedule. A change that cannot
    take effect is refused in one line, never accepted and ignored."""
    for key, old, new in changes:
        name = key.removeprefix("optimizer.")
        if name == key:
            continue
        if any(name not in group for group in optimizer.param_groups):
            raise CheckpointError(f"{key}: {old} -> {new} has no place in the restored {type(optimizer).__name__} state; "
                                  "restore it, or start a new run with another output_dir")
        for group in optimizer.param_groups:
            group[name] = tuple(new) if isinstance(group[name], tuple) else new
            if name == "lr":
                group["initial_lr"] = new
    if not changes:
        return
    if isinstance(scheduler, LambdaLR):
        scheduler.base_lrs = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
        lrs = [base * factor(scheduler.last_epoch) for factor, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs
    elif any(k in SCHEDULE_KEYS or k.startswith("lr_scheduler.") for k, _, _ in changes):
        changed = ", ".join(k for k, _, _ in changes if k in SCHEDULE_KEYS or k.startswith("lr_scheduler."))
        raise CheckpointError(f"{changed} changed, which {type(scheduler).__name__} cannot take up on resume; restore "
                              "it, or start a new run with another output_dir")


def check_global_batch(recipe_state: Mapping, global_batch: int, batch_size: int, accumulate: int, world_size: int,
                       checkpoint: Path) -> None:
    """The samples per optimizer step must stay what they were, whatever the number of processes."""
    saved = recipe_state["data_position"].get("global_batch_size")
    if saved is None:  # written before global batches were recorded: one process
        saved_config = recipe_state["config"]
        saved = saved_config["batch_size"] * saved_config["gradient_accumulation_steps"] * recipe_state.get("world_size", 1)
    if saved != global_batch:
        hint = f"gradient_accumulation_steps={saved // (batch_size * world_size)}" if saved % (batch_size * world_size) == 0 else "batch_size"
        raise CheckpointError(
            f"cannot resume from {checkpoint}: its global batch is {saved} samples per step, this run's is {global_batch} "
            f"(batch_size {batch_size} x gradient_accumulation_steps {accumulate} x {world_size} processes); "
            f"set {hint} to keep it")


def set_aside_newer(output_dir: str | Path, chosen: Path, suffix: str) -> list[Path]:
    """Rename the checkpoints after ``chosen`` to ``step_N.<suffix>`` (they failed verification, or the user
    pinned an earlier one), so the resumed run can write its own ``step_N`` and nothing is deleted."""
    chosen_step = int(STEP_DIR.match(Path(chosen).name).group(1)) if STEP_DIR.match(Path(chosen).name) else -1
    moved = []
    for path in step_dirs(output_dir):
        if int(STEP_DIR.match(path.name).group(1)) <= chosen_step or path.resolve() == Path(chosen).resolve():
            continue
        target, n = path.with_name(f"{path.name}.{suffix}"), 1
        while target.exists():
            target, n = path.with_name(f"{path.name}.{suffix}{n}"), n + 1
        path.rename(target)
        moved.append(target)
    return moved


def start_fresh(output_dir: Path, overwrite: bool) -> None:
    """Refuse to mix a new run into a directory that holds an earlier run, unless told to replace it. What it
    replaces is set aside until this run commits a checkpoint of its own, and put back if it never does
    (``checkpointers.retention``)."""
    earlier = [p.name for p in step_dirs(output_dir)]
    if earlier and not overwrite:
        raise CheckpointError(f"output_dir {output_dir} already holds checkpoints ({', '.join(earlier)}); "
                              "resume=auto continues them; choose another output_dir or set overwrite=true to replace them")
    output_dir.mkdir(parents=True, exist_ok=True)
    set_aside_earlier_run(output_dir)
