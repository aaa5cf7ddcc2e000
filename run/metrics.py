"""Training metrics: one JSON object per optimizer step in ``output_dir/metrics.jsonl``.

The file is only ever appended to, never rewritten. When a run starts, a torn last line (a kill in
the middle of a write) is dropped with a note, and on resume the lines past the resumed step (written
after the checkpoint the run continues from) are cut off with one ``truncate``, so the log reads like
an uninterrupted run's and no moment exists at which it is half written.

With ``tensorboard_dir`` (the config's ``log_dir``; ``tensorboard`` installed) every number of a record also
goes to TensorBoard as a scalar under its key at the record's step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from waypoint.errors import CheckpointError

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    def __init__(self, output_dir: str | os.PathLike, name: str = METRICS_FILE, keep_through_step: int | None = None,
                 report: Callable[[str], None] = print, tensorboard_dir: str | os.PathLike | None = None) -> None:
        self.path = Path(output_dir) / name
        self._tensorboard = _summary_writer(tensorboard_dir) if tensorboard_dir else None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._cut(keep_through_step, report)
            self._file = open(self.path, "a", buffering=1)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot write ({e.strerror or e}); output_dir must be writable") from None

    def _cut(self, keep_through_step: int | None, report: Callable[[str], None]) -> None:
        """Truncate after the last line to keep: before a torn last line, or the first past ``keep_through_step``."""
        with open(self.path, "r+b") as f:
            lines = f.read().splitlines(keepends=True)
            offset = 0
            for i, line in enumerate(lines):
                last = i == len(lines) - 1
                try:
                    record = json.loads(line) if line.endswith(b"\n") else None
                except ValueError:
                    record = None
                step = record.get("step", 0) if isinstance(record, dict) else None
                if step is None and last:
                    report(f"note: {self.path.name}: dropped a torn last line (the run was killed while writing it)")
                    break
                if keep_through_step is not None and isinstance(step, int) and step > keep_through_step:
                    break
                offset += len(line)  # an unreadable line that is not the last one stays, as it was
            if offset < sum(len(line) for line in lines):
                f.truncate(offset)
                os.fsync(f.fileno())

    def write(self, **record) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "epoch") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _summary_writer(directory: str | os.PathLike):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise CheckpointError("log_dir: TensorBoard logging needs the tensorboard package (pip install tensorboard), "
                              "or set log_dir: null") from None
    return SummaryWriter(log_dir=str(directory))
