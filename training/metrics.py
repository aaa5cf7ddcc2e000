"""Training metrics: one JSON object per optimizer step in ``output_dir/metrics.jsonl``."""

from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsLog:
    """Appends to ``output_dir/metrics.jsonl``; records past ``keep_through_step`` (written after the
    checkpoint a run resumes from) are dropped first, so the log reads like an uninterrupted run's."""

    def __init__(self, output_dir: str | Path, name: str = "metrics.jsonl", keep_through_step: int | None = None) -> None:
        self.path = Path(output_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_through_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= keep_through_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", buffering=1)

    def write(self, **record) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
