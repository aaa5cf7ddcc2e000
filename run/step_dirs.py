"""A run's step directories: ``output_dir/step_N``, each committed whole with its manifest
(``waypoint.checkpointers.commit.StagedDir``), listed newest first, and deleted only after a newer one is
committed.

- :func:`step_dirs` lists them; temporary ones (``.step_N.tmp-PID``, left by a killed run) are never listed, and
  :func:`remove_stale_staging` removes those whose process is gone.
- Retention: :func:`prune_checkpoints`, called after each commit, deletes all but the newest
  ``keep_last_n_checkpoints`` verified checkpoints.
- :func:`set_aside_newer` renames the steps after the one a run resumes from (corrupt ones, or newer ones when an
  earlier step was pinned), so the resumed run can write its own and nothing is deleted.
- Overwrite: a run started with ``resume=false overwrite=true`` moves the earlier run's ``step_N`` directories and
  ``metrics.jsonl`` into a hidden ``.overwritten-<pid>`` directory (:func:`set_aside_earlier_run`). They are deleted
  once the new run has committed a checkpoint of its own and put back when it ends without one
  (:func:`settle_overwritten`, after each commit, at the end of a run and at the start of the next, which covers a
  run that was killed).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from waypoint.checkpointers.commit import fsync_dir, verify
from waypoint.errors import CheckpointError
from waypoint.run.metrics import METRICS_FILE

STEP_DIR = re.compile(r"^step_(\d+)$")
OVERWRITTEN = ".overwritten-"
COMPLETE = ".complete"  # in an .overwritten-<pid> directory: everything has been moved in


def step_number(path: str | os.PathLike) -> int | None:
    match = STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def step_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """``output_dir/step_N`` directories, newest (highest N) first; temporary ones are not listed."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(step_number(p), p) for p in output_dir.iterdir() if p.is_dir() and step_number(p) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def remove_stale_staging(output_dir: str | os.PathLike) -> list[Path]:
    """Remove temporary checkpoint directories left by a killed run (``.step_N.tmp-PID`` whose process is gone)."""
    output_dir = Path(output_dir)
    removed = []
    for path in output_dir.glob(".step_*.tmp-*") if output_dir.is_dir() else []:
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prune_checkpoints(output_dir: str | os.PathLike, keep_last_n: int | None) -> list[Path]:
    """After a commit: delete all but the newest ``keep_last_n`` verified checkpoints (None keeps all). Directories
    that do not verify stay."""
    if not keep_last_n:
        return []
    if keep_last_n < 1:
        raise CheckpointError(f"keep_last_n_checkpoints must be at least 1, got {keep_last_n}")
    verified = [p for p in step_dirs(output_dir) if verify(p, hash_contents=False).ok]
    doomed = verified[keep_last_n:]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def set_aside_newer(output_dir: str | Path, chosen: Path, suffix: str) -> list[Path]:
    """Rename the checkpoints after ``chosen`` to ``step_N.<suffix>`` (they failed verification, or the user
    pinned an earlier one), so the resumed run can write its own ``step_N`` and nothing is deleted."""
    chosen_step = step_number(chosen) if step_number(chosen) is not None else -1
    moved = []
    for path in step_dirs(output_dir):
        if step_number(path) <= chosen_step or path.resolve() == Path(chosen).resolve():
            continue
        target, n = path.with_name(f"{path.name}.{suffix}"), 1
        while target.exists():
            target, n = path.with_name(f"{path.name}.{suffix}{n}"), n + 1
        path.rename(target)
        moved.append(target)
    return moved


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
