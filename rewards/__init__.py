"""Reward functions for online RL (GRPO): built-in verifiable rewards (``functions``), and resolving user-named
functions and combining their values exactly as TRL's GRPOTrainer does (``scoring``)."""
