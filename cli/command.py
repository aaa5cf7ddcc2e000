"""What every command (recipe or script) does with bad input: one line, ``error: ...``, naming the file, key
or option, and exit status 1 (2 for a malformed command line). ``WAYPOINT_DEBUG=1`` shows the traceback.

A ``sys.exit()`` inside the command's work (a user's class that Hydra instantiates, a callback) is such an error too:
left alone it would end a training run with exit status 0 and no ``done:`` line, which a scheduler records as a
success. The line names the function that exited. argparse's own exits (``--help``, a malformed command line) come
before the work starts and are left as they are."""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path

from waypoint.errors import CheckpointError, first_line

DEBUG = "WAYPOINT_DEBUG"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, without the usage block; ``OneLineParser.for_script(__doc__)`` takes the
    description from a script's docstring and shows its first ``python ...`` usage line as the example."""

    @classmethod
    def for_script(cls, doc: str, **kwargs) -> "OneLineParser":
        usage = next((line.strip() for line in doc.splitlines() if line.strip().startswith("python ")), None)
        return cls(description=doc.splitlines()[0], epilog=f"example: {usage}" if usage else None, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def describe(e: BaseException) -> str:
    """The first line of what went wrong; an OSError as ``FILE: reason``; an error raised by a constructor that
    Hydra instantiated as the constructor's own."""
    from hydra.errors import InstantiationException

    if isinstance(e, InstantiationException) and isinstance(e.__cause__, TypeError):
        unknown = unknown_option(str(e), str(e.__cause__))
        if unknown:
            return unknown
    if isinstance(e, InstantiationException) and e.__cause__ is not None:
        e = e.__cause__
    if isinstance(e, SystemExit):
        return (f"{exiting_function(e)} called sys.exit({e.code!r}), which ended the run before it finished; "
                "raise an exception there instead of exiting (the run stops here, exit status 1)")
    if isinstance(e, OSError) and not isinstance(e, CheckpointError) and e.strerror:
        where = e.filename if e.filename is not None else ""
        return f"{where}: {e.strerror}" if where else e.strerror
    return first_line(e)


def unknown_option(instantiating: str, error: str) -> str | None:
    """``Class has no option 'x' (did you mean y?)`` for a config key that the class Hydra instantiated does not take
    (a typo in a section the early checks do not cover), from Hydra's message and the class's signature."""
    import re

    from waypoint.cli.option_checks import constructor_options, unknown_option_line

    key = re.search(r"got an unexpected keyword argument '([^']+)'", error)
    target = re.search(r"target '([^']+)'", instantiating)
    options = constructor_options(target.group(1)) if key and target else None
    return unknown_option_line(target.group(1), key.group(1), options) if options is not None else None


def exiting_function(e: SystemExit) -> str:
    """``module.function (file:line)`` of the innermost frame of ``e``'s traceback outside Waypoint and the standard
    library (a user's function, not argparse's ``exit`` it called), else outside Waypoint, else the innermost."""
    frames = list(traceback.walk_tb(e.__traceback__))  # (frame, line), outermost first
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()

    def waypoint_s(frame) -> bool:
        return frame.f_globals.get("__name__", "").split(".")[0] == "waypoint"

    def standard(frame) -> bool:
        path = Path(frame.f_code.co_filename).resolve()
        return path.is_relative_to(stdlib) and not {"site-packages", "dist-packages"} & set(path.parts)

    # a library that wraps sys.exit (W&B's exit hooks, installed by wandb.init) is not who called it
    exit_code = getattr(getattr(sys.exit, "__func__", sys.exit), "__code__", None)
    frames = [(f, line) for f, line in frames if f.f_code is not exit_code] or frames
    outside = [(f, line) for f, line in frames if not waypoint_s(f)]
    candidates = [(f, line) for f, line in outside if not standard(f)] or outside or frames
    if not candidates:
        return "the command"
    frame, line = candidates[-1]
    code = frame.f_code
    return f"{frame.f_globals.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{line})"


def user_errors() -> tuple[type[BaseException], ...]:
    from hydra.errors import InstantiationException

    return CheckpointError, OSError, InstantiationException


def report(e: BaseException) -> int:
    """Print ``e`` as one ``error:`` line (under torchrun, ranks other than 0 prefix theirs); exit status 1."""
    rank = int(os.environ.get("RANK", "0"))
    print(f"\n{f'[rank {rank}] ' if rank else ''}error: {describe(e)}", file=sys.stderr)  # after any progress bar
    return 1


def _collect_then_freeze() -> None:
    """At exit: collect the garbage there is (finalizing whatever still holds a file), then freeze every object, so
    that the interpreter's own final collection skips them. Left to it, it spends about a second tearing down the
    object graphs of torch's, sympy's and hydra's modules, memory the OS takes back anyway (measured on 2 cores: 0.9 s
    between a tiny run's last line and its exit, 0.3 s so)."""
    gc.collect()
    gc.freeze()


def run_command(fn: Callable[[], int], also: tuple[type[BaseException], ...] = ()) -> int:
    """``fn()``, with bad input (and Ctrl-C) reported in one line; ``also``: further error types that only the
    command's input raises (recipes/generate.py: ValueError, which the training recipes' datasets raise through Hydra)."""
    atexit.unregister(_collect_then_freeze)  # once per process, however many commands run in it
    atexit.register(_collect_then_freeze)
    try:
        return fn()
    except (*user_errors(), *also) as e:
        if os.environ.get(DEBUG):
            raise
        return report(e)
    except SystemExit as e:  # sys.exit() in the work: never a silent success (argparse's exits come before fn)
        if os.environ.get(DEBUG):
            traceback.print_exception(e)  # raised, it would end the process with e.code and no traceback
        return report(e)
    except KeyboardInterrupt:
        if os.environ.get(DEBUG):
            raise
        print("\nerror: interrupted", file=sys.stderr)
        return 130
