"""The tools of the multi-turn GRPO example (README: Agents): a calculator, as functions for ``tools`` and as an
environment for ``environment_factory`` (TRL 1.16's interfaces), and the reward of its task. The functions' schemas
(no return type: none is written) are those of assets/tiny_agent.jsonl's records, which the SFT stage trains on."""

from __future__ import annotations

from waypoint.rewards.functions import completion_text


def add(a: int, b: int):
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def multiply(a: int, b: int):
    """Multiply two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


class Calculator:
    """A calculator that remembers what the rollout computed: its reward is 1 when a result equals the answer."""

    def reset(self, answer: str = "", **kwargs) -> None:
        self.answer, self.results = str(answer), []

    def add(self, a: int, b: int):
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.results.append(a + b)
        return a + b

    def multiply(self, a: int, b: int):
        """Multiply two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.results.append(a * b)
        return a * b

    def get_reward(self) -> float:
        return float(any(str(r) == self.answer for r in self.results))


def used_the_answer(completions, answer, **kwargs) -> list[float]:
    """1 for a rollout whose final message states the answer after a tool returned it, 0.5 for the answer stated
    without a tool, else 0 (completions as TRL passes them with tools: the rollout's messages)."""
    out = []
    for messages, expected in zip(completions, answer):
        tool_said = any(m.get("role") == "tool" and str(m.get("content")) == str(expected) for m in messages)
        final = completion_text([m for m in messages if m.get("role") == "assistant"][-1:] or "")
        stated = str(expected) in final
        out.append(1.0 if stated and tool_said else 0.5 if stated else 0.0)
    return out
