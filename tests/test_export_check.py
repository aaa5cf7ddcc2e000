"""Where an export check runs its reloaded model: on the trained model's device when it fits there, else the CPU."""

from __future__ import annotations

import torch
from torch import nn

from waypoint.checkpointers.export_check import probe_device

MB = 1 << 20


def test_the_reload_computes_where_the_model_trained_when_it_fits():
    model = nn.Linear(1024, 1024)  # 4 MiB of weights
    cuda = torch.device("cuda", 0)
    assert probe_device(model, cuda, free_bytes=1024 * MB) == cuda
    assert probe_device(model, cuda, free_bytes=200 * MB) == torch.device("cpu")  # no room beside the run's memory
    assert probe_device(model, torch.device("cpu")) == torch.device("cpu")
