"""What a GRPO run's console shows: the figures that move, a note on the loss, and a warning when learning stops.

On-policy (``num_iterations`` 1, ``beta`` 0) GRPO's loss stays near 0 by construction: each group's advantages average
0 and the policy ratio is 1 when the loss is taken, so ``loss 0.0000`` on every line says nothing about learning.
Each progress line therefore shows what does move: ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``kl`` (when
``beta`` > 0), the completions' mean length and ``val_reward`` when the step measured it; :data:`LOSS_NOTE` is printed
once, before the first line.

When every group's completions score the same (``frac_reward_zero_std`` 1.0) every advantage is 0 and the rewards
give no gradient. :class:`ZeroSpreadWatch` warns once, in one line, after :data:`ZERO_SPREAD_STEPS` such steps in a
row (counted from the start or resume of this process): one or two can be chance, five in a row is the run.
"""

from __future__ import annotations

from collections.abc import Mapping

LOSS_NOTE = ("note: GRPO's loss stays near 0 by construction (each group's advantages average 0 and the policy ratio "
             "is 1 on-policy), so it does not show learning; reward, reward_std and val_reward do")
ZERO_SPREAD_STEPS = 5  # steps in a row with frac_reward_zero_std 1.0 before the warning


def progress_values(record: Mapping[str, float]) -> dict[str, str]:
    """A step's ``record`` (its metrics.jsonl record, with ``val_reward`` when measured) as the progress line's
    figures, formatted."""
    shown = {"loss": f"{record['loss']:.4f}", "reward": f"{record['reward']:.3f}",
             "reward_std": f"{record['reward_std']:.3f}",
             "frac_reward_zero_std": f"{record['frac_reward_zero_std']:.2f}"}
    if "kl" in record:  # beta > 0
        shown["kl"] = f"{record['kl']:.4f}"
    shown["len"] = f"{record['completions/mean_length']:.1f}"
    shown["tok_s"] = f"{record['tokens_per_s']:.0f}"
    if "val_reward" in record:
        shown["val_reward"] = f"{record['val_reward']:.3f}"
    return shown


class ZeroSpreadWatch:
    """``update(step, frac_reward_zero_std)`` once a step: the warning line, once, at the ``steps``-th step in a row on
    which every group's rewards were equal (``steps``: :data:`ZERO_SPREAD_STEPS`); None otherwise."""

    def __init__(self, steps: int | None = None) -> None:
        self.steps, self.run, self.warned = steps or ZERO_SPREAD_STEPS, 0, False

    def update(self, step: int, frac_reward_zero_std: float) -> str | None:
        self.run = self.run + 1 if frac_reward_zero_std >= 1.0 else 0
        if self.warned or self.run < self.steps:
            return None
        self.warned = True
        return (f"warning: steps {step - self.steps + 1}-{step}: every group's completions got the same reward "
                "(frac_reward_zero_std 1.0), so every advantage is 0 and no gradient flows: the run learns nothing "
                "while this lasts; use harder prompts, a larger generation.num_generations, a higher "
                "generation.temperature, or a graded reward (partial credit) instead of a pass/fail one")
