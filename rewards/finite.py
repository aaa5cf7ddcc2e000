"""Rewards a step can learn from: every value a reward function gave, its weighted sum and its group's mean and
spread finite in float32, or one line saying which function, weight and prompt made them not.

A NaN, an infinity or a value past float32's range (1e308 is +inf there) would otherwise turn into advantages of 0:
a step that trains nothing and reports success. None stays what TRL makes it, NaN for "this function does not
score this completion"; only a number the function actually returned counts here.
"""

from __future__ import annotations

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max


def prompt_excerpt(prompt) -> str:
    """A prompt, as an error names it: its text (a conversation's last message), whitespace runs as one space,
    cut at 40 characters."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        content = prompt[-1].get("content")
        prompt = content if isinstance(content, str) else " ".join(
            b.get("text", "") for b in content or () if isinstance(b, dict))
    text = " ".join(str(prompt).split())
    return repr(text if len(text) <= 40 else text[:40] + "...")


def value_problem(name: str, values: list, stored: torch.Tensor, prompts) -> str | None:
    """What is wrong with function ``name``'s ``values`` (numbers, NaN for None) as ``stored`` in float32."""
    for j, value in enumerate(values):
        if value is None or bool(torch.isfinite(stored[j])):
            continue
        past = f", past float32's range (+-{FLOAT32_MAX:.1e})" if value == value and abs(value) != float("inf") else ""
        return (f"reward function {name} returned {value!r} for completion {j}{past} "
                f"(prompt {prompt_excerpt(prompts[j])}); return a finite number, or None to leave the completion out")
    return None


def sum_problem(rewards: torch.Tensor, per_func: torch.Tensor, weights: torch.Tensor, names: list[str],
                prompts) -> str | None:
    """What is wrong with the weighted sums ``rewards`` [N] of ``per_func`` [N, F] (NaN only where every function
    gave None)."""
    scored = ~torch.isnan(per_func).all(dim=1)
    bad = (scored & ~torch.isfinite(rewards)).nonzero()
    if not len(bad):
        return None
    j = int(bad[0])
    terms = ", ".join(f"{name} {float(v):g} x {float(w):g}" for name, v, w in zip(names, per_func[j], weights)
                      if not torch.isnan(v))
    return (f"reward_weights: the weighted sum of completion {j}'s rewards ({terms}) is past float32's range "
            f"(prompt {prompt_excerpt(prompts[j])}); scale the rewards or reward_weights down")


def group_problem(rewards: torch.Tensor, num_generations: int, scale_rewards, prompt_of) -> str | None:
    """What is wrong with the mean and spread ``waypoint.training.grpo_loss.group_advantages`` takes of ``rewards``
    [N] (groups of ``num_generations``; ``scale_rewards`` batch: the spread over all of them, none: no spread);
    ``prompt_of(g)``: how to name group ``g``'s prompt. They overflow float32 where the rewards are finite but large
    (1e20: its square)."""
    groups = rewards.view(-1, num_generations)
    spans = [groups] + ([rewards.view(1, -1)] if scale_rewards == "batch" else [])
    for span in spans:
        mean = torch.nanmean(span, dim=1, keepdim=True)
        overflow = torch.isinf(mean).squeeze(1) | torch.isinf(span - mean).any(dim=1)
        if scale_rewards not in ("none", False):  # the spread divides the advantages
            overflow |= torch.isinf(torch.nanmean((span - mean) ** 2, dim=1) * 2)  # x2: Bessel's correction at most
        if bool(overflow.any()):
            g = int(overflow.nonzero()[0])
            values = span[g][~torch.isnan(span[g])]
            where = f"prompt {prompt_of(g)}'s group" if span is groups else "the step's rewards (scale_rewards=batch)"
            return (f"the rewards of {where} ({float(values.min()):g} to {float(values.max()):g}) overflow float32 "
                    "when their mean and spread are taken for the advantages; scale the rewards or reward_weights down")
    return None
