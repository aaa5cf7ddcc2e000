"""Which step directories of an ``output_dir`` go, and when: never before a newer checkpoint is committed.

- Retention: :func:`prune_checkpoints`, called after each commit, deletes all but the newest
  ``keep_last_n_checkpoints`` verified checkpoints.
- Overwrite: a run started with ``resume=false overwrite=true`` moves the earlier run's ``step_N``
  directories and ``metrics.jsonl`` into a hidden ``.overwritten-<pid>`` directory
  (:func:`set_aside_earlier_run`). They are deleted once the new run has committed a checkpoint of its
  own (by :func:`prune_checkpoints`) and put back when it ends without one (:func:`settle_overwritten`,
  at the end of a run and at the start of the next, which covers a run that was killed).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from waypoint.checkpointers.commit import fsync_dir, step_dirs, verify
from waypoint.errors import CheckpointError

METRICS_FILE = "metrics.jsonl"
OVERWRITTEN = ".overwritten-"
COMPLETE = ".complete"  # in an .overwritten-<pid> directory: everything has been moved in


def prune_checkpoints(output_dir: str | os.PathLike, keep_last_n: int | None) -> list[Path]:
    """After a commit: delete all but the newest ``keep_last_n`` verified checkpoints (None keeps all), and
    an overwritten run's checkpoints, now that this run has one. Directories that do not verify stay."""
    settle_overwritten(output_dir)
    if not keep_last_n:
        return []
    if keep_last_n < 1:
        raise CheckpointError(f"keep_last_n_checkpoints must be at least 1, got {keep_last_n}")
    verified = [p for p in step_dirs(output_dir) if verify(p, hash_contents=False).ok]
    doomed = verified[keep_last_n:]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def set_aside_earlier_run(output_dir: str | os.PathLike) -> Path | None:
    """Move the earlier run's ``step_N`` directories and ``metrics.jsonl`` into ``.overwritten-<pid>``; the
    directory moved into, or None when there was nothing to move. A marker written once everything has moved
    tells :func:`settle_overwritten` that a ``step_N`` beside it is the new run's (a kill half way through leaves
    no marker, and the next run puts everything back)."""
    output_dir = Path(output_dir)
    earlier = step_dirs(output_dir) + [p for p in [output_dir / METRICS_FILE] if p.is_file()]
    if not earlier:
        return None
    aside = output_dir / f"{OVERWRITTEN}{os.getpid()}"
    aside.mkdir(exist_ok=True)
    for path in earlier:
        path.rename(aside / path.name)
    fsync_dir(output_dir)
    (aside / COMPLETE).touch()
    fsync_dir(aside)
    return aside


def settle_overwritten(output_dir: str | os.PathLike) -> list[Path]:
    """Deal with the runs set aside in ``output_dir``: deleted once a checkpoint of the new run verifies, otherwise
    put back (the new run's own ``metrics.jsonl``, of steps never checkpointed, yields to the earlier one). The
    marker goes first when putting back, so a kill half way through resumes putting back. Returns the directories
    dealt with."""
    output_dir = Path(output_dir)
    asides = sorted(output_dir.glob(f"{OVERWRITTEN}*")) if output_dir.is_dir() else []
    for aside in asides:
        complete = (aside / COMPLETE).exists()
        if complete and any(verify(p, hash_contents=False).ok for p in step_dirs(output_dir)):
            shutil.rmtree(aside)
            continue
        if complete:
            (aside / COMPLETE).unlink()
            fsync_dir(aside)
        for path in sorted(aside.iterdir()):
            target = output_dir / path.name
            if path.name == METRICS_FILE and target.is_file():
                target.unlink()
            if not target.exists():
                path.rename(target)
        if not any(aside.iterdir()):  # else something could not go back: left for the user
            aside.rmdir()
    return asides
