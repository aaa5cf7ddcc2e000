"""A recipe run as a test needs it: its exit status and what it printed.

In the test's own process (``recipes/NAME.py``'s ``main(argv)``) wherever that is the same run: a child Python
pays about 3 s of imports and start-up per run, most of a tiny run's time. ``main`` is built to be called so (it
puts back the signal handlers it installs, reports bad input as one line and returns the exit status), and a
signal fault is a real signal to this process. A child process only where the run must really die (a SIGKILL
fault), needs process-wide limits (``preexec_fn``) or another working directory.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.faults import injected, kills

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"full": "full_finetune", "lora": "lora_finetune", "dpo": "dpo_finetune", "grpo": "grpo_finetune"}


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


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


def run_recipe(recipe: str, argv: list[str], *, fault=None, env=None, preexec_fn=None, cwd=None,
               timeout: int = 300) -> Finished:
    """``recipes/{full_finetune,lora_finetune,dpo_finetune}.py`` (``recipe``: full, lora or dpo) with ``argv``;
    ``fault``: ``[MODE, A, B]`` of ``tests/faults.py``."""
    if not (kills(fault or []) or preexec_fn or cwd):
        return in_process(importlib.import_module(f"recipes.{RECIPES[recipe]}").main, list(argv), fault, env)
    script = [str(ROOT / "tests/interrupt.py"), *fault, "--"] if fault else [str(ROOT / f"recipes/{RECIPES[recipe]}.py")]
    done = subprocess.run([sys.executable, *script, *argv], cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec_fn, start_new_session=True,  # a group of its own to kill
                          env={**os.environ, "PYTHONPATH": str(ROOT), "INTERRUPT_RECIPE": recipe, **(env or {})})
    return Finished(done.returncode, done.stdout, done.stderr)


def run_script(name: str, argv: list[str]) -> Finished:
    """``scripts/NAME.py`` with ``argv``, in this process."""
    return in_process(importlib.import_module(f"scripts.{name}").main, list(argv))
