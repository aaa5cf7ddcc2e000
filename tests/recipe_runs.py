"""A recipe run as a test needs it: its exit status and what it printed.

In the test's own process (``recipes/NAME.py``'s ``main(argv)``) wherever that is the same run: a child Python
pays about 3 s of imports and start-up per run, most of a tiny run's time. ``main`` is built to be called so (it
puts back the signal handlers it installs, reports bad input as one line and returns the exit status), and a
signal fault is a real signal to this process. A process of its own (forked with the recipes already imported:
``tests/launch.py``) only where the run must really die (a SIGKILL fault), needs process-wide limits
(``preexec_fn``) or another working directory.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from tests.faults import injected, kills
from tests.launch import RECIPES, launch


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    ranks: list[str] = field(default_factory=list)  # each rank's output, stdout then stderr (runs of their own)


@contextlib.contextmanager
def environment(env: Mapping[str, str] | None) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def in_process(main: Callable[[list[str]], int], argv: list[str], fault=None, env=None) -> Finished:
    """``main(argv)`` here, with ``fault`` injected and ``env`` added to the environment for the call."""
    out, err = io.StringIO(), io.StringIO()
    with environment(env), injected(fault), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's exit on a malformed command line
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Finished(code, out.getvalue(), err.getvalue())


def run_recipe(recipe: str, argv: list[str], *, fault=None, env=None, preexec_fn=None, cwd=None, processes: int = 1,
               rank_env: list[dict] | None = None, timeout: int = 300) -> Finished:
    """``recipes/{full,lora,dpo,grpo}_finetune.py`` (``recipe``: full, lora, dpo or grpo; or a script's path, run in
    processes of its own) with ``argv``;
    ``fault``: ``[MODE, A, B]`` of ``tests/faults.py``. A run that must die, needs process-wide settings or runs
    as several ranks (``processes``, as torchrun starts them) runs in processes forked for it (``tests/launch.py``)."""
    if not (kills(fault or []) or preexec_fn or cwd or processes > 1 or rank_env):
        return in_process(importlib.import_module(f"recipes.{RECIPES[recipe]}").main, list(argv), fault, env)
    return Finished(*launch(recipe, list(argv), processes=processes, fault=fault, env=env, cwd=cwd,
                            preexec_fn=preexec_fn, rank_env=rank_env, timeout=timeout))


def run_script(name: str, argv: list[str]) -> Finished:
    """``scripts/NAME.py`` with ``argv``, in this process."""
    return in_process(importlib.import_module(f"scripts.{name}").main, list(argv))
