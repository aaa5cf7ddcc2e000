"""The correction for sampling with another engine than the policy (vLLM), as TRL 1.16's ``GRPOTrainer`` applies it
with ``use_vllm`` and ``vllm_importance_sampling_correction`` (on by default), with its option names and metrics.

The engine that sampled a completion scored each of its tokens (``sampling_logps``); the policy that is trained
scores them again before the update (``old_logps``, the loss's denominator). Their difference, over the completion
mask (a NaN from the engine counts as 0: ratio 1), gives an importance-sampling ratio ``exp(old - sampling)``:

- ``token_*`` modes: one ratio per token [B, T]; ``sequence_*`` modes: ``exp`` of the summed difference [B, 1];
- ``*_truncate``: the ratio clipped to ``[clip_min, clip_max]``; ``*_mask``: a ratio outside it set to 0.

The loss multiplies every token's loss by the ratio (before the KL term; VESPO folds it into its gamma weights
instead: ``training.grpo_loss``). ``sampling_metrics`` are TRL's ``sampling/*`` metrics, how a user sees that the
engine samples from other weights than the policy's (a weight sync that did not take).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from waypoint.training.gathered_metrics import reduce_gathered

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class SamplingCorrection:
    """TRL's ``vllm_importance_sampling_*`` options (``enabled``: ``vllm_importance_sampling_correction``)."""

    enabled: bool = True
    mode: str = "sequence_mask"
    clip_max: float | None = 3.0
    clip_min: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"vllm_importance_sampling_mode={self.mode!r}: expected one of {', '.join(MODES)}")
        for name in ("clip_min", "clip_max"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ValueError(f"vllm_importance_sampling_{name}={value!r}: expected a number >= 0, or null")
        if self.clip_min is not None and self.clip_max is not None and self.clip_min >= self.clip_max:
            raise ValueError(f"vllm_importance_sampling_clip_min ({self.clip_min}) must be less than "
                             f"vllm_importance_sampling_clip_max ({self.clip_max})")
        if self.mode.endswith("_truncate") and self.clip_min is None and self.clip_max is None:
            raise ValueError(f"vllm_importance_sampling_mode={self.mode}: truncating needs "
                             "vllm_importance_sampling_clip_max or vllm_importance_sampling_clip_min")

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence_")


def importance_sampling_ratio(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                              options: SamplingCorrection) -> torch.Tensor:
    """The ratio [B, T] (token modes) or [B, 1] (sequence modes) that multiplies each token's loss."""
    with torch.no_grad():
        diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
        if options.sequence_level:
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        if options.mode.endswith("_truncate"):
            return torch.clamp(ratio, min=options.clip_min, max=options.clip_max)
        low = -math.inf if options.clip_min is None else options.clip_min
        high = math.inf if options.clip_max is None else options.clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampling_metrics(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                     ratio: torch.Tensor, options: SamplingCorrection) -> dict[str, float]:
    """TRL's ``sampling/sampling_logp_difference/{mean,max}`` and ``sampling/importance_sampling_ratio/{min,mean,max}``
    of one process's batch (``reduce_sampling_metrics`` combines processes as TRL's gathers do)."""
    with torch.no_grad():
        kept = mask.bool()
        delta = torch.abs(old_logps - sampling_logps)[kept]
        delta = delta[~torch.isnan(delta)]
        flat = ratio.flatten() if options.sequence_level else ratio[kept]
        zero = lambda x, reduce: float(reduce(x)) if x.numel() else 0.0  # noqa: E731  (TRL: 0 for an empty batch)
        return {"sampling/sampling_logp_difference/mean": zero(delta, torch.mean),
                "sampling/sampling_logp_difference/max": zero(delta, torch.max),
                "sampling/importance_sampling_ratio/min": zero(flat, torch.min),
                "sampling/importance_sampling_ratio/mean": zero(flat, torch.mean),
                "sampling/importance_sampling_ratio/max": zero(flat, torch.max)}


def reduce_sampling_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Several processes' (or micro-batches') ``sampling_metrics`` as TRL reduces its gathered values: the mean of
    the means (NaN left out of the ratio's), the greatest max, the least min (NaN left out)."""
    return reduce_gathered(records, nan_skipping_means=("sampling/importance_sampling_ratio",))
