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
        lines = (here / name).read_text(encoding="utf-8").splitlines()
        splits[split] = datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])
    return datasets.DatasetDict(splits)
