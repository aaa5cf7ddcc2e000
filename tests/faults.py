"""Faults injected into a recipe run, as a cluster would inflict them. Each is a context manager that patches the
run's own code for the length of the block and puts it back after, so the same fault serves a child process
(``tests/interrupt.py``) and a run in the test's own process (``tests/recipe_runs.py``, for the faults that do not
kill the process).

- ``signal-at-step K SIGNAL``: SIGNAL to this process right after optimizer step K is logged (a preemption mid-run).
- ``signal-twice K SIGNAL``: that, and SIGNAL again while step K's checkpoint files are being written.
- ``kill-in-save STEP MOMENT``: SIGKILL while step STEP's checkpoint is saved, at MOMENT: ``first-file`` (one weight
  file written), ``before-manifest`` (every file written, no manifest), ``before-rename`` (manifest written,
  directory not yet renamed) or ``after-rename`` (committed, parent not fsynced).
- ``kill-group-at-step K -``: SIGKILL to this process's group right after step K is logged; under torchrun that is
  rank 0 alone, and torchrun then stops the other ranks, as when a node dies.
- ``kill-in-upload STEP -``: SIGKILL once step STEP's first file is in the object store, before its manifest.
- ``kill-in-reference PAIRS -``: SIGKILL once a preference run's reference pass has done PAIRS pairs.
- ``kill-in-generation CALLS -``: SIGKILL as an online-RL run samples its CALLS-th micro-batch of prompts' groups.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from unittest import mock


def _send(name: str) -> Callable[[], None]:
    return lambda: os.kill(os.getpid(), getattr(signal, name))


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def after_step_logged(step: int, act: Callable[[], None]) -> Iterator[None]:
    """``act()`` right after the record of optimizer step ``step`` (the one with its loss) is written."""
    from waypoint.run.metrics import MetricsLog

    write = MetricsLog.write

    def patched(self, **record):
        write(self, **record)
        if record.get("step") == step and "loss" in record:
            act()
    with mock.patch.object(MetricsLog, "write", patched):
        yield


def signal_at_step(step: int, name: str) -> contextlib.AbstractContextManager:
    return after_step_logged(step, _send(name))


def kill_group_at_step(step: int, _: str) -> contextlib.AbstractContextManager:
    return after_step_logged(step, lambda: os.killpg(os.getpgid(0), signal.SIGKILL))


@contextlib.contextmanager
def signal_twice(step: int, name: str) -> Iterator[None]:
    import waypoint.checkpointers.commit as commit

    close = commit.HashingFile.close_durably
    sent = {"first": False}

    def first():
        sent["first"] = True
        _send(name)()

    def patched_close(self):
        if sent["first"]:
            _send(name)()
        return close(self)
    with after_step_logged(step, first), mock.patch.object(commit.HashingFile, "close_durably", patched_close):
        yield


@contextlib.contextmanager
def kill_in_save(target: int, moment: str) -> Iterator[None]:
    import waypoint.checkpointers.commit as commit
    from waypoint.run.savers import WholeStepSaver

    now = {"saving": False, "files": 0, "fsyncs": 0}
    save, close, commit_, fsync_dir = (WholeStepSaver.save, commit.HashingFile.close_durably, commit.StagedDir._commit,
                                       commit.fsync_dir)

    def patched_save(self, step, content, **kw):
        now.update(saving=step == target, files=0, fsyncs=0)
        return save(self, step, content, **kw)

    def patched_close(self):
        result = close(self)
        now["files"] += 1
        if now["saving"] and moment == "first-file" and now["files"] == 1:
            _kill()
        return result

    def patched_commit(self):
        if now["saving"] and moment == "before-manifest":
            _kill()
        commit_(self)

    def patched_fsync_dir(path):
        fsync_dir(path)
        if now["saving"]:
            now["fsyncs"] += 1
            if (moment, now["fsyncs"]) in (("before-rename", 1), ("after-rename", 2)):
                _kill()
    with (mock.patch.object(WholeStepSaver, "save", patched_save),
          mock.patch.object(commit.HashingFile, "close_durably", patched_close),
          mock.patch.object(commit.StagedDir, "_commit", patched_commit),
          mock.patch.object(commit, "fsync_dir", patched_fsync_dir)):
        yield


@contextlib.contextmanager
def kill_in_upload(target: int, _: str) -> Iterator[None]:
    from waypoint.run.object_store import ObjectStore

    send = ObjectStore.send  # every upload of a step's files goes through it (rank 0's, and each rank's shards)

    def patched(self, local, name, files):
        if name == f"step_{target}":
            put_file = self.fs.put_file

            def put_then_die(lpath, rpath, **kw):
                put_file(lpath, rpath, **kw)
                _kill()
            self.fs.put_file = put_then_die
        return send(self, local, name, files)
    with mock.patch.object(ObjectStore, "send", patched):
        yield


@contextlib.contextmanager
def kill_in_reference(pairs: int, _: str) -> Iterator[None]:
    from recipes import dpo_finetune

    reference_pass = dpo_finetune.reference_pass

    def patched(*args, progress=None, **kw):
        done = {"n": 0}

        def count(n):
            done["n"] += n
            if progress:
                progress(n)
            if done["n"] >= pairs:
                _kill()
        return reference_pass(*args, progress=count, **kw)
    with mock.patch.object(dpo_finetune, "reference_pass", patched):
        yield


@contextlib.contextmanager
def kill_in_generation(calls: int, _: str) -> Iterator[None]:
    from waypoint.training import grpo_step

    generate_groups = grpo_step.generate_groups
    done = {"n": 0}

    def patched(*args, **kw):  # one call a micro-batch's prompts
        done["n"] += 1
        if done["n"] == calls:
            _kill()
        return generate_groups(*args, **kw)
    with mock.patch.object(grpo_step, "generate_groups", patched):
        yield


FAULTS = {"signal-at-step": signal_at_step, "signal-twice": signal_twice, "kill-in-save": kill_in_save,
          "kill-group-at-step": kill_group_at_step, "kill-in-upload": kill_in_upload, "kill-in-reference": kill_in_reference,
          "kill-in-generation": kill_in_generation}


def kills(fault: list[str] | tuple[str, ...]) -> bool:
    """Whether ``fault`` ends the process (then it can only be tried in a child process)."""
    return bool(fault) and (fault[0].startswith("kill") or "SIGKILL" in fault)


def injected(fault: list[str] | tuple[str, ...] | None) -> contextlib.AbstractContextManager:
    """``[MODE, A, B]`` as the context manager that injects it (None or empty: nothing)."""
    if not fault:
        return contextlib.nullcontext()
    mode, a, b = fault
    return FAULTS[mode](int(a), b)
