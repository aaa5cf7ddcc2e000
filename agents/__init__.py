"""Tools and environments for multi-turn online RL: a tool's JSON schema from its signature and docstring, each model
family's tool-call format, and the calls themselves, bounded and never trusted."""
