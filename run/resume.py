"""Where a run starts, and what may change when it resumes.

``resume: auto`` (the default) continues from the newest ``output_dir/step_N`` whose manifest verifies, reporting and
setting aside corrupt ones; ``resume: false`` starts fresh; ``resume: <path>`` pins one checkpoint directory. The
recipe asks before it builds the model, and restores once the optimizer and scheduler exist:

    start = RunStart(run_dir, cfg.resume, cfg.overwrite, config, dist)   # which checkpoint; is the config compatible
    ...                                                                  # model, data, optimizer, scheduler
    position = start.restore(optimizer, scheduler, model, plan, say)     # (step, epoch, step in epoch), or None: done

A config change that makes the saved optimizer state, data position or model meaningless is refused in one line;
the others take effect from the resumed step, each with a note (optimizer and schedule settings are written into
the restored state), or are refused when they cannot.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from waypoint.checkpointers.commit import Verification, verify
from waypoint.checkpointers.sharded_checkpoint import SHARDED_DIR, holds_sharded_model
from waypoint.errors import CheckpointError
from waypoint.run.output_dir import RunDir
from waypoint.run.plan import RunPlan
from waypoint.run.recipe_state import (load_recipe_state, load_sharded_optimizer_state, load_whole_optimizer_state,
                                       restore_position)
from waypoint.run.step_dirs import remove_stale_staging, set_aside_earlier_run, set_aside_newer, step_dirs
from waypoint.run.store_run import sync_mirror

log = logging.getLogger(__name__)
AUTO = (True, "auto", "true", "True")  # resume= values that continue the newest verified step


class RunStart:
    """``checkpoint``: the verified step directory to continue (None: start from the input); ``state``: its
    ``recipe_state.pt``; ``changes``: the harmless config changes, (key, old, new). ``check(saved_config, config,
    path)`` refuses changes a recipe cannot resume across and returns the dotted prefixes it owns."""

    def __init__(self, run_dir: RunDir, resume: Any, overwrite: bool, config: Mapping[str, Any], dist,
                 check: Callable[[Mapping, Mapping, Path], tuple[str, ...]] | None = None) -> None:
        self.run_dir, self.overwrite, self.dist = run_dir, overwrite, dist
        output_dir = run_dir.path
        if run_dir.store:  # an object store: its committed steps are the truth, each machine's mirror follows
            dist.run_on_each_machine(lambda: sync_mirror(run_dir, resume, overwrite))
        self.checkpoint = dist.run_on_main(lambda: choose_checkpoint(output_dir, resume, overwrite))
        if self.checkpoint is not None and run_dir.store and resume in AUTO:
            # rank 0's newest step, in this machine's own mirror (another machine's cache may lie elsewhere)
            self.checkpoint = dataclasses.replace(self.checkpoint, path=output_dir / self.checkpoint.path.name)
        self.state = load_recipe_state(self.checkpoint.path) if self.checkpoint else None
        self.changes = check_config(self.state["config"], config, self.path) if self.state else []
        if self.state and check is not None:
            owned = check(self.state["config"], config, self.path)
            self.changes = [c for c in self.changes if not c[0].startswith(tuple(owned))]

    @property
    def path(self) -> Path | None:
        return self.checkpoint.path if self.checkpoint else None

    @property
    def sharded(self) -> bool:
        """Whether the checkpoint holds the model as torchrun's shards (read with ``load_sharded_into``)."""
        return self.checkpoint is not None and holds_sharded_model(self.checkpoint.path)

    def restore(self, optimizer, scheduler, model, plan: RunPlan, say: Callable[[str], None]) -> tuple[int, int, int] | None:
        """(global step, epoch, step in the epoch) to continue from, with the optimizer, scheduler and random
        states restored; (0, 0, 0) for a fresh run, whose ``output_dir`` is prepared only now (bad input found
        earlier leaves it as it was); None when the checkpoint is already the run's last step."""
        dist, state, output_dir = self.dist, self.state, self.run_dir.path
        if state is None:
            dist.run_on_main(lambda: start_fresh(output_dir, self.overwrite))
            dist.run_on_each_machine(lambda: remove_stale_staging(output_dir))
            return 0, 0, 0
        check_global_batch(state, plan, self.path)
        if state["global_step"] >= plan.total_steps:
            say(f"run already finished: {self.path} is step {state['global_step']} of {plan.total_steps}; nothing to do")
            return None
        if state.get("optimizer") is not None:
            load_whole_optimizer_state(model, optimizer, state["optimizer"])
        else:  # a torchrun checkpoint: the optimizer's tensors are in its shards
            load_sharded_optimizer_state(model, optimizer, self.path / SHARDED_DIR, state["optimizer_param_groups"])
        scheduler.load_state_dict(state["lr_scheduler"])
        apply_changes(optimizer, scheduler, self.changes)  # changed settings take effect now, or are refused
        global_step, epoch, step, lines = restore_position(state, dist.rank, dist.world_size, plan.global_batch)
        global_batch, steps_per_epoch = plan.global_batch, state["steps_per_epoch"]
        say(f"resuming from {self.path.name} (epoch {epoch}, sample {step * global_batch}/"
            f"{steps_per_epoch * global_batch}), {self.checkpoint.files} files verified, {self.checkpoint.bytes / 1e9:.2f} GB")
        for key, old, new in self.changes:
            say(f"note: {key}: {old} -> {new} (takes effect from step {global_step + 1})")
        for line in lines:
            say(line)
        dist.run_on_each_machine(lambda: remove_stale_staging(output_dir))
        return global_step, epoch, step


# Changing these makes the saved optimizer state, data position or model meaningless. batch_size and
# gradient_accumulation_steps may change as long as the global batch (their product times the number
# of processes) does not: check_global_batch.
BREAKING_KEYS = ("model", "checkpointer.checkpoint_dir", "checkpointer.checkpoint_files", "checkpointer.model_type",
                 "tokenizer", "dataset", "packed", "validation.fraction", "seed", "max_steps_per_epoch", "dtype", "optimizer._target_", "lr_scheduler._target_")
SCHEDULE_KEYS = ("optimizer.lr", "epochs")  # beside lr_scheduler.*: what a learning-rate schedule follows
# options added after checkpoints were written: a saved config without one had the option's default
# (reward_timeout: recipes/grpo_finetune.py's REWARD_TIMEOUT_S; a GRPO run from before it had no limit and resumes
# under the default, as a new run starts)
ADDED_DEFAULTS = {"packed": False, "validation": None, "reward_timeout": 120}


def refusing(keys: tuple[str, ...]) -> Callable[[Mapping, Mapping, Path], tuple[str, ...]]:
    """A ``RunStart`` check refusing a resume across a change of a recipe's own breaking ``keys`` (top-level
    sections or options, e.g. LoRA's ``lora``, ``quantize_base``, ``nf4``)."""
    def check(saved: Mapping, current: Mapping, checkpoint: Path) -> tuple[str, ...]:
        changed = [k for k in keys if saved.get(k) != current.get(k)]
        if changed:
            raise CheckpointError(f"cannot resume from {checkpoint}: the config changed {', '.join(changed)}; "
                                  "restore them, or start a new run with another output_dir (or resume=false overwrite=true)")
        return keys
    return check


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


def find_checkpoint(output_dir: str | Path, resume: Any) -> Verification | None:
    """The verified checkpoint to resume from, or None to start fresh."""
    if resume in (False, None, "false", "False", "no"):
        return None
    if resume not in AUTO:
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
    # an option added since, set to another value than its default: the old run had the default
    return [(k, before.get(k, ADDED_DEFAULTS.get(k, "<unset>") if k in after else "<unset>"), after.get(k, "<unset>"))
            for k in harmless if k not in ("resume", "overwrite")]


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


def check_global_batch(recipe_state: Mapping, plan: RunPlan, checkpoint: Path) -> None:
    """The samples per optimizer step must stay what they were, whatever the number of processes."""
    global_batch, batch_size, accumulate, world_size = plan.global_batch, plan.batch_size, plan.accumulate, plan.world_size
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


def start_fresh(output_dir: Path, overwrite: bool) -> None:
    """Refuse to mix a new run into a directory that holds an earlier run, unless told to replace it. What it
    replaces is set aside until this run commits a checkpoint of its own, and put back if it never does
    (``waypoint.run.step_dirs``)."""
    earlier = [p.name for p in step_dirs(output_dir)]
    if earlier and not overwrite:
        raise CheckpointError(f"output_dir {output_dir} already holds checkpoints ({', '.join(earlier)}); "
                              "resume=auto continues them; choose another output_dir or set overwrite=true to replace them")
    output_dir.mkdir(parents=True, exist_ok=True)
    set_aside_earlier_run(output_dir)
