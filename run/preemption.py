"""Preemption: a signal asks for a checkpoint at the next optimizer-step boundary, then a clean exit.

The handler only sets a flag, so a signal never interrupts a save half way; a
second signal during the save is absorbed the same way. Under SLURM with
``requeue`` the job puts itself back in the queue before exiting.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", distinct from success (0) and errors (1)


class PreemptionWatch:
    def __init__(self, signals: list[str] | tuple[str, ...] = ("SIGTERM", "SIGUSR1")) -> None:
        self.received: str | None = None
        self._previous = {}
        for name in signals:
            if not hasattr(signal, name):
                raise ValueError(f"preemption_signals: unknown signal {name!r}")
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def requeue_slurm_job() -> bool:
    """``scontrol requeue $SLURM_JOB_ID``; False (with a log line) when not under SLURM or it fails."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        log.warning("requeue requested but SLURM_JOB_ID is not set; not requeueing")
        return False
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("scontrol requeue %s failed: %s", job, e)
        return False
    return True
