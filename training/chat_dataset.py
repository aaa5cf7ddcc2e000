"""Conversations rendered with the model's own chat template; loss on the assistant's turns only.

A record is OpenAI style, ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``,
or ShareGPT, ``{"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...]}``; ``columns`` names
other fields (``{"messages": "dialog", "role": "speaker", "content": "text"}``). Records come from a ``.json``,
``.jsonl`` or ``.parquet`` file or a directory of them (``waypoint.training.records``). An item is
``{"tokens", "labels"}``: the conversation as ``apply_chat_template(tokenize=True)`` tokenizes it, labels -100
outside the assistant turns (``waypoint.text.chat_template`` says how those are found), both cut to
``max_seq_len``. Records are checked when the file is read; they are rendered and tokenized in ``__getitem__``.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from waypoint.training.records import read_records
from waypoint.text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from waypoint.training.loss import IGNORE_INDEX

ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "model": "assistant", "tool": "tool"}
FORMATS = {  # messages field -> (role field, content field)
    "messages": ("role", "content"),
    "conversations": ("from", "value"),
}
COLUMN_KEYS = ("messages", "role", "content")


class ChatDataset(Dataset):
    """Conversations from a local file (or directory), tokenized on access with a chat template.

    Args:
        source: the data file, or a directory of data files.
        tokenizer: a ``waypoint.text.tokenizer.Tokenizer`` (``encode_with_offsets``, its special tokens and
            chat template).
        max_seq_len: items are cut to this many tokens.
        train_on_input: supervise every token, not only the assistant turns.
        template: None for the checkpoint's own chat template; else a built-in name (``chatml``, ``llama3``) or
            a ``.jinja`` file.
        columns: field names of other layouts: ``messages`` (the list), ``role``, ``content``.
        skip_bad_records: leave malformed records out (counted, noted once) instead of stopping.
    """

    def __init__(self, source: str | Path, tokenizer, max_seq_len: int, train_on_input: bool = False,
                 template: str | None = None, columns: dict[str, str] | None = None,
                 skip_bad_records: bool = False) -> None:
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        columns = dict(columns or {})
        unknown = sorted(set(columns) - set(COLUMN_KEYS))
        if unknown or not all(isinstance(v, str) and v for v in columns.values()):
            raise ValueError(f"columns: expected names for {', '.join(COLUMN_KEYS)}, got {columns!r}")
        self.source = Path(source)
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.train_on_input = train_on_input
        self.columns = columns
        self.template: ChatTemplate = load_chat_template(tokenizer, template)
        self.conversations: list[list[dict[str, str]]] = []
        self.where: list[str] = []  # "file: record n" of each kept conversation, for errors in __getitem__
        self.skipped = 0
        first_error = None
        for record in read_records(self.source):
            try:
                self.conversations.append(self._messages(record))
                self.where.append(f"{record.file}: {record.where}")
            except ValueError as e:
                if not skip_bad_records:
                    raise
                self.skipped += 1
                first_error = first_error or str(e)
        if self.skipped:
            print(f"note: {self.source}: skipped {self.skipped} malformed record(s) (skip_bad_records); first: {first_error}")
        if not self.conversations:
            raise ValueError(f"{self.source}: no usable conversations")
        try:  # a template that cannot render this data at all stops the run here, not at some later step
            self.template.render(self.conversations[0])
        except ChatTemplateError as e:
            raise ValueError(f"{self.where[0]}: {e}") from e

    def _messages(self, record) -> list[dict[str, str]]:
        where = f"{record.file}: {record.where}"
        data = record.data
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        if "messages" in self.columns:
            field = self.columns["messages"]
            default_role, default_content = FORMATS.get(field, FORMATS["messages"])
        else:
            field = next((name for name in FORMATS if name in data), None)
            if field is None:
                raise ValueError(f"{where}: missing key 'messages' (or 'conversations'; set columns.messages for another name)")
            default_role, default_content = FORMATS[field]
        role_key, content_key = self.columns.get("role", default_role), self.columns.get("content", default_content)
        if field not in data:
            raise ValueError(f"{where}: missing key {field!r}")
        turns = data[field]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: {field!r} must be a non-empty list of messages")
        messages = []
        for n, turn in enumerate(turns, start=1):
            if not isinstance(turn, dict):
                raise ValueError(f"{where}: message {n}: expected an object, got {type(turn).__name__}")
            for key in (role_key, content_key):
                if key not in turn:
                    raise ValueError(f"{where}: message {n}: missing key {key!r}")
            role, content = turn[role_key], turn[content_key]
            if role not in ROLES:
                raise ValueError(f"{where}: message {n}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
            if not isinstance(content, str):
                raise ValueError(f"{where}: message {n}: {content_key!r} must be a string, got {type(content).__name__}")
            messages.append({"role": ROLES[role], "content": content})
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no assistant message (nothing to train on)")
        return messages

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        try:
            tokens, mask = self.template.encode(self.conversations[index], self.tokenizer)
        except ChatTemplateError as e:
            raise ValueError(f"{self.where[index]}: {e}") from e
        labels = tokens[:] if self.train_on_input else [t if m else IGNORE_INDEX for t, m in zip(tokens, mask)]
        return {"tokens": tokens[: self.max_seq_len], "labels": labels[: self.max_seq_len]}
