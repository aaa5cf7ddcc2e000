"""lm-eval's ``custom_dataset`` for the tasks in this folder: their JSON-lines files, found beside this module
(whatever the working directory), read without the hub and without a datasets cache.

A task names its files by split in ``dataset_kwargs``::

    custom_dataset: !function local_data.load
    dataset_kwargs:
      data_files: {test: tiny_choice.jsonl}
"""

from __future__ import annotations

import json
from pathlib import Path


def load(data_files: dict[str, str], **_):
    """A ``datasets.DatasetDict`` of ``data_files`` (split -> file name here); the rest (lm-eval's metadata) unused."""
    import datasets

    here = Path(__file__).resolve().parent
    splits = {}
    for split, name in data_files.items():
        splits[split] = datasets.Dataset.from_list(read_jsonl(here / name))
    return datasets.DatasetDict(splits)


def read_jsonl(path: Path) -> list[dict]:
    """One JSON object a line (blank lines skipped); a line that is not one is a ValueError naming the file and line."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            what = f"{e.msg}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise ValueError(f"{path}, line {number}: not valid JSON ({what}); fix that line") from None
        except RecursionError:
            raise ValueError(f"{path}, line {number}: nested too deeply to read as JSON; fix that line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {number}: expected a JSON object ({{...}}), got {type(record).__name__}")
        records.append(record)
    return records
