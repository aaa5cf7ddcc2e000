"""training/sampling_correction.py and the loss it corrects against TRL 1.16's GRPOTrainer with ``use_vllm`` and
``vllm_importance_sampling_correction``: the ratio and metric blocks of ``_generate_and_score_completions`` cut from
TRL's source and executed as they stand, and TRL's own ``_compute_loss`` with the ratio in its inputs."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import TRL_ORACLE
from tests.test_grpo_loss import B, T, Accelerator, batch, close, trl_block, trl_grpo, trl_trainer
from waypoint.training.grpo_loss import LOSS_TYPES, GRPOLossOptions, grpo_loss
from waypoint.training.sampling_correction import (
    MODES, SamplingCorrection, importance_sampling_ratio, reduce_sampling_metrics, sampling_metrics)

pytestmark = TRL_ORACLE

BOUNDS = [(3.0, None), (1.2, 0.8), (None, 0.9)]  # TRL's default, both bounds, a lower bound alone


def engine_logps(seed: int):
    """A batch with the engine's log-probs near the policy's, some far (masked or truncated), one NaN."""
    logps, old, ref, advantages, mask, entropies = batch(seed)
    g = torch.Generator().manual_seed(seed + 100)
    sampling = old + 0.15 * torch.randn(B, T, generator=g)
    sampling[2, 1] = old[2, 1] - 2.0  # a token the engine found far likelier than the policy does
    sampling[3, 2] = torch.nan  # a token the engine could not score
    return logps, old, sampling, ref, advantages, mask, entropies


def trl_ratio_and_metrics(o: SamplingCorrection, old, sampling, mask):
    self = SimpleNamespace(vllm_importance_sampling_mode=o.mode, vllm_importance_sampling_clip_max=o.clip_max,
                           vllm_importance_sampling_clip_min=o.clip_min, use_vllm=True,
                           vllm_importance_sampling_correction=True, accelerator=Accelerator(),
                           _metrics={"train": defaultdict(list)})
    from trl.trainer.utils import nanmax, nanmin

    scope = {"self": self, "torch": torch, "math": math, "old_per_token_logps": old, "sampling_per_token_logps": sampling,
             "completion_mask": mask, "mask": mask, "tool_mask": None, "device": torch.device("cpu"), "mode": "train",
             "nanmin": nanmin, "nanmax": nanmax}
    ratio_block = trl_block("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask", "Unknown vLLM importance sampling level")
    exec(ratio_block.rpartition("else:")[0], scope)  # up to the raise for an unknown mode
    exec(trl_block("delta = torch.abs(old_per_token_logps - sampling_per_token_logps)",
                   "nanmax(self.accelerator.gather(max_importance_sampling_ratio))") + "\n)", scope)
    return scope["vllm_importance_sampling_ratio"], {k: v[-1] for k, v in self._metrics["train"].items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip_max,clip_min", BOUNDS)
def test_ratio_and_metrics_match_trl(mode, clip_max, clip_min):
    o = SamplingCorrection(mode=mode, clip_max=clip_max, clip_min=clip_min)
    _, old, sampling, _, _, mask, _ = engine_logps(MODES.index(mode))
    theirs, their_metrics = trl_ratio_and_metrics(o, old, sampling, mask)
    ours = importance_sampling_ratio(old, sampling, mask, o)
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    assert (ours == 0).any() if mode.endswith("_mask") else ((ours == clip_max) | (ours == clip_min)).any()
    metrics = sampling_metrics(old, sampling, mask, ours, o)
    assert metrics.keys() == their_metrics.keys()
    for name, value in their_metrics.items():
        assert close(metrics[name], value, 1e-6), (name, metrics[name], value)
    # one process's metrics pass through the reduction unchanged; two are combined as TRL's gathers combine them
    assert reduce_sampling_metrics([metrics]) == metrics
    empty = sampling_metrics(old, sampling, torch.zeros_like(mask), ours, o)
    both = reduce_sampling_metrics([metrics, empty])
    assert both["sampling/sampling_logp_difference/max"] == metrics["sampling/sampling_logp_difference/max"]
    assert both["sampling/sampling_logp_difference/mean"] == pytest.approx(metrics["sampling/sampling_logp_difference/mean"] / 2)


@pytest.mark.parametrize("loss_type,mode", [(loss, mode) for loss in LOSS_TYPES for mode in MODES
                                             if not (loss == "vespo" and mode.startswith("sequence"))])
def test_the_corrected_loss_and_its_gradient_match_trl(loss_type, mode):
    """Every loss with every mode TRL allows it (VESPO only with token-level correction: TRL refuses the sequence
    modes with it, as our runs do: tests/test_grpo_engine_options.py)."""
    o = GRPOLossOptions(loss_type=loss_type, beta=0.04, max_completion_length=T + 3)
    correction = SamplingCorrection(mode=mode, clip_max=1.2, clip_min=0.8)
    logps, old, sampling, ref, advantages, mask, entropies = engine_logps(11 + LOSS_TYPES.index(loss_type))
    ratio = importance_sampling_ratio(old, sampling, mask, correction)
    ours_in, theirs_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    ours, _ = grpo_loss(ours_in, old, ref, advantages, mask, o, entropies, importance_sampling_ratio=ratio)

    trainer = trl_trainer(o)
    trainer.__dict__.update(use_vllm=True, vllm_importance_sampling_correction=True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (theirs_in, entropies, None)
    inputs = {"prompt_ids": torch.zeros(B, 3, dtype=torch.long), "prompt_mask": torch.ones(B, 3, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "num_items_in_batch": mask.sum(), "old_per_token_logps": old,
              "ref_per_token_logps": ref, "importance_sampling_ratio": ratio}
    theirs = trainer._compute_loss(None, inputs)
    assert abs(ours.item() - theirs.item()) <= 1e-6, (ours.item(), theirs.item())
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_in.grad, theirs_in.grad, atol=1e-6, rtol=0)
    plain, _ = grpo_loss(logps, old, ref, advantages, mask, o, entropies)
    assert abs(plain.item() - ours.item()) > 1e-4  # the correction changed the loss


def test_defaults_are_trls():
    from trl import GRPOConfig
    config = GRPOConfig.__dataclass_fields__
    ours = SamplingCorrection()
    assert ours.enabled == config["vllm_importance_sampling_correction"].default
    assert ours.mode == config["vllm_importance_sampling_mode"].default
    assert ours.clip_max == config["vllm_importance_sampling_clip_max"].default
    assert ours.clip_min == config["vllm_importance_sampling_clip_min"].default


@pytest.mark.parametrize("options,message", [
    ({"mode": "token"}, "vllm_importance_sampling_mode='token': expected one of token_truncate, token_mask"),
    ({"clip_max": -1.0}, "vllm_importance_sampling_clip_max=-1.0: expected a number >= 0, or null"),
    ({"clip_min": "low"}, "vllm_importance_sampling_clip_min='low': expected a number >= 0, or null"),
    ({"clip_min": 3.0}, r"vllm_importance_sampling_clip_min \(3.0\) must be less than vllm_importance_sampling_clip_max \(3.0\)"),
    ({"mode": "token_truncate", "clip_max": None}, "vllm_importance_sampling_mode=token_truncate: truncating needs"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(ValueError, match="^" + message) as error:
        SamplingCorrection(**options)
    assert "\n" not in str(error.value)
