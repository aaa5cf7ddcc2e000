"""``waypoint validate``: a config composed and checked as its recipe would at start, with every problem found
rather than the first, and nothing read but the config (no checkpoint, no dataset, no download) and nothing written.

The checks are the recipe's own (its ``CHECKS`` table, the one its ``main`` passes to the config parser), plus
whether the local inputs it names exist; an object-store or ``hf://`` input is not looked up.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from omegaconf import OmegaConf

from waypoint.cli.config import compose_config
from waypoint.cli.option_checks import COMMON, option_problems
from waypoint.errors import CheckpointError, first_line

INPUTS = ("checkpointer.checkpoint_dir", "dataset.source", "checkpoint_dir", "adapter_dir")  # local paths read at start


def problems(config: Path, overrides: list[str], recipe: Path | None) -> list[str]:
    """One line per problem of ``config`` with ``overrides`` for ``recipe`` (None: the common options)."""
    try:
        cfg = compose_config(config, overrides)
    except (CheckpointError, FileNotFoundError) as e:
        return [first_line(e)]
    checks = runpy.run_path(str(recipe), run_name="waypoint_validate").get("CHECKS", COMMON) if recipe else COMMON
    found = option_problems(cfg, checks)
    values = OmegaConf.to_container(cfg, resolve=True)
    for key in INPUTS:
        value = _lookup(values, key)
        if isinstance(value, str) and value and "://" not in value and not Path(value).expanduser().exists():
            found.append(f"{key}={value}: no such file or folder")
    return found


def _lookup(values, dotted: str):
    for part in dotted.split("."):
        if not isinstance(values, dict) or part not in values:
            return None
        values = values[part]
    return values


__all__ = ["problems"]
