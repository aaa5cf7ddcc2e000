"""What scripts/plot_metrics.py draws of a run's metrics below its large panel, and each panel's y axis.

A run's large panel is its loss, or for an online RL run (records with ``reward``) its mean reward: GRPO's loss stays
near 0 on-policy by construction, so what learning moves comes first there (``RL_PANELS``: the reward's spread, the
share of groups that teach nothing, the completions' length, the KL, then the loss). A panel's y axis never makes a
flat series look like a jump: a share is drawn on 0-1, and any other axis spans at least ``MIN_RELATIVE_SPAN`` of
its series' largest magnitude (a mean length of 5.94 to 6.00 tokens is drawn on 5.37-6.57, not on 5.94-6.00).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_RELATIVE_SPAN = 0.2  # an axis spans at least this share of its series' largest magnitude


@dataclass(frozen=True)
class Panel:
    key: str  # the series
    title: str
    ylabel: str
    share: bool = False  # a share of 0 to 1: drawn on a 0-1 axis
    min_span: float = 0.0  # the least the y axis spans, beside MIN_RELATIVE_SPAN


PANELS = (
    Panel("lr", "learning rate", "lr"),
    Panel("tokens_per_s", "throughput", "tokens/s"),
    Panel("grad_norm", "gradient norm (before clipping)", "norm"),
    Panel("aux_loss", "MoE auxiliary loss", "aux loss"),
    Panel("rewards/accuracies", "preference: pairs whose chosen reward is the higher", "share", share=True),  # DPO
    Panel("rewards/margins", "preference: reward margin (chosen - rejected)", "margin"),
)
RL_PANELS = (  # recipes/grpo_finetune.py, below the reward
    Panel("reward_std", "reward spread (std of the step's rewards)", "std"),
    Panel("frac_reward_zero_std", "groups whose completions all scored the same (no gradient)", "share", share=True),
    Panel("completions/mean_length", "mean completion length", "tokens"),
    Panel("kl", "KL to the reference model", "kl"),
    # advantages are scaled to a spread of about 1: a loss within +-0.1 is the ~0 of on-policy GRPO
    Panel("loss", "loss (near 0 on-policy by construction: the reward shows learning)", "loss", min_span=0.2),
    *PANELS,
)


def y_limits(values: list[float], panel: Panel) -> tuple[float, float] | None:
    """The y axis for ``values`` (every run's, NaN skipped): a share's 0-1 (widened to take in values past it); else
    the values' range widened about its middle to span at least ``MIN_RELATIVE_SPAN`` of their largest magnitude and
    ``panel.min_span``, kept off negative numbers for values that have none; None: matplotlib's own is right."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    if panel.share:
        bottom, top = min(lo, 0.0), max(hi, 1.0)
        return bottom - 0.03 * (top - bottom), top + 0.03 * (top - bottom)
    need = max(MIN_RELATIVE_SPAN * max(abs(lo), abs(hi)), panel.min_span)
    if hi - lo >= need or need == 0:
        return None
    bottom = (lo + hi) / 2 - need / 2
    if lo >= 0 > bottom:
        bottom = 0.0
    return bottom, bottom + need
