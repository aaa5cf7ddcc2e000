"""The preference losses of DPO and its variants, on each pair's summed completion log-probs, and their metrics.

``loss_type``, as TRL names them (``trl.DPOTrainer``; SimPO as ``trl.experimental.cpo.CPOTrainer`` with
``loss_type="simpo"`` and ``cpo_alpha=0``):

- ``sigmoid``: DPO, ``-log sigmoid(beta * delta)`` with ``delta = (chosen - ref_chosen) - (rejected - ref_rejected)``
  over the completions' summed log-probs; ``label_smoothing`` eps > 0 is conservative DPO (cDPO),
  ``-(1 - eps) log sigmoid(beta * delta) - eps log sigmoid(-beta * delta)``;
- ``ipo``: ``(delta' - 1 / (2 beta))^2``, ``delta'`` from the log-ratios averaged over each completion's tokens;
- ``hinge``: ``relu(1 - beta * delta)`` (SLiC);
- ``simpo``: reference-free, on the completions' mean log-probs: ``-log sigmoid(beta * (chosen' - rejected') - gamma)``
  (with ``label_smoothing`` as cDPO's).

The rewards are TRL's: ``beta`` times each completion's log-ratio to the reference (SimPO: ``beta`` times its mean
log-prob). A step's loss and metrics are means over every pair of its global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from waypoint.errors import CheckpointError

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class PreferenceLoss:
    """``loss_type`` (``LOSS_TYPES``) with its ``beta``, ``label_smoothing`` (sigmoid and simpo) and SimPO's target
    reward margin ``gamma``."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise CheckpointError(f"loss.type: expected one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        for name, value, fits, expected in (
                ("beta", self.beta, lambda v: v > 0, "a number > 0"),
                ("label_smoothing", self.label_smoothing, lambda v: 0 <= v < 0.5, "a number >= 0 and < 0.5"),
                ("gamma", self.gamma, lambda v: v >= 0, "a number >= 0")):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not fits(value):
                raise CheckpointError(f"loss.{name}={value}: expected a finite {expected.removeprefix('a ')}")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "simpo"):
            raise CheckpointError(f"loss.label_smoothing applies to the sigmoid and simpo losses, not {self.loss_type}; set loss.label_smoothing=0")

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares the policy with a reference model (all but SimPO)."""
        return self.loss_type != "simpo"

    @property
    def averages(self) -> bool:
        """Whether the loss takes each completion's log-probs averaged over its tokens (IPO, SimPO)."""
        return self.loss_type in ("ipo", "simpo")

    def __call__(self, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                 ref_rejected: torch.Tensor | None, chosen_tokens: torch.Tensor,
                 rejected_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each pair's loss, chosen rewards, rejected rewards), all [pairs], from the policy's summed completion
        log-probs ``chosen`` and ``rejected`` [pairs], the reference's (None for SimPO), and each completion's
        token count."""
        beta, eps = self.beta, self.label_smoothing
        if self.loss_type == "simpo":
            chosen_mean = chosen / chosen_tokens.clamp(min=1)
            rejected_mean = rejected / rejected_tokens.clamp(min=1)
            logits = (chosen_mean - rejected_mean) - self.gamma / beta
            losses = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
            return losses, beta * chosen_mean.detach(), beta * rejected_mean.detach()
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        if self.loss_type == "ipo":
            delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (delta - 1 / (2 * beta)) ** 2
        else:
            delta = chosen_ratio - rejected_ratio
            if self.loss_type == "hinge":
                losses = torch.relu(1 - beta * delta)
            else:
                losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
        return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()

    def logps_logged(self, logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The completion log-probs TRL logs as ``logps/*``: summed, or for SimPO averaged over the tokens."""
        return logps / tokens.clamp(min=1) if self.loss_type == "simpo" else logps


def pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                 rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each metric's sum over the pairs given (divide by the pairs to get TRL's means): rewards, whether the chosen
    reward is the higher (strictly), the margin, and the logged log-probs."""
    return {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/chosen": chosen_logps.detach().sum(),
        "logps/rejected": rejected_logps.detach().sum(),
    }
