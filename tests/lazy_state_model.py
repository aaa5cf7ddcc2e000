"""A tiny model with non-tensor state created lazily during training (for the extra-state tests).

``Calibration.p`` is None until the first training forward, then drawn from the torch RNG
and used from then on. A checkpointer that lost it would make a resumed run draw a
different ``p``, and its losses would silently differ from an uninterrupted run's.
"""

from __future__ import annotations

import torch

from waypoint.checkpointers import build_model
from waypoint.models import Transformer
from waypoint.models.extra_state import ExtraStateModule


class Calibration(ExtraStateModule):
    extra_state_attributes = ("p", "draws")

    def __init__(self) -> None:
        super().__init__()
        self.p = None
        self.draws = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.p is None:
            if not self.training:
                return h
            self.p = torch.randn(h.shape[-1])
            self.draws += 1
        return h * (1 + 0.1 * self.p.to(h.dtype))


class CalibratedTransformer(Transformer):
    def __init__(self, args) -> None:
        super().__init__(args)
        self.calibration = Calibration()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(self.calibration(h)))


def build(checkpoint_dir, attn_dropout=None) -> CalibratedTransformer:
    return CalibratedTransformer(build_model(checkpoint_dir, attn_dropout=attn_dropout).args)
