"""Reversible tensor operations used by converter tables.

Each op maps the tensors of one key group from the Hugging Face layout to the
native one (``forward``) and back (``inverse``); ``inverse(forward(x)) == x``
bitwise. Ops take and return lists so that fused tensors (one HF key <-> several
native keys) fit the same shape as plain renames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Identity:
    """A plain rename."""

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)


@dataclass(frozen=True)
class RopePermute:
    """Rows of a q/k projection (weight or bias): HF's rotate-half order <-> Meta's interleaved pairs.

    Within each head, HF keeps the first and second halves of the rotary pairs
    in two blocks ``[x0, x2, x4, ..., x1, x3, x5, ...]``; Meta interleaves them
    ``[x0, x1, x2, x3, ...]``. The permutation acts on dim 0 only.
    """

    n_heads: int
    head_dim: int

    def _regroup(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        if t.shape[0] != self.n_heads * self.head_dim:
            raise ValueError(
                f"has {t.shape[0]} rows, expected n_heads * head_dim = {self.n_heads} * {self.head_dim}")
        return t.reshape(self.n_heads, a, b, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self._regroup(t, 2, self.head_dim // 2) for t in tensors]

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self._regroup(t, self.head_dim // 2, 2) for t in tensors]
