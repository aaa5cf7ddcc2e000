"""A run's ``output_dir``: held for the run's whole life, and kept apart from everything the run reads.

``with hold_output_dir(cfg, dist):`` (rank 0 does the work; every rank learns of a refusal):

- refuses an ``output_dir`` that is, or lies inside, something the run reads, and an input that lies
  inside what the run manages there (``step_N`` directories, which retention and ``overwrite`` delete);
- takes the exclusive :class:`~waypoint.training.run_lock.RunLock`: a second run on the same
  ``output_dir`` refuses at start, naming the holder;
- settles the checkpoints of a run that an earlier ``overwrite=true`` set aside: put back when that run
  never committed one of its own (it was killed or failed), deleted when it did; again at the end.

What the run reads is every config string that names an existing file or directory (the checkpoint,
the dataset, the tokenizer, any path a user adds), except ``output_dir`` and a pinned ``resume``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from waypoint.checkpointers.overlap import real, relation
from waypoint.checkpointers.retention import settle_overwritten
from waypoint.errors import CheckpointError
from waypoint.training.run_lock import RunLock

# Names in output_dir that a run creates, renames or deletes.
MANAGED = re.compile(r"^(\.?step_\d+.*|\.overwritten-\d+|metrics\.jsonl|\.waypoint\.lock)$")
NOT_INPUTS = ("output_dir", "resume")  # keys (at any depth) whose paths are the run's own


def run_inputs(config: Mapping, prefix: str = "") -> dict[str, Path]:
    """Dotted key -> path of each string value naming an existing file or directory."""
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
def hold_output_dir(cfg: DictConfig, dist) -> Iterator[None]:
    """Hold ``cfg.output_dir`` for the block (see the module's docstring); ``dist``: a ``Distributed``."""
    output_dir = Path(cfg.output_dir)
    lock = RunLock(output_dir)

    def take() -> None:
        check_inputs_apart(output_dir, run_inputs(OmegaConf.to_container(cfg, resolve=True)))
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
