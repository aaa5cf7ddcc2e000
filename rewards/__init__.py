"""Reward functions for online RL (GRPO): built-in verifiable rewards (``functions``), and resolving user-named
functions and combining their values exactly as TRL's GRPOTrainer does (``scoring``)."""

from waypoint.rewards.functions import BUILTINS, answer_match, format_reward, length_penalty
from waypoint.rewards.scoring import RewardError, resolve, score

__all__ = ["BUILTINS", "RewardError", "answer_match", "format_reward", "length_penalty", "resolve", "score"]
