"""The loss of the GRPO family of online-RL recipes, as TRL 1.16's ``GRPOTrainer._compute_loss`` defines it, with
TRL's option names, defaults and logged metric names.

- Advantages (``group_advantages``): each completion's reward minus its group's mean (``num_generations``
  completions per prompt), divided by ``std + 1e-4`` where ``scale_rewards`` is ``"group"`` (the group's std) or
  ``"batch"`` (the whole batch's); ``"none"`` leaves them unscaled (``True``/``False`` mean ``"group"``/``"none"``).
  A NaN reward (every reward function returned None) is left out of the statistics and gets advantage 0.
- Ratio: ``exp(logp - old_logp)`` per token, or with ``importance_sampling_level="sequence"`` (GSPO) ``exp`` of the
  log-ratio averaged over each completion's tokens. ``old_per_token_logps=None`` (``num_iterations == 1``) takes the
  current log-probs, detached.
- Per-token loss by ``loss_type``: PPO's clipped surrogate ``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``
  (``delta`` also caps the unclipped ``r``: INTELLECT-2's two-sided clipping) for grpo, bnpo, dr_grpo, dapo, luspo;
  ``-sg(min(r, epsilon_high)) A logp`` for cispo; ``-sigmoid(tau (r - 1)) 4 / tau A`` for sapo (``tau`` by the
  advantage's sign); ``-phi(w) A logp`` for vespo, ``phi`` the gamma weight of the sequence's summed ratio.
  ``beta > 0`` adds ``beta`` times the k3 KL to the reference, ``exp(ref - logp) - (ref - logp) - 1``, weighted by
  the ratio where ``use_bias_correction_kl``.
- Normalisation: grpo and sapo average each completion's tokens, then the completions; bnpo divides by the batch's
  tokens; dr_grpo by ``B * max_completion_length``; dapo, cispo and vespo by ``num_items_in_batch`` (the tokens of the
  generation batch across all processes: in one process, with one step per generation, the batch's tokens) over the
  processes, times ``gradient_accumulation_steps / steps_per_generation``; luspo sums each completion's tokens and
  averages the completions. All but dapo, cispo and vespo are divided by ``gradient_accumulation_steps`` in training.

Not reproduced here (each a separate TRL option left at its default): ``top_entropy_quantile``, ``entropy_coef``,
``off_policy_mask_threshold``, the MoE router's aux loss, and
``multi_objective_aggregation="normalize_then_sum"``. ``tool_mask`` and ``mask_truncated_completions`` are the
caller's: pass the mask they give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``trl.trainer.utils.nanstd``: the std of the non-NaN values with Bessel's correction (NaN below 2 values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = count / (count - 1)
    variance *= torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    std = torch.sqrt(variance)
    return std.squeeze() if dim is None else std.squeeze(dim)


@dataclass(frozen=True)
class GRPOLossOptions:
    """The options of ``trl.GRPOConfig`` the loss reads, with its names and defaults."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    num_iterations: int = 1
    max_completion_length: int = 512
    scale_rewards: str | bool = "group"
    use_bias_correction_kl: bool = True
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None  # None: gradient_accumulation_steps, as GRPOConfig sets it

    def __post_init__(self) -> None:
        def check(name, fits, expected):
            value = getattr(self, name)
            if isinstance(value, bool) or not fits(value):
                raise ValueError(f"{name}={value!r}: expected {expected}")

        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r}: expected token or sequence")
        scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if scale not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards={self.scale_rewards!r}: expected group, batch, none, True or False")
        object.__setattr__(self, "scale_rewards", scale)
        number = lambda low: lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= low  # noqa: E731
        count = lambda v: isinstance(v, int) and v >= 1  # noqa: E731
        for name in ("epsilon_high", "delta"):
            check(name, lambda v: v is None or number(0)(v), "None or a finite number >= 0")
        for name in ("num_iterations", "max_completion_length", "gradient_accumulation_steps"):
            check(name, count, "an integer >= 1")
        check("steps_per_generation", lambda v: v is None or count(v), "None or an integer >= 1")
        for name in ("sapo_temperature_neg", "sapo_temperature_pos"):
            check(name, lambda v: number(0)(v) and v > 0, "a finite number > 0")
        for name in ("beta", "epsilon", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check(name, number(0), "a finite number >= 0")

    @property
    def upper_epsilon(self) -> float:
        """TRL's ``epsilon_high``: ``epsilon`` when unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def weighted_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor | None = None) -> torch.Tensor:
    """[N] from [N, F] (NaN where a function returned None): the weighted sum of the non-NaN rewards, NaN where all
    are NaN (an unscorable completion), as TRL sums them before ``group_advantages``."""
    weights = torch.ones(rewards_per_func.size(1)) if reward_weights is None else reward_weights
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale_rewards: str | bool = "group") -> tuple[torch.Tensor, dict[str, float]]:
    """(advantages [N], {"frac_reward_zero_std"}) from ``rewards`` [N], grouped as ``num_generations`` consecutive
    completions of one prompt."""
    scale = GRPOLossOptions(scale_rewards=scale_rewards).scale_rewards
    if not isinstance(num_generations, int) or isinstance(num_generations, bool) or num_generations < 1 \
            or rewards.numel() % num_generations:
        raise ValueError(f"num_generations={num_generations!r}: expected an integer >= 1 dividing {rewards.numel()} rewards")
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale in ("group", "none"):
        if num_generations > 1:
            std = _nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        else:
            std = torch.zeros_like(rewards)
    else:
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), {"frac_reward_zero_std": is_std_zero.float().mean().item()}


def rollout_metrics(rewards_per_func: torch.Tensor, reward_func_names: list[str], completion_lengths: torch.Tensor,
                    terminated: torch.Tensor, reward_weights: torch.Tensor | None = None) -> dict[str, float]:
    """TRL's reward and completion metrics of a generation batch: ``rewards/<name>/mean|std`` per reward function
    (over its non-NaN values), ``reward`` and ``reward_std`` of the weighted sums, and ``completions/*`` from each
    completion's token count and whether it ``terminated`` (ended with EOS or padding; the rest count as clipped)."""
    metrics = {}
    for i, name in enumerate(reward_func_names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = _nanstd(rewards_per_func[:, i]).item()
    rewards = weighted_rewards(rewards_per_func, reward_weights)
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = _nanstd(rewards).item()
    lengths, is_truncated = completion_lengths.float(), ~terminated.bool()
    metrics["completions/mean_length"] = lengths.mean().item()
    metrics["completions/min_length"] = lengths.min().item()
    metrics["completions/max_length"] = lengths.max().item()
    metrics["completions/clipped_ratio"] = is_truncated.float().mean().item()
    term = lengths[~is_truncated] if bool((~is_truncated).any()) else torch.zeros(1)
    metrics["completions/mean_terminated_length"] = term.mean().item()
    metrics["completions/min_terminated_length"] = term.min().item()
    metrics["completions/max_terminated_length"] = term.max().item()
    return metrics


def _gamma_weights(options: GRPOLossOptions, advantages, log_ratio, mask, sampling_ratio=None) -> torch.Tensor:
    """VESPO's ``phi(w) = exp(lambda + k log w - lambda w)`` [B, 1] of each sequence's summed log-ratio (times the
    sampling correction's ratio, summed over the tokens in log space, where there is one), no grad."""
    with torch.no_grad():
        lower = math.log(1e-8)
        seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
        if sampling_ratio is not None:
            seq_log_ratio = seq_log_ratio + torch.clamp(torch.log(sampling_ratio), lower, 20.0).sum(-1, keepdim=True)
        log_w = torch.clamp(seq_log_ratio, lower, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, options.vespo_k_pos, options.vespo_k_neg)
        lam = torch.where(nonneg, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
              ref_per_token_logps: torch.Tensor | None, advantages: torch.Tensor, completion_mask: torch.Tensor,
              options: GRPOLossOptions, entropies: torch.Tensor | None = None,
              num_items_in_batch: torch.Tensor | None = None, num_processes: int = 1,
              training: bool = True, importance_sampling_ratio: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """(the loss to backpropagate, TRL's metrics) of one micro-batch: log-probs [B, T] of the completions' tokens
    under the policy, the policy that sampled them (None: the current one, detached) and the reference (needed when
    ``beta`` > 0), ``advantages`` [B] (or [B, T]), and ``completion_mask`` [B, T]. ``num_items_in_batch`` (dapo,
    cispo, vespo) defaults to the mask's token count. ``importance_sampling_ratio`` ([B, T] or [B, 1]): the
    correction for completions another engine sampled (``training.sampling_correction``), which multiplies each
    token's loss (VESPO: its gamma weights). Metrics are this process's (TRL reduces them across processes)."""
    o, mask = options, completion_mask
    if o.beta != 0.0 and ref_per_token_logps is None:
        raise ValueError(f"ref_per_token_logps: required with beta={o.beta} (the KL to the reference)")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    log_ratio = per_token_logps - old_per_token_logps
    if o.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)

    if o.beta != 0.0:
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if o.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if o.loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=o.upper_epsilon).detach() * advantages * per_token_logps
    elif o.loss_type in CLIPPED_LOSS_TYPES:
        coef_2 = torch.clamp(coef_1, 1 - o.epsilon, 1 + o.upper_epsilon)
        if o.delta is not None:
            coef_1 = torch.clamp(coef_1, max=o.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif o.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages
    else:  # vespo
        phi_seq = _gamma_weights(o, advantages, log_ratio, mask, importance_sampling_ratio)
        per_token_loss = -phi_seq * advantages * per_token_logps
    if importance_sampling_ratio is not None and o.loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio
    if o.beta != 0.0:
        per_token_loss = per_token_loss + o.beta * per_token_kl

    accumulation = o.gradient_accumulation_steps if training else 1.0
    if o.loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    elif o.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    elif o.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * o.max_completion_length) / accumulation
    elif o.loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean() / accumulation
    else:  # dapo, cispo, vespo
        items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        normalizer = items.clamp(min=1.0) / num_processes
        if training:
            steps_per_generation = o.steps_per_generation or o.gradient_accumulation_steps
            normalizer = normalizer * o.gradient_accumulation_steps / steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer

    def masked_mean(x):  # TRL's global_masked_mean in one process
        if x.shape[1] == 1:
            total, n = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            total, n = (x * mask).sum(), mask.sum().float()
        totals = torch.stack([total, n])
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def seq_reduce(x, reduce):  # TRL's nanmin / nanmax of the per-sequence means (0/0 for an empty completion)
        x = x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)
        kept = x[~torch.isnan(x)]
        return float("nan") if kept.numel() == 0 else reduce(kept).item()

    metrics = {}
    with torch.no_grad():
        if o.beta != 0.0:
            metrics["kl"] = masked_mean(per_token_kl)
        if entropies is not None:
            metrics["entropy"] = masked_mean(entropies)
        if o.loss_type in CLIPPED_LOSS_TYPES:
            low = ((coef_1 < 1 - o.epsilon) & (advantages < 0)).float()
            high = ((coef_1 > 1 + o.upper_epsilon) & (advantages > 0)).float()
            metrics["clip_ratio/low_mean"] = masked_mean(low)
            metrics["clip_ratio/high_mean"] = masked_mean(high)
            metrics["clip_ratio/region_mean"] = masked_mean(((low > 0) | (high > 0)).float())
            metrics["clip_ratio/low_min"] = seq_reduce(low, torch.min)
            metrics["clip_ratio/high_max"] = seq_reduce(high, torch.max)
        elif o.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = masked_mean(((coef_1 > o.upper_epsilon) & (advantages > 0)).float())
        elif o.loss_type == "vespo":
            metrics["vespo/phi_seq_mean"] = masked_mean(phi_seq)
    return loss, metrics
