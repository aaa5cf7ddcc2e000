"""How a command shows progress: tqdm bars on a terminal, none in a log.

A bar redraws itself with carriage returns; written to a file (a cluster job's log, ``2> run.log``) every redraw
stays, about 150 bytes a training step and more for each file loaded or saved. ``progress`` is set once per
command (a recipe's config: ``progress: auto | bar | lines | off``): ``auto`` is ``bar`` where stderr is a
terminal and ``lines`` where it is not; ``lines`` and ``off`` draw no bar (a training run then prints one plain
line every few steps, ``waypoint.run.progress``, or nothing). Every bar of loading, saving and transfers is made
here, so all of them follow the setting.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from tqdm import tqdm

STYLES = ("auto", "bar", "lines", "off")
_style = ["auto"]


@contextlib.contextmanager
def progress_shown(style: str) -> Iterator[None]:
    """Within the block (a command's life) progress is shown as ``style``; the setting before it comes back after."""
    if style not in STYLES:
        raise ValueError(f"progress={style}: expected one of {', '.join(STYLES)}")
    before, _style[0] = _style[0], style
    try:
        yield
    finally:
        _style[0] = before


@contextlib.contextmanager
def lines_as_printed() -> Iterator[None]:
    """Within the block, stdout is line-buffered: a log (stdout redirected to a file or a pipe) gets each line as it
    is printed, as a terminal does, not 8 KB at a time (a run's load report would wait for its first progress line).
    As it was after."""
    stream = sys.stdout
    before = getattr(stream, "line_buffering", None)
    if before is not False or not hasattr(stream, "reconfigure"):
        yield
        return
    stream.reconfigure(line_buffering=True)
    try:
        yield
    finally:
        try:
            stream.reconfigure(line_buffering=before)
        except (OSError, ValueError):  # closed meanwhile
            pass


def progress_style() -> str:
    """The setting, with ``auto`` resolved for this process's stderr: bar, lines or off."""
    if _style[0] != "auto":
        return _style[0]
    stream = sys.stderr
    return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"


def bar(*args, **kwargs) -> tqdm:
    """``tqdm(*args, **kwargs)``, drawn only where the setting is ``bar`` (and the caller does not disable it)."""
    kwargs["disable"] = kwargs.get("disable", False) or progress_style() != "bar"
    return tqdm(*args, **kwargs)


def byte_bar(total: int, desc: str, **kwargs) -> tqdm:
    """A bar over ``total`` bytes (loading, saving, uploads and downloads)."""
    return bar(total=total, unit="B", unit_scale=True, desc=desc, **kwargs)
