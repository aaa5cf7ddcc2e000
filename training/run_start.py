"""Where a run starts, shared by the recipes: the newest verified checkpoint of ``output_dir`` (``resume=auto``),
a pinned one (``resume=<path>``), or the input, with the config checked against the checkpoint's.

    start = RunStart(cfg, config, dist)                 # before the model: which checkpoint, is the config compatible
    ...                                                 # model, data, optimizer, scheduler
    position = start.restore(optimizer, scheduler, model, global_batch, total_steps, say)
    if position is None: return 0                       # that run already finished
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from waypoint.checkpointers.commit import remove_stale_staging
from waypoint.checkpointers.sharded_checkpoint import SHARDED_DIR, holds_sharded_model
from waypoint.training.object_store_run import sync_mirror
from waypoint.training.optimizer_state import load_sharded_optimizer_state, load_whole_optimizer_state
from waypoint.training.recipe_state import load_recipe_state
from waypoint.training.resume import (apply_changes, check_config, check_global_batch, choose_checkpoint, restore_position,
                                      start_fresh)


class RunStart:
    """``checkpoint``: the verified step directory to continue (None: start from the input); ``state``: its
    ``recipe_state.pt``; ``changes``: the harmless config changes, (key, old, new). ``check(saved_config,
    config, path)`` refuses changes a recipe cannot resume across and returns the dotted prefixes it owns."""

    def __init__(self, cfg, config: Mapping[str, Any], dist,
                 check: Callable[[Mapping, Mapping, Path], tuple[str, ...]] | None = None) -> None:
        self.cfg, self.dist, self.output_dir = cfg, dist, Path(cfg.output_dir)
        if cfg.get("output_store"):  # an object store: its committed steps are the truth, each machine's mirror follows
            dist.run_on_each_machine(lambda: sync_mirror(cfg))
        self.checkpoint = dist.run_on_main(lambda: choose_checkpoint(self.output_dir, cfg.resume, cfg.overwrite))
        if self.checkpoint is not None and cfg.get("output_store") and cfg.resume in (True, "auto", "true", "True"):
            # rank 0's newest step, in this machine's own mirror (another machine's cache may lie elsewhere)
            self.checkpoint = dataclasses.replace(self.checkpoint, path=self.output_dir / self.checkpoint.path.name)
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

    def restore(self, optimizer, scheduler, model, global_batch: int, total_steps: int,
                say: Callable[[str], None]) -> tuple[int, int, int] | None:
        """(global step, epoch, step in the epoch) to continue from, with the optimizer, scheduler and random
        states restored; (0, 0, 0) for a fresh run, whose ``output_dir`` is prepared only now (bad input found
        earlier leaves it as it was); None when the checkpoint is already the run's last step."""
        dist, state = self.dist, self.state
        if state is None:
            dist.run_on_main(lambda: start_fresh(self.output_dir, self.cfg.overwrite))
            dist.run_on_each_machine(lambda: remove_stale_staging(self.output_dir))
            return 0, 0, 0
        check_global_batch(state, global_batch, self.cfg.batch_size, self.cfg.gradient_accumulation_steps,
                           dist.world_size, self.path)
        if state["global_step"] >= total_steps:
            say(f"run already finished: {self.path} is step {state['global_step']} of {total_steps}; nothing to do")
            return None
        if state.get("optimizer") is not None:
            load_whole_optimizer_state(model, optimizer, state["optimizer"])
        else:  # a torchrun checkpoint: the optimizer's tensors are in its shards
            load_sharded_optimizer_state(model, optimizer, self.path / SHARDED_DIR, state["optimizer_param_groups"])
        scheduler.load_state_dict(state["lr_scheduler"])
        apply_changes(optimizer, scheduler, self.changes)  # changed settings take effect now, or are refused
        global_step, epoch, step, lines = restore_position(state, dist.rank, dist.world_size, global_batch)
        steps_per_epoch = state["steps_per_epoch"]
        say(f"resuming from {self.path.name} (epoch {epoch}, sample {step * global_batch}/"
            f"{steps_per_epoch * global_batch}), {self.checkpoint.files} files verified, {self.checkpoint.bytes / 1e9:.2f} GB")
        for key, old, new in self.changes:
            say(f"note: {key}: {old} -> {new} (takes effect from step {global_step + 1})")
        for line in lines:
            say(line)
        dist.run_on_each_machine(lambda: remove_stale_staging(self.output_dir))
        return global_step, epoch, step
