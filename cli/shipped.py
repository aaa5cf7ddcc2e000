"""What ships with Waypoint beside its libraries: the recipes, their configs, the scripts and the tiny assets, found
the same way in a checkout (the repository's top-level ``recipes/``, ``configs/``, ``scripts/``, ``assets/``) and in an
installed wheel (the same folders inside the ``waypoint`` package: ``pyproject.toml`` ships them there).

A config names its recipe in its header (``python recipes/lora_finetune.py --config configs/...``): that line is
what ``waypoint ls`` groups configs by, so the listing cannot drift from the files. ``assets/...`` in a config means
the shipped tiny assets wherever the current directory has no ``assets/`` of its own (:func:`shipped_asset`), so
``waypoint run full_finetune --config tiny`` works from any directory.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import waypoint

ASSETS = "assets/"
_RECIPE_LINE = re.compile(r"recipes/([A-Za-z0-9_]+)\.py")


def data_root() -> Path:
    """The folder holding ``recipes/``, ``configs/``, ``scripts/`` and ``assets/``: the installed package's own
    folder in a wheel, the repository's root in a checkout."""
    package = Path(waypoint.__file__).resolve().parent
    return package if (package / "configs").is_dir() else package.parent


def recipes() -> dict[str, Path]:
    """Recipe name -> its script, in name order."""
    return {p.stem: p for p in sorted((data_root() / "recipes").glob("*.py")) if not p.name.startswith("_")}


def configs() -> dict[str, Path]:
    """Config name (the file's stem) -> its file, in name order; the group folders (``checkpointer/``) are not configs."""
    return {p.stem: p for p in sorted((data_root() / "configs").glob("*.yaml"))}


def scripts() -> dict[str, Path]:
    """Script name -> its file (``merge_lora.py`` is ``merge-lora``), the developer tools left out (the benchmarks live
    apart, in ``benchmarks/``)."""
    tools = ("make_tiny_", "trace_", "check_readme", "gpu_smoke")  # the developers' own, not a user's command
    return {p.stem.replace("_", "-"): p for p in sorted((data_root() / "scripts").glob("*.py"))
            if not p.name.startswith(tools)}


def recipe_of(config: Path) -> str | None:
    """The recipe a config's header names (its first ``recipes/NAME.py``), or None."""
    try:
        found = _RECIPE_LINE.search(config.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
    return found.group(1) if found else None


def find_recipe(name_or_path: str) -> Path:
    """A shipped recipe by name (``full_finetune``, or ``full_finetune.py``), else a recipe file (a copy to edit)."""
    path = Path(name_or_path)
    if path.suffix == ".py" and path.is_file():
        return path
    known = recipes()
    if path.stem in known and len(path.parts) == 1:
        return known[path.stem]
    raise LookupError(f"recipe {name_or_path!r}: not a shipped recipe ({', '.join(known)}) nor a .py file")


def find_config(name_or_path: str) -> Path:
    """A config file, else a shipped config by name (``tiny``, or ``tiny.yaml``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    known = configs()
    if path.stem in known and len(path.parts) == 1:
        return known[path.stem]
    near = difflib.get_close_matches(path.stem, list(known), n=3, cutoff=0.6)
    raise LookupError(f"config {name_or_path!r}: no such file, nor a shipped config"
                      + (f" (did you mean {', '.join(near)}?)" if near else "; `waypoint ls` lists them"))


def shipped_asset(value: str) -> str:
    """``value``, or for a relative ``assets/...`` that the current directory does not have, the shipped one."""
    if not value.startswith(ASSETS) or Path(value).exists():
        return value
    shipped = data_root() / value
    return str(shipped) if shipped.exists() else value


__all__ = ["configs", "data_root", "find_config", "find_recipe", "recipe_of", "recipes", "scripts", "shipped_asset"]
