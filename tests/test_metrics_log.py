"""metrics.jsonl's optional TensorBoard twin (log_dir)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from waypoint.errors import CheckpointError
from waypoint.run.metrics import MetricsLog


def test_records_go_to_tensorboard_as_scalars_at_their_step(tmp_path, monkeypatch):
    calls, closed = [], []

    class SummaryWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def close(self):
            closed.append(self.log_dir)

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    log = MetricsLog(tmp_path, tensorboard_dir=tmp_path / "tb")
    log.write(step=3, epoch=0, loss=1.5, lr=1e-3, resumed=True)
    log.write(step=4, val_loss=1.25)
    log.close()
    assert calls == [("loss", 1.5, 3), ("lr", 1e-3, 3), ("val_loss", 1.25, 4)]
    assert closed == [str(tmp_path / "tb")]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3, 4]


def test_log_dir_without_tensorboard_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(CheckpointError, match=r"^log_dir: TensorBoard logging needs the tensorboard package"):
        MetricsLog(tmp_path, tensorboard_dir=tmp_path / "tb")
