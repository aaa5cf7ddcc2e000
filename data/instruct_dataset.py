"""Alpaca-style instruction data: prompt from a template, loss on the response only.

A record is ``{"instruction": str, "input": str (optional, may be empty), "output": str}``,
read from a ``.json`` file holding a list of records or a ``.jsonl`` file with one
record a line. An item is ``{"tokens", "labels"}`` where

    tokens = BOS + prompt + response + EOS
    labels = tokens, with BOS and the prompt set to -100 (unless train_on_input)

both truncated to ``max_seq_len``. Records are checked and tokenized when the file is read, so
bad input stops a run before it starts and the data can be checked against the model.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from waypoint.text.chat_template import ChatTemplate, load_chat_template
from waypoint.text.instruction_templates import TEMPLATES, PromptTemplate
from waypoint.data.records import read_records as read_record_file
from waypoint.data.tokenized import TokenizedRecords


REQUIRED_KEYS = ("instruction", "output")


class InstructDataset(Dataset):
    """Instruction/response pairs from a local ``.json``, ``.jsonl`` or ``.parquet`` file, tokenized when read.

    Args:
        source: the data file.
        tokenizer: a ``waypoint.text.tokenizer.Tokenizer`` (``encode``, ``bos_id``, ``eos_id``).
        max_seq_len: items are cut to this many tokens.
        template: a key of ``TEMPLATES``.
        train_on_input: supervise the prompt tokens too.
        completion_only_loss: TRL's name for the opposite of ``train_on_input`` (either may be given, not both).
    """

    def __init__(self, source: str | Path, tokenizer, max_seq_len: int, template: str = "alpaca",
                 train_on_input: bool = False, completion_only_loss: bool | None = None) -> None:
        if completion_only_loss is not None:
            if train_on_input and completion_only_loss:
                raise ValueError("dataset: train_on_input=true and completion_only_loss=true contradict each other; set one")
            train_on_input = not completion_only_loss
        if template not in TEMPLATES:
            raise ValueError(f"unknown template {template!r}; known: {', '.join(sorted(TEMPLATES))}")
        self.source = Path(source)
        self.tokenizer = tokenizer
        self.template: PromptTemplate = TEMPLATES[template]
        # the format as a chat template: written beside every checkpoint, so the output is prompted as it was trained
        self.prompt_format: ChatTemplate = load_chat_template(tokenizer, template)
        self.items = TokenizedRecords(max_seq_len, train_on_input)
        self.records = []
        for read in read_record_file(self.source):
            record = _check(read.file, read.where, read.data)
            prompt = tokenizer.encode(self.template.format(record["instruction"], record["input"]), add_bos=True, add_eos=False)
            response = tokenizer.encode(record["output"], add_bos=False, add_eos=True)
            self.items.add(prompt + response, [0] * len(prompt) + [1] * len(response), f"{read.file}: {read.where}")
            self.records.append(record)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.items[index]


def read_records(path: Path) -> list[dict[str, str]]:
    """The checked records of a ``.json`` (list), ``.jsonl`` or ``.parquet`` file (or a directory of them);
    ``input`` defaults to ""."""
    return [_check(record.file, record.where, record.data) for record in read_record_file(path)]


def _check(path: Path, where: str, record) -> dict[str, str]:
    if not isinstance(record, dict):
        raise ValueError(f"{path}: {where}: expected an object, got {type(record).__name__}")
    for key in REQUIRED_KEYS:
        if key not in record:
            raise ValueError(f"{path}: {where}: missing key {key!r}")
    checked = {"instruction": record["instruction"], "input": record.get("input") or "", "output": record["output"]}
    for key, value in checked.items():
        if not isinstance(value, str):
            raise ValueError(f"{path}: {where}: {key!r} must be a string, got {type(value).__name__}")
    return checked
