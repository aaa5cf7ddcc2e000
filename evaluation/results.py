"""Where the results JSON goes, and writing it, never over an existing file.

Without ``output``: ``eval_results.json`` in the evaluated directory (the adapter's when there is one: a run's
``step_N``; else the checkpoint's), or ``eval_results_2.json``, ``_3`` ... when that name is taken; in the current
directory instead when that directory is an object-store URL's local copy or a hub download (a cache). With
``output=FILE``: that file, refused when it exists.
"""

from __future__ import annotations

import json
from pathlib import Path

from waypoint.errors import CheckpointError
from waypoint.run.object_store import is_url

NAME = "eval_results"


def in_hub_cache(directory: Path) -> bool:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return False
    return Path(directory).resolve().is_relative_to(Path(HF_HUB_CACHE).resolve())


def free_name(directory: Path) -> Path:
    path, n = directory / f"{NAME}.json", 2
    while path.exists():
        path, n = directory / f"{NAME}_{n}.json", n + 1
    return path


def results_path(output: str | None, evaluated: str) -> Path:
    """The file the results go to (checked before the model is read)."""
    if output:
        path = Path(output)
        if path.exists():
            raise CheckpointError(f"output={output}: already exists (results are never written over a file); "
                                  "choose another path, or leave output out for a free name beside the checkpoint")
        if path.suffix != ".json":
            raise CheckpointError(f"output={output}: expected a .json file")
        return path
    directory = Path(evaluated)
    if is_url(evaluated) or in_hub_cache(directory):
        directory = Path.cwd()
    return free_name(directory)


def write_results(results: dict, path: Path, explicit: bool) -> Path:
    """``results`` (lm-eval's, without its logged samples) as JSON at ``path``, created anew: a name taken since it
    was chosen is not written over (the next free name is taken instead, or, for an explicit ``output``, an error)."""
    from lm_eval.utils import handle_non_serializable

    text = json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=2, default=handle_non_serializable,
                      ensure_ascii=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            with open(path, "x", encoding="utf-8") as file:
                file.write(text + "\n")
            return path
        except FileExistsError:
            if explicit:
                raise CheckpointError(f"output={path}: already exists (written meanwhile); nothing written") from None
            path = free_name(path.parent)
