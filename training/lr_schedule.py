"""Learning-rate schedules."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(optimizer: Optimizer, num_training_steps: int, num_warmup_steps: int = 0,
                  min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warmup from 0 to the optimizer's lr over ``num_warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return LambdaLR(optimizer, factor)
