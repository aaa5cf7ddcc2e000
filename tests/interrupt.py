"""Run recipes/full_finetune.py (recipes/lora_finetune.py with INTERRUPT_RECIPE=lora, recipes/dpo_finetune.py with
INTERRUPT_RECIPE=dpo) with a fault injected, as a cluster would inflict it.

    python tests/interrupt.py signal-at-step K SIGNAL -- <recipe args>
    python tests/interrupt.py signal-twice K SIGNAL -- <recipe args>
    python tests/interrupt.py kill-in-save STEP MOMENT -- <recipe args>
    torchrun ... tests/interrupt.py kill-group-at-step K - -- <recipe args>
    python tests/interrupt.py kill-in-upload STEP - -- <recipe args>   (an object-store output_dir)
    python tests/interrupt.py kill-in-reference PAIRS - -- <recipe args>   (recipes/dpo_finetune.py)

signal-at-step: sends SIGNAL to itself right after optimizer step K is logged (a
preemption arriving mid-run). kill-in-save: SIGKILLs itself while step STEP's
checkpoint is being saved, at MOMENT: ``first-file`` (one weight file written),
``before-manifest`` (every file written, no manifest), ``before-rename`` (manifest
written, directory not yet renamed) or ``after-rename`` (committed, parent not fsynced).
kill-in-reference: SIGKILLs itself once the reference pass of a preference run has done PAIRS pairs.
kill-group-at-step: SIGKILLs its own process group right after optimizer step K is logged; under
torchrun that is rank 0 alone, and torchrun then stops the other ranks, as when a node dies.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import waypoint.checkpointers.commit as commit  # noqa: E402
from waypoint.run.savers import WholeStepSaver  # noqa: E402
from recipes import dpo_finetune, full_finetune, lora_finetune  # noqa: E402
from waypoint.run.metrics import MetricsLog  # noqa: E402


def signal_at_step(step: int, name: str) -> None:
    write = MetricsLog.write

    def patched(self, **record):
        write(self, **record)
        if record["step"] == step:
            os.kill(os.getpid(), getattr(signal, name))

    MetricsLog.write = patched


def kill_group_at_step(step: int, _: str) -> None:
    write = MetricsLog.write

    def patched(self, **record):
        write(self, **record)
        if record["step"] == step:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    MetricsLog.write = patched


def signal_twice(step: int, name: str) -> None:
    """The signal at step K, and again while that checkpoint's files are being written."""
    signal_at_step(step, name)
    close = commit.HashingFile.close_durably
    write = MetricsLog.write
    sent = {"first": False}

    def patched_write(self, **record):
        sent["first"] = sent["first"] or record["step"] == step
        write(self, **record)

    def patched_close(self):
        if sent["first"]:
            os.kill(os.getpid(), getattr(signal, name))
        return close(self)

    MetricsLog.write = patched_write
    commit.HashingFile.close_durably = patched_close


def kill_in_save(target: int, moment: str) -> None:
    saving = {"now": False}
    files = {"n": 0}
    calls = {"n": 0}
    save = WholeStepSaver.save

    def patched_save(self, step, content, **kw):
        saving["now"] = step == target
        files["n"] = calls["n"] = 0
        return save(self, step, content, **kw)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    close = commit.HashingFile.close_durably

    def patched_close(self):
        result = close(self)
        files["n"] += 1
        if saving["now"] and moment == "first-file" and files["n"] == 1:
            die()
        return result

    commit_ = commit.StagedDir._commit

    def patched_commit(self):
        if saving["now"] and moment == "before-manifest":
            die()
        commit_(self)

    fsync_dir = commit.fsync_dir

    def patched_fsync_dir(path):
        fsync_dir(path)
        if saving["now"]:
            calls["n"] += 1
            if (moment, calls["n"]) in (("before-rename", 1), ("after-rename", 2)):
                die()

    WholeStepSaver.save = patched_save
    commit.HashingFile.close_durably = patched_close
    commit.StagedDir._commit = patched_commit
    commit.fsync_dir = patched_fsync_dir


def kill_in_upload(target: int, _: str) -> None:
    """SIGKILL once step ``target``'s first file is in the object store, before its manifest."""
    from waypoint.run.object_store import ObjectStore

    send = ObjectStore.send  # every upload of a step's files goes through it (rank 0's, and each rank's shards)

    def patched(self, local, name, files):
        if name == f"step_{target}":
            put_file = self.fs.put_file

            def put_then_die(lpath, rpath, **kw):
                put_file(lpath, rpath, **kw)
                os.kill(os.getpid(), signal.SIGKILL)
            self.fs.put_file = put_then_die
        return send(self, local, name, files)

    ObjectStore.send = patched


def kill_in_reference(pairs: int, _: str) -> None:
    """SIGKILL once the reference pass has done ``pairs`` pairs."""
    reference_pass = dpo_finetune.reference_pass

    def patched(*args, progress=None, **kw):
        done = {"n": 0}

        def count(n):
            done["n"] += n
            if progress:
                progress(n)
            if done["n"] >= pairs:
                os.kill(os.getpid(), signal.SIGKILL)
        return reference_pass(*args, progress=count, **kw)

    dpo_finetune.reference_pass = patched


if __name__ == "__main__":
    mode, a, b, sep, *recipe_args = sys.argv[1:]
    assert sep == "--", "usage: interrupt.py MODE A B -- <recipe args>"
    {"signal-at-step": signal_at_step, "signal-twice": signal_twice, "kill-in-save": kill_in_save,
     "kill-group-at-step": kill_group_at_step, "kill-in-upload": kill_in_upload,
     "kill-in-reference": kill_in_reference}[mode](int(a), b)
    recipe = {"lora": lora_finetune, "dpo": dpo_finetune}.get(os.environ.get("INTERRUPT_RECIPE"), full_finetune)
    sys.exit(recipe.main(recipe_args))
