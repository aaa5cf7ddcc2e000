"""A run's plan, the same for every recipe: how many optimizer steps per epoch and in all, the global batch (and
how each process's share of it is made), the seed of the data order, and when a step checkpoint is due: at the
last step, on preemption (a signal on any rank), every ``save_every_n_steps`` and, with ``save_every_epoch``, at
each epoch's end; always at an optimizer-step boundary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunPlan:
    steps_per_epoch: int
    epochs: int
    batch_size: int  # samples per micro-batch, per process
    accumulate: int  # micro-batches per optimizer step (gradient_accumulation_steps)
    world_size: int  # processes
    seed: int
    save_every_n_steps: int = 0
    save_every_epoch: bool = False

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, all processes together."""
        return self.batch_size * self.accumulate * self.world_size

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def save_due(self, global_step: int, step_in_epoch: int, preempted: bool) -> bool:
        """Whether to save after ``global_step`` (the ``step_in_epoch``-th of its epoch, from 0)."""
        return (global_step == self.total_steps or preempted
                or (self.save_every_n_steps > 0 and global_step % self.save_every_n_steps == 0)
                or (self.save_every_epoch and self.epoch_done(step_in_epoch)))

    def epoch_done(self, step_in_epoch: int) -> bool:
        return step_in_epoch + 1 == self.steps_per_epoch

    def next_position(self, epoch: int, step_in_epoch: int) -> tuple[int, int]:
        """(epoch, step in the epoch) of the step after this one: where a resume from its checkpoint starts."""
        return (epoch + 1, 0) if self.epoch_done(step_in_epoch) else (epoch, step_in_epoch + 1)
