"""The step saver a run's config asks for: whole files written by rank 0 (one process; LoRA's adapters under
torchrun) or every rank's DCP shards (a full fine-tune under torchrun), synchronous or with
``async_checkpoint: true`` in the background; each uploaded to an object-store ``output_dir`` once committed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from waypoint.checkpointers.sharded_saver import ShardedSaver
from waypoint.checkpointers.step_saver import StepSaver, WholeStepSaver
from waypoint.training.object_store_run import StorePublisher


def step_saver(cfg, dist, sharded: bool, report: Callable[[str], None]) -> StepSaver:
    kind = ShardedSaver if sharded and dist.enabled else WholeStepSaver
    report = report if dist.is_main else (lambda line: None)
    saver = kind(dist, Path(cfg.output_dir), cfg.keep_last_n_checkpoints, bool(cfg.get("async_checkpoint", False)),
                 report=report)
    if cfg.get("output_store"):  # each step, once committed in the local mirror, is uploaded (rank 0)
        saver.publish = StorePublisher(cfg.output_store, Path(cfg.output_dir), cfg.keep_last_n_checkpoints, report)
    return saver
