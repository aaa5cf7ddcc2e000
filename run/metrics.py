"""Training metrics: one JSON object per optimizer step in ``output_dir/metrics.jsonl``.

The file is only ever appended to, never rewritten. When a run starts, a torn last line (a kill in
the middle of a write) is dropped with a note, and on resume the lines past the resumed step (written
after the checkpoint the run continues from) are cut off with one ``truncate``, so the log reads like
an uninterrupted run's and no moment exists at which it is half written.

With ``tensorboard_dir`` (the config's ``log_dir``; ``tensorboard`` installed) every number of a record also
goes to TensorBoard as a scalar under its key at the record's step. With ``trackers`` (the config's ``metric_loggers``,
``waypoint.run.trackers``) every record also goes to each experiment tracker, which first gets the records the file
holds that it lacks (a resumed run's, up to the resumed step); ``close(final_model)`` finishes their runs.
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
                 report: Callable[[str], None] = print, tensorboard_dir: str | os.PathLike | None = None,
                 trackers=None) -> None:
        self.path = Path(output_dir) / name
        self._tensorboard = _summary_writer(tensorboard_dir) if tensorboard_dir else None
        self._trackers = trackers
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._cut(keep_through_step, report)
            self._file = open(self.path, "a", buffering=1)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot write ({e.strerror or e}); output_dir must be writable") from None
        if trackers is not None:
            trackers.replay(self._records())

    def _records(self) -> list[dict]:
        """The records the file holds (after the cut at the start): what the trackers may lack."""
        records = []
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
        return records

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
        if self._trackers is not None:
            self._trackers.write(record)

    def close(self, final_model: str | None = None) -> None:
        """``final_model``: the path the trackers record as the run's model (None: the run stopped before its end)."""
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._trackers is not None:
            self._trackers.close(final_model)


def _summary_writer(directory: str | os.PathLike):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise CheckpointError("log_dir: TensorBoard logging needs the tensorboard package (pip install tensorboard), "
                              "or set log_dir: null") from None
    return SummaryWriter(log_dir=str(directory))
