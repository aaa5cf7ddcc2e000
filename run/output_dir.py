"""A run's ``output_dir``: where it is, held for the run's whole life, and kept apart from everything the run reads.

``with hold_output_dir(output_dir, inputs, dist):`` (rank 0 does the work; every rank learns of a refusal):

- refuses an ``output_dir`` that is, or lies inside, something the run reads, and an input that lies inside what
  the run manages there (``step_N`` directories, which retention and ``overwrite`` delete);
- takes the exclusive :class:`~waypoint.run.lock.RunLock`: a second run on the same ``output_dir`` refuses at
  start, naming the holder;
- settles the checkpoints of a run that an earlier ``overwrite=true`` set aside
  (``step_dirs.settle_overwritten``): put back when that run never committed one of its own (it was killed or
  failed), deleted when it did; again at the end.

Overlap is judged on resolved real paths (symlinks and ``..`` followed), so that no output is ever written over,
into or around what a command reads (``refuse_overlap``, for the scripts too). A script's output is a local path:
a URL there is refused (``local_output``), never made into a folder named ``s3:``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from waypoint.errors import CheckpointError
from waypoint.run.lock import RunLock
from waypoint.run.object_store import url_scheme
from waypoint.run.step_dirs import settle_overwritten

# Names in output_dir that a run creates, renames or deletes.
MANAGED = re.compile(r"^(\.?step_\d+.*|\.overwritten-\d+|metrics\.jsonl|\.waypoint\.lock)$")
NOT_INPUTS = ("output_dir", "resume")  # keys (at any depth) whose paths are the run's own


@dataclass(frozen=True)
class RunDir:
    """Where a run lives: ``path`` on this machine's disk, and for a run in an object store the ``store`` URL whose
    local mirror ``path`` is (None: a run on a local or shared disk)."""

    path: Path
    store: str | None = None

    def stored_at(self, step: Path) -> str:
        """Where a run's step is kept for good, for the run's last line ("" for a local run)."""
        return f"{self.store}/{Path(step).name}; a local copy: " if self.store else ""


# -- overlap ---------------------------------------------------------------------------------------------------------
def real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def relation(path: str | os.PathLike, other: str | os.PathLike) -> str | None:
    """``"is"``, ``"lies inside"``, ``"contains"`` (``path`` relative to ``other``) or None."""
    a, b = real(path), real(other)
    if a == b:
        return "is"
    if a.is_relative_to(b):
        return "lies inside"
    if b.is_relative_to(a):
        return "contains"
    return None


def refuse_overlap(output: str | os.PathLike, inputs: Mapping[str, str | os.PathLike], output_label: str = "the output") -> None:
    """A one-line error when ``output`` is one of ``inputs`` (label -> path), lies inside one or contains one."""
    for label, path in inputs.items():
        how = relation(output, path)
        if how:
            raise CheckpointError(f"{output_label} {output} {how} {label} {path}, which this command reads; "
                                  "choose an output outside it")


def local_output(path: str | os.PathLike, option: str) -> Path:
    """An output that a command writes to this machine's disk only (a script's OUT_DIR): ``path``; a URL (any scheme
    in any case, ``file://`` included) is refused in one line naming ``option``, never made into a local folder
    named after its scheme."""
    scheme = url_scheme(path)
    if scheme == "file":
        raise CheckpointError(f"{option} {path}: a file:// URL; give the path itself ({str(path)[len('file://'):]})")
    if scheme:
        raise CheckpointError(f"{option} {path}: this command writes a local directory, not a URL; give a local path "
                              "(and copy the result to the store afterwards)")
    return Path(path)


def run_inputs(config: Mapping, prefix: str = "") -> dict[str, Path]:
    """What a run reads: dotted key -> path of each string value of its (resolved) config naming an existing file or
    directory, except ``output_dir`` and a pinned ``resume``."""
    found = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if key in NOT_INPUTS:
            continue
        if isinstance(value, Mapping):
            found.update(run_inputs(value, f"{dotted}."))
        elif isinstance(value, (list, tuple)):
            found.update(run_inputs({str(i): v for i, v in enumerate(value)}, f"{dotted}."))
        elif isinstance(value, str) and value and "\n" not in value and Path(value).expanduser().exists():
            found[dotted] = Path(value)
    return found


def check_inputs_apart(output_dir: str | Path, inputs: Mapping[str, Path]) -> None:
    """One-line errors for an output_dir inside an input, and for an input inside what the run manages."""
    out = real(output_dir)
    for key, path in inputs.items():
        how = relation(out, path)
        if how in ("is", "lies inside"):
            raise CheckpointError(f"output_dir {output_dir} {how} {key} {path}, which the run reads; "
                                  "choose an output_dir outside it")
        if how == "contains":
            first = real(path).relative_to(out).parts[0]
            if MANAGED.match(first):
                raise CheckpointError(
                    f"{key} {path} lies inside {Path(output_dir) / first}, which the run may replace or delete "
                    "(overwrite, keep_last_n_checkpoints); copy it out of output_dir or choose another output_dir")


@contextmanager
def hold_output_dir(output_dir: str | Path, inputs: Mapping[str, Path], dist) -> Iterator[None]:
    """Hold ``output_dir`` for the block (see the module's docstring); ``inputs``: what the run reads (``run_inputs``);
    ``dist``: a ``waypoint.training.distributed.Distributed``."""
    output_dir = Path(output_dir)
    lock = RunLock(output_dir)

    def take() -> None:
        check_inputs_apart(output_dir, inputs)
        lock.acquire()
        try:
            settle_overwritten(output_dir)
        except BaseException:
            lock.release()
            raise

    dist.run_on_main(take)
    try:
        yield
    finally:
        if dist.is_main:
            try:
                settle_overwritten(output_dir)
            finally:
                lock.release()
