"""Reward functions named in a config, and their values combined exactly as TRL 1.16's GRPOTrainer combines them.

``reward_funcs`` entries: a built-in's short name (``answer_match``), an import path ``module.function`` or
``module:function`` (the working directory is put first on ``sys.path``, as ``trl grpo`` does, so a user's
``my_rewards.py`` beside where they run is found), or a dict ``{name: <either>, <option>: <value>, ...}`` that
binds options with ``functools.partial``.

``score`` follows ``GRPOTrainer._calculate_rewards`` and the sum in ``_generate_and_score_completions``: each
function is called as ``f(prompts=..., completions=..., completion_ids=..., **columns)``; None becomes NaN; the
reward is ``(per_func * weights).nansum(dim=1)`` in float32 (a function's None leaves it out of that sum); a row
where every function gave None is unscorable and its reward is NaN (TRL then leaves it out of the group baseline
and sets its advantage to 0). A function that raises (``sys.exit`` included), returns something unusable or a
number that is not finite in float32 (``waypoint.rewards.finite``), or runs past ``timeout``, is a one-line
``RewardError`` naming it, the original exception chained as its cause. Each call runs bounded in the main thread
(``waypoint.rewards.bounded``): cut short at ``timeout``, or as soon as ``stop()`` is true (``Interrupted``).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import numbers
import os
import sys
from collections.abc import Callable, Mapping

import torch

from waypoint.errors import CheckpointError, first_line
from waypoint.rewards.bounded import Interrupted, TimedOut, bounded_call
from waypoint.rewards.finite import prompt_excerpt, sum_problem, value_problem
from waypoint.rewards.functions import BUILTINS

NOT_COLUMNS = ("prompt", "completion", "completion_ids")  # TRL passes these by their plural names instead
CALL_ARGS = ("prompts", "completions", "completion_ids")


class RewardError(CheckpointError):
    """A reward function that cannot be named, imported, called or used as it answered; one line naming it."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def reward_name(func: Callable) -> str:
    """The name TRL logs a function's rewards under (``rewards/<name>/mean``): a partial's wrapped function's
    ``__name__``, else the callable's ``__name__``, else its class name (``trl.trainer.utils.get_callable_name``)."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def resolve(names) -> list[Callable]:
    """The callables that ``reward_funcs`` names, in order; a ``RewardError`` for the first that cannot be had."""
    if isinstance(names, (str, Mapping)):
        names = [names]
    return [_resolve_one(entry) for entry in names]


def _resolve_one(entry) -> Callable:
    if _is_config(entry):
        from omegaconf import OmegaConf

        entry = OmegaConf.to_container(entry, resolve=True)
    if isinstance(entry, Mapping):
        options = dict(entry)
        name = options.pop("name", None)
        if not isinstance(name, str):
            raise RewardError(f"reward_funcs: {options}: a dict entry needs name: <function> beside its options")
    elif isinstance(entry, str):
        name, options = entry, {}
    else:
        raise RewardError(f"reward_funcs: {entry!r}: give module.function, or {{name: module.function, option: value}}")
    func = _lookup(name.strip())
    if options:
        _check_options(name, func, options)
        func = functools.partial(func, **options)
    return func


def _is_config(entry) -> bool:
    omegaconf = sys.modules.get("omegaconf")
    return omegaconf is not None and omegaconf.OmegaConf.is_config(entry)


def _lookup(name: str) -> Callable:
    if name in BUILTINS:
        return BUILTINS[name]
    return import_callable(name, "reward_funcs")


def import_callable(name: str, option: str) -> Callable:
    """What ``module.function`` (or ``module:function``, ``module.Class``) names, imported from the working directory
    or an installed module; a one-line ``RewardError`` naming ``option`` and ``name`` when it cannot be had."""
    if ":" in name:
        module, _, attrs = name.partition(":")
        splits = [(module, attrs.split("."))]
    elif "." in name:
        parts = name.split(".")
        splits = [(".".join(parts[:i]), parts[i:]) for i in range(len(parts) - 1, 0, -1)]
    else:
        known = f"not a built-in reward ({', '.join(BUILTINS)}); " if option == "reward_funcs" else ""
        raise RewardError(f"{option}: {name}: {known}give module.function, e.g. my_module.{name} for {name} in "
                          "my_module.py")
    cwd = os.getcwd()
    if not sys.path or sys.path[0] not in (cwd, ""):
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()
    for module_name, attrs in splits:
        try:
            module = importlib.import_module(module_name)
        except SystemExit as e:  # sys.exit() at import: an error, never the run's exit status
            raise RewardError(f"{option}: {name}: importing {module_name} called sys.exit({e.code!r}); "
                              "a module must not exit") from e
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue  # this prefix is no module: try a shorter one
            raise RewardError(f"{option}: {name}: importing {module_name} failed: {first_line(e)}; "
                              "install what it imports") from e
        except Exception as e:  # noqa: BLE001 (a user's file: anything can go wrong in it)
            raise RewardError(f"{option}: {name}: importing {module_name} raised "
                              f"{type(e).__name__}: {first_line(e)}") from e
        return _attribute(name, module, module_name, attrs, option)
    top = splits[-1][0].split(".")[0]
    raise RewardError(f"{option}: {name}: no module {top} in the working directory ({cwd}) nor installed; "
                      f"run from the folder holding {top}.py, or give an installed module's path")


def _attribute(name: str, module, module_name: str, attrs: list[str], option: str) -> Callable:
    obj = module
    for attr in attrs:
        if not hasattr(obj, attr):
            where = getattr(module, "__file__", None) or module_name
            raise RewardError(f"{option}: {name}: {module_name} ({where}) has no {'.'.join(attrs)}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise RewardError(f"{option}: {name}: is a {type(obj).__name__}, not a function")
    return obj


def _check_options(name: str, func: Callable, options: dict) -> None:
    """Options a function takes by name; any name for a user's function that takes ``**kwargs`` (it may read
    them there), but a built-in's options must be its own, so a misspelt one is not silently a column."""
    params = inspect.signature(func).parameters
    named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in CALL_ARGS]
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values()) and func not in BUILTINS.values()
    for key in options:
        if key in CALL_ARGS or (key not in {p.name for p in named} and not open_ended):
            have = ", ".join(p.name for p in named) or "none"
            raise RewardError(f"reward_funcs: {name}: no option {key} (options: {have})")


def score(funcs, weights, prompts, completions, completion_ids, columns=None, *, timeout: float | None = None,
          stop=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards [N] float32, per_func [N, F] float32 with NaN for None)`` for N completions and F functions.

    ``columns``: the dataset's other fields, each a list of N values (``prompt``, ``completion`` and
    ``completion_ids`` among them are dropped, as TRL does); other values (TRL's ``trainer_state``) pass as they
    are. ``weights``: one number per function, or None for all 1. An async function's coroutines run together.
    ``timeout``: the seconds one call may take (the async functions' coroutines: together); ``stop``: polled while
    a function runs, ``Interrupted`` once it is true (None: neither bound).
    """
    n = len(prompts)
    if not funcs:
        raise RewardError("reward_funcs: none given; name at least one reward function")
    if len(completions) != n:
        raise RewardError(f"score: {len(completions)} completions for {n} prompts")
    columns = {k: v for k, v in (columns or {}).items() if k not in NOT_COLUMNS}
    for key, values in columns.items():
        if isinstance(values, (list, tuple)) and len(values) != n:
            raise RewardError(f"score: column {key} has {len(values)} values for {n} completions")
    w = _weights(weights, len(funcs))
    per_func = torch.zeros(n, len(funcs), dtype=torch.float32)
    pending = []
    for i, func in enumerate(funcs):
        name = reward_name(func)
        call = functools.partial(func, prompts=prompts, completions=completions, completion_ids=completion_ids,
                                 **columns)
        try:
            out = bounded_call(call, timeout, stop)
        except Interrupted:
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001 (a user's function: anything can go wrong in it)
            raise _failed(name, e, timeout, prompts) from e
        if inspect.isawaitable(out):
            pending.append((i, name, out))
        else:
            per_func[:, i] = _values(name, out, prompts)
    if pending:
        finished = set()

        async def tracked(k, awaitable):
            try:
                out = await awaitable
            except (Exception, SystemExit) as e:  # noqa: BLE001
                out = e
            finished.add(k)
            return out

        async def gather():
            return await asyncio.gather(*(tracked(k, out) for k, (_, _, out) in enumerate(pending)))

        try:
            outs = bounded_call(lambda: asyncio.run(gather()), timeout, stop)
        except TimedOut as e:  # the first function whose coroutine was still running
            name = next(name for k, (_, name, _) in enumerate(pending) if k not in finished)
            raise _failed(name, e, timeout, prompts) from e
        for (i, name, _), out in zip(pending, outs, strict=True):
            if isinstance(out, BaseException):
                raise _failed(name, out, timeout, prompts) from out
            per_func[:, i] = _values(name, out, prompts)
    rewards = (per_func * w.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan  # unscorable: every function said None
    problem = sum_problem(rewards, per_func, w, [reward_name(f) for f in funcs], prompts)
    if problem:
        raise RewardError(problem)
    return rewards, per_func


def _failed(name: str, e: BaseException, timeout: float | None, prompts) -> RewardError:
    if isinstance(e, TimedOut):
        return RewardError(f"reward function {name} took longer than reward_timeout={timeout:g} s on {len(prompts)} "
                           f"completions (the first prompt: {prompt_excerpt(prompts[0]) if prompts else 'none'}); "
                           "make it return sooner, or raise reward_timeout")
    if isinstance(e, SystemExit):  # sys.exit() in a reward: an error, never the run's exit status
        return RewardError(f"reward function {name} called sys.exit({e.code!r}); return its values, or raise an "
                           "exception for an error")
    return RewardError(f"reward function {name} raised {type(e).__name__}: {first_line(e)}")


def _weights(weights, count: int) -> torch.Tensor:
    if weights is None:
        return torch.ones(count, dtype=torch.float32)
    weights = list(weights)
    if len(weights) != count:
        raise RewardError(f"reward_weights: {len(weights)} weights for {count} reward_funcs; give one per function")
    for weight in weights:
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise RewardError(f"reward_weights: {weight!r} is not a number")
    out = torch.tensor(weights, dtype=torch.float32)
    for weight, stored in zip(weights, out):
        if not torch.isfinite(stored):
            raise RewardError(f"reward_weights: {weight!r} is not a finite number in float32; give finite weights")
    return out


def _values(name: str, out, prompts) -> torch.Tensor:
    """One function's answer as N float32 values, None as NaN (TRL: ``torch.tensor([r if r is not None else nan
    ...], dtype=float32)``), or a ``RewardError`` saying what was wrong with it (a returned NaN, infinity or number
    past float32's range among it)."""
    n = len(prompts)
    if isinstance(out, torch.Tensor):
        out = out.tolist() if out.dim() == 1 else out
    if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__iter__"):
        raise RewardError(f"reward function {name} returned a {type(out).__name__}, not a list of {n} values "
                          "(one per completion)")
    values = list(out)
    if len(values) != n:
        raise RewardError(f"reward function {name} returned {len(values)} values for {n} completions; "
                          "return one per completion (None to leave one out)")
    for j, value in enumerate(values):
        if value is None:
            continue
        elif isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
            values[j] = _float(value)
        elif isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            values[j] = float(value.item())
        else:
            raise RewardError(f"reward function {name} returned {type(value).__name__} {repr(value)[:40]} for "
                              f"completion {j}; return a number or None")
    stored = torch.tensor([torch.nan if v is None else v for v in values], dtype=torch.float32)
    problem = value_problem(name, values, stored, prompts)
    if problem:
        raise RewardError(problem)
    return stored


def _float(value) -> float:
    try:
        return float(value)
    except OverflowError:  # an int past float64's range
        return float("inf") if value > 0 else float("-inf")

