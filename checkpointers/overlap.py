"""Whether two paths overlap, judged on resolved real paths (symlinks and ``..`` followed), so that no
output is ever written over, into or around what a command reads."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from waypoint.errors import CheckpointError


def real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def relation(path: str | os.PathLike, other: str | os.PathLike) -> str | None:
    """``"is"``, ``"lies inside"``, ``"contains"`` (``path`` relative to ``other``) or None."""
    a, b = real(path), real(other)
    if a == b:
        return "is"
    if a.is_relative_to(b):
        return "lies inside"
    if b.is_relative_to(a):
        return "contains"
    return None


def refuse_overlap(output: str | os.PathLike, inputs: Mapping[str, str | os.PathLike], output_label: str = "the output") -> None:
    """A one-line error when ``output`` is one of ``inputs`` (label -> path), lies inside one or contains one."""
    for label, path in inputs.items():
        how = relation(output, path)
        if how:
            raise CheckpointError(f"{output_label} {output} {how} {label} {path}, which this command reads; "
                                  "choose an output outside it")
