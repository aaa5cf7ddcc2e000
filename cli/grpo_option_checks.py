"""The options of recipes/grpo_finetune.py beside COMMON (and LORA when it has a lora section), with TRL's names:
each checked on its own before the run loads anything, so a typo or a value out of range is one line."""

from __future__ import annotations

import math
from collections.abc import Mapping

from waypoint.cli.option_checks import Check, Problem, boolean, integer, number, one_of, optional
from waypoint.models.nf4 import QUANTIZE_BASE
from waypoint.sampling.vllm_options import ENGINES
from waypoint.training.grpo_loss import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES


def scale_rewards(v) -> str | None:
    return None if v in ("group", "batch", "none") or isinstance(v, bool) else "group, batch, none, true or false"


def reward_funcs(v) -> str | None:
    entries = [v] if isinstance(v, (str, Mapping)) else v
    if entries is None or isinstance(entries, (list, tuple)) and all(
            (isinstance(e, str) and e) or (isinstance(e, Mapping) and isinstance(e.get("name"), str)) for e in entries):
        return None
    return ("a list of reward functions: built-in names (answer_match), module.function paths, or {name: ..., <option>: "
            "...}; [] only with an environment_factory whose environment has get_reward()")


def tools(v) -> str | None:
    entries = [v] if isinstance(v, str) else v
    if v is None or (isinstance(entries, (list, tuple)) and all(isinstance(e, str) and e for e in entries)):
        return None
    return "null or a list of module.function paths (functions with type hints and a Google-style docstring)"


def import_path(v) -> str | None:
    return None if v is None or (isinstance(v, str) and v) else "null or a module.Class path"


def reward_weights(v) -> str | None:
    if v is None or (isinstance(v, (list, tuple)) and all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                          and math.isfinite(w) for w in v)):
        return None
    return "null (all 1) or a list of finite numbers, one per reward function"


def stop_strings(v) -> str | None:
    return None if v is None or (isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v)) \
        else "null or a list of non-empty strings"


def generation(v) -> str | None:
    """The group must fit the completions per prompt; top_k 0 and top_p 1 are off."""
    if not isinstance(v, Mapping):
        return "a section {num_generations, max_completion_length, temperature, top_p, top_k, ...}"
    if v.get("temperature") == 0 and isinstance(v.get("num_generations"), int) and v["num_generations"] > 1:
        return Problem("generation.temperature=0 samples every completion of a group alike (no advantage to learn "
                       "from); set generation.temperature > 0 (TRL's default: 1.0)")
    return None


def vllm_section(v) -> str | Problem | None:
    """The ``vllm`` section's keys and values (``sampling.vllm_options``: TRL's names), checked without vLLM."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        return "null or a section {vllm_mode, vllm_gpu_memory_utilization, vllm_importance_sampling_mode, ...}"
    from waypoint.sampling.vllm_options import vllm_options

    try:
        vllm_options(v)
    except ValueError as e:
        return Problem(str(e))
    return None


GRPO: dict[str, tuple[bool, Check]] = {
    "reward_funcs": (False, reward_funcs),  # optional where an environment_factory's get_reward() scores
    "tools": (False, tools),  # multi-turn rollouts with tools (TRL's tools), README: Agents
    "environment_factory": (False, import_path),  # TRL's environment_factory: module.Class
    "tool_timeout": (False, number(0, inclusive=False)),  # seconds one tool call may take; past it, an error message
    "generation.max_tool_calling_iterations": (False, optional(integer(0))),
    "reward_weights": (False, reward_weights),
    "reward_timeout": (False, number(0, inclusive=False)),  # seconds one reward call may take
    "generation": (True, generation),
    "generation.num_generations": (True, integer(2)),
    "generation.max_completion_length": (True, integer(1)),
    "generation.temperature": (False, number(0)),
    "generation.top_p": (False, number(0, inclusive=False, at_most=1)),
    "generation.top_k": (False, integer(0)),
    "generation.repetition_penalty": (False, number(0, inclusive=False)),
    "generation.stop_strings": (False, stop_strings),
    "generation.mask_truncated_completions": (False, boolean),
    "generation.engine": (False, one_of(*ENGINES)),  # who samples: the policy's own decode loop, or vLLM
    "use_vllm": (False, boolean),  # TRL's name for generation.engine=vllm
    "vllm": (False, vllm_section),
    "loss.loss_type": (True, one_of(*LOSS_TYPES)),
    "loss.importance_sampling_level": (False, one_of(*IMPORTANCE_SAMPLING_LEVELS)),
    "loss.scale_rewards": (False, scale_rewards),
    "loss.beta": (False, number(0)),
    "loss.epsilon": (False, number(0)),
    "loss.epsilon_high": (False, optional(number(0))),
    "loss.delta": (False, optional(number(0))),
    "loss.num_iterations": (False, integer(1)),
    "dataset.max_prompt_length": (False, optional(integer(1))),
    "lora": (False, lambda v: None if v is None or isinstance(v, Mapping)
             else "null (full fine-tuning) or a section {targets, rank, alpha, dropout}"),
    "quantize_base": (False, optional(one_of(*QUANTIZE_BASE))),
}
