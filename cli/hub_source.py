"""The record a download leaves beside the files (``waypoint_source.json``: the hub repo, its revision), read without
the hub client: a recipe names an adapter's base from it, and importing the network stack for that would make every
LoRA run depend on it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from waypoint.errors import CheckpointError, first_line

SOURCE_FILE = "waypoint_source.json"


def read_source(path: str | os.PathLike) -> dict | None:
    """The recorded source (``repo_id``, ``repo_type``, ``revision`` = commit sha, ``requested_revision``)
    of a downloaded directory or of a file or folder inside it; ``None`` if it was not downloaded here."""
    path = Path(path).absolute()
    start = path if path.is_dir() else path.parent
    for directory in (start, *start.parents):
        candidate = directory / SOURCE_FILE
        if candidate.is_file():
            try:
                record = json.loads(candidate.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{candidate}: unreadable ({first_line(e)})") from e
            if not isinstance(record, dict) or not {"repo_id", "revision"} <= record.keys():
                raise CheckpointError(f"{candidate}: expected an object with repo_id and revision")
            return record
    return None


def base_model_name(checkpoint_dir: str | os.PathLike) -> str:
    """An adapter's ``base_model_name_or_path``: the hub repo id recorded in ``waypoint_source.json`` when the base
    was downloaded, else its path."""
    record = read_source(checkpoint_dir) if Path(checkpoint_dir).exists() else None
    return record["repo_id"] if record else str(Path(checkpoint_dir).resolve())
