"""The tools a multi-turn rollout may call, as TRL 1.16's ``GRPOTrainer(tools=..., environment_factory=...)`` takes
them, and each call made safe: a model's tool call is untrusted input.

* ``tools: [module.function, ...]``: plain functions (sync or async), their JSON schemas from type hints and
  docstrings (``waypoint.agents.tool_schema``, as transformers' ``get_json_schema``).
* ``environment_factory: module.Class``: a class (or any callable) returning an environment: a callable ``reset(**row)``
  (the dataset row, its prompt included; it may return text appended to the last user message) and public methods
  that are tools; an optional ``get_reward()`` scores the rollout (a reward function named after the class, weight 1).
  Unlike TRL, which pools instances and resets them, every rollout gets a new one, so nothing of one rollout reaches
  another and a resumed run rebuilds exactly what the uninterrupted one had; ``reset`` receives ``seed`` (the
  rollout's) where it names that parameter.

A call (``Toolbox.call``) never raises for what the model wrote: an unknown tool, arguments that are not an object or
that the function does not take, an exception inside the tool (``SystemExit`` included), or a call running past
``tool_timeout`` seconds all become the error TRL gives the model (``{'error': '...'}`` as text) and count as
failures (TRL's ``tools/failure_frequency``). Only a preemption signal (``Interrupted``) leaves a call.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from waypoint.agents.tool_schema import ToolSchemaError, tool_name, tool_schema
from waypoint.errors import CheckpointError, first_line
from waypoint.rewards.bounded import Interrupted, TimedOut, bounded_call
from waypoint.rewards.scoring import import_callable

NOT_TOOLS = ("reset", "get_reward")  # an environment's methods that are its protocol, not tools


class ToolError(CheckpointError):
    """A tool or environment that cannot be imported, described or set up: one line, at the start of the run."""


def environment_methods(environment) -> list[Callable]:
    """An environment's tools: its class's public functions but ``reset`` and ``get_reward``, bound to it (found on
    the class, as TRL finds them, so that a property is never evaluated)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


@dataclass
class ToolSet:
    """What a run's rollouts may call: ``tools`` (standalone functions) and ``factory`` (the environment class or
    None); ``schemas``: every tool's JSON schema, as the prompt renders them; ``env_reward``: the environment has
    ``get_reward``; ``timeout``: seconds one call may take (None: unbounded)."""

    tools: list[Callable]
    factory: Callable | None
    schemas: list[dict]
    env_reward: bool
    timeout: float | None

    @classmethod
    def load(cls, tools, environment_factory, timeout: float | None) -> ToolSet | None:
        """The config's ``tools`` and ``environment_factory`` imported, described and checked (one probe environment
        built), or None when neither is set; a ``ToolError`` naming the first that cannot be had."""
        names = [tools] if isinstance(tools, str) else list(tools or [])
        if not names and not environment_factory:
            return None
        functions = [import_callable(str(name), "tools") for name in names]
        factory = import_callable(str(environment_factory), "environment_factory") if environment_factory else None
        methods, env_reward = [], False
        if factory is not None:
            try:
                probe = factory()
            except Exception as e:  # noqa: BLE001 (a user's class)
                raise ToolError(f"environment_factory: {environment_factory}() raised {type(e).__name__}: "
                                f"{first_line(e)}") from e
            if not callable(getattr(probe, "reset", None)):
                raise ToolError(f"environment_factory: {environment_factory}: its environment has no reset() method; "
                                "define reset(self, **kwargs) returning None or text for the prompt (TRL's interface)")
            methods = environment_methods(probe)
            env_reward = callable(getattr(probe, "get_reward", None))
        all_tools = functions + methods
        if not all_tools:
            raise ToolError(f"environment_factory: {environment_factory}: its environment has no public methods to "
                            "call as tools; give it one, or name functions in tools")
        seen: dict[str, Callable] = {}
        for tool in all_tools:
            name = tool_name(tool)
            if name in seen:
                raise ToolError(f"tools: two tools are named {name}; the model calls a tool by its name, so rename one")
            seen[name] = tool
        try:
            schemas = [tool_schema(tool) for tool in all_tools]
        except ToolSchemaError as e:
            raise ToolError(str(e)) from e
        return cls(functions, factory, schemas, env_reward, timeout)

    def toolbox(self, row: dict, seed: int, stop: Callable[[], bool] | None = None) -> tuple[Toolbox, str | None]:
        """A rollout's tools (a new environment, reset with the dataset ``row`` and ``seed``, bounded by the tool
        timeout and ``stop`` as a call is) and the text ``reset`` returned for the prompt (None: nothing)."""
        environment, observation = None, None
        if self.factory is not None:
            environment = self.factory()
            kwargs = dict(row)
            if "seed" in inspect.signature(environment.reset).parameters and "seed" not in kwargs:
                kwargs["seed"] = seed
            try:
                observation = bounded_call(lambda: environment.reset(**kwargs), self.timeout, stop)
            except Interrupted:
                raise
            except TimedOut as e:  # a reset that never returns would hang the run
                raise ToolError(f"environment_factory: {type(environment).__name__}.reset took longer than "
                                f"tool_timeout={self.timeout:g} s; make it return sooner, or raise tool_timeout") from e
            except (Exception, SystemExit) as e:  # noqa: BLE001 (a user's environment: its bug stops the run in one line)
                raise ToolError(f"environment_factory: {type(environment).__name__}.reset raised {type(e).__name__}: "
                                f"{first_line(e)}") from e
            if observation is not None and not isinstance(observation, str):
                raise ToolError(f"environment_factory: {type(environment).__name__}.reset returned a "
                                f"{type(observation).__name__}; return None or text to append to the prompt")
        tools = self.tools + (environment_methods(environment) if environment is not None else [])
        return Toolbox({tool_name(t): t for t in tools}, environment, self.timeout), observation


class Toolbox:
    """One rollout's tools by name (and its environment); counts the calls made and those that failed."""

    def __init__(self, tools: dict[str, Callable], environment, timeout: float | None) -> None:
        self.tools, self.environment, self.timeout = tools, environment, timeout
        self.calls = self.failures = 0

    def call(self, name: str, arguments, stop: Callable[[], bool] | None = None) -> str:
        """The tool message's content for one call: the result as text (``str(result)``, as TRL writes it), or
        ``{'error': ...}`` for a call that failed."""
        self.calls += 1
        try:
            return str(self._result(name, arguments, stop))
        except Interrupted:
            raise
        except TimedOut:
            return self.failed(name, f"tool {name} took longer than tool_timeout={self.timeout:g} s")
        except (Exception, SystemExit) as e:  # noqa: BLE001 (the model's call into a user's function)
            return self.failed(name, str(e) if not isinstance(e, SystemExit) else f"tool {name} called sys.exit()")

    def failed(self, name: str, why: str) -> str:
        """The error a call that could not be made gives the model (counted as a failure)."""
        self.failures += 1
        return str({"error": why})

    def _result(self, name: str, arguments, stop):
        if name not in self.tools:
            raise ValueError(f"Tool {name} not found.")
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments of {name} must be an object, got {type(arguments).__name__}")
        tool = self.tools[name]

        def run():
            out = tool(**arguments)
            return asyncio.run(out) if inspect.isawaitable(out) else out
        return bounded_call(run, self.timeout, stop)


def reward_of(environment_class_name: str) -> Callable:
    """The reward function of environments that own their reward: ``get_reward()`` of each rollout's environment,
    logged under the class's name (TRL: ``rewards/<Class>/mean``)."""
    def get_reward(environments, **_) -> list:
        return [e.get_reward() if e is not None and callable(getattr(e, "get_reward", None)) else None
                for e in environments]
    get_reward.__name__ = get_reward.__qualname__ = environment_class_name
    return get_reward
