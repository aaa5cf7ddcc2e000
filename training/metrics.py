"""Training metrics: one JSON object per optimizer step in ``output_dir/metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, output_dir: str | Path, name: str = "metrics.jsonl") -> None:
        self.path = Path(output_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def write(self, **record) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
