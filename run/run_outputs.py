"""What a training recipe's run writes, from its first step to its last line: metrics.jsonl, TensorBoard and the
experiment trackers (rank 0), its step checkpoints, and how it ends, finished or stopped by a signal.

Each recipe keeps its own loop, loss, record and save(); this is the part they all share around them: the step
boundary (a failed background save stops the run, a checkpoint when one is due or a signal arrived on any rank), the
preempted stop (exit code 75, the job requeued on request) and the closing of the saver, the progress and the logs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from tqdm import tqdm

from waypoint.run.metrics import MetricsLog
from waypoint.run.output_dir import RunDir
from waypoint.run.plan import RunPlan
from waypoint.run.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch, requeue_slurm_job
from waypoint.run.progress import TrainingProgress
from waypoint.run.savers import SaveOptions, StepSaver, WholeStepSaver
from waypoint.run.sharded_saver import ShardedSaver
from waypoint.run.step_content import MERGED_DIR, ExportReload
from waypoint.run.trackers import Trackers, kept_at, open_trackers


class RunOutputs:
    """A run's logs and checkpoints. ``trackers`` and ``metrics``: rank 0's (None elsewhere); ``saver``: whole
    steps, or under torchrun each rank's DCP shards with one process writing the model in the input's files
    (``sharded``); ``verify``: how an export is read back before its commit (None with ``verify_export: false``);
    ``saved``: the newest step directory this run wrote, ``saved_step`` its step (the resumed one before any)."""

    def __init__(self, cfg, config: Mapping[str, Any], run_dir: RunDir, start, dist, global_step: int, sharded: bool,
                 say: Callable[[str], None]) -> None:
        self.run_dir, self.dist, self.say, self.requeue = run_dir, dist, say, cfg.requeue
        # rank 0 logs: metrics.jsonl, TensorBoard (log_dir) and the experiment trackers (metric_loggers), a resumed
        # run's own
        self.trackers: Trackers | None = open_trackers(
            cfg.get("metric_loggers"), config, (start.state or {}).get("trackers"), run_dir.path, global_step,
            tqdm.write) if dist.is_main else None
        self.metrics = MetricsLog(run_dir.path, keep_through_step=global_step, report=tqdm.write,
                                  tensorboard_dir=cfg.get("log_dir"), trackers=self.trackers) if dist.is_main else None
        saving = SaveOptions(keep_last_n=cfg.keep_last_n_checkpoints, asynchronous=cfg.get("async_checkpoint", False))
        self.saver: StepSaver = (ShardedSaver if sharded else WholeStepSaver)(dist, run_dir, saving, report=tqdm.write)
        # the final (LoRA: merged) model read back, before its commit, into a fresh model of the config's class
        # through its checkpointer
        reload = ExportReload(
            build=lambda: instantiate(cfg.model), strict=cfg.strict, key_prefix_map=cfg.key_prefix_map,
            read=lambda path: instantiate(cfg.checkpointer, checkpoint_dir=str(path)).load_checkpoint()["model"])
        self.verify = reload if cfg.get("verify_export", True) else None
        self.saved: Path | None = None
        self.saved_step = global_step
        self._saves_closed = False

    def step_end(self, plan: RunPlan, global_step: int, epoch: int, step_in_epoch: int, preemption: PreemptionWatch,
                 save: Callable[[int, int, bool, bool], Path]) -> bool:
        """At an optimizer-step boundary: raise a background save's error, ``save(epoch, step_in_epoch, final,
        preempted)`` when the plan has one due or a signal reached any rank; True when that signal stops the run here
        (then return ``stop()``)."""
        self.saver.check()  # a background save that failed stops the run here
        preempted = self.dist.any(preemption.requested)
        if plan.save_due(global_step, step_in_epoch, preempted):
            self.saved = save(epoch, step_in_epoch, global_step == plan.total_steps, preempted)
            self.saved_step = global_step
        return preempted and global_step < plan.total_steps

    def stop(self, global_step: int, preemption: PreemptionWatch, progress: TrainingProgress) -> int:
        """The preempted run's end: the saves on disk, the trackers' runs left stopped (preempted) for the resumed run
        to continue, the line that says how to resume, the Slurm job requeued (``requeue``); the exit code."""
        self.saver.close()
        progress.close()
        if self.metrics:
            self.metrics.close()
        self.say(f"stopped by {preemption.received or 'a signal to another rank'} at step {global_step}; "
                 "rerun the same command to resume")
        if self.requeue and self.dist.is_main:
            requeue_slurm_job()
        return PREEMPTED_EXIT_CODE

    def close_saves(self) -> None:
        """Wait for the save in flight (a finished run's, before ``finish``)."""
        if not self._saves_closed:
            self.saver.close()
            self._saves_closed = True

    def finish(self, progress: TrainingProgress) -> None:
        """The finished run's saves, progress and logs closed; the trackers record where its final model is kept."""
        self.close_saves()
        progress.close()
        if self.metrics:
            self.metrics.close(final_model=kept_at(self.run_dir, self.saved))

    def done_line(self, checkpointer, adapter: bool) -> str:
        """The run's last line: where its final model (``adapter``: the PEFT adapter, and its merged model if it wrote
        one) is."""
        saved, stored = self.saved, self.run_dir.stored_at(self.saved)
        if not adapter:
            return f"done: the final model is {stored}{checkpointer.describe_output(saved)}"
        return f"done: the adapter is {stored}{saved} (PEFT format){merged_note(checkpointer, saved)}"


def merged_note(checkpointer, saved: Path) -> str:
    """"; the merged model is ..." when step ``saved`` holds one, else ""."""
    merged = saved / MERGED_DIR
    return f"; the merged model is {checkpointer.describe_output(merged)}" if merged.is_dir() else ""
