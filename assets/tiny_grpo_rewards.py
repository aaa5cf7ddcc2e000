"""The reward of the tiny online-RL example (configs/tiny_grpo.yaml), a user's reward file as TRL takes one: a
function ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, here found by its import path
``waypoint.assets.tiny_grpo_rewards.letter_share`` (a file of your own beside where you run: ``my_rewards.f``).

The task: each prompt is one letter written a few times (the record's ``letter`` column: a or x); a completion earns
the share of its (non-space) characters that are that letter, so a random model's rewards differ within a group and
the policy can learn to answer each prompt with its own letter."""


def letter_share(prompts, completions, completion_ids, letter, **kwargs):
    rewards = []
    for completion, wanted in zip(completions, letter):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        kept = [c for c in text if not c.isspace()]
        rewards.append(sum(c == wanted for c in kept) / len(kept) if kept else 0.0)
    return rewards
