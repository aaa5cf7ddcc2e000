"""Conversations rendered with the model's own chat template; loss on the assistant's turns only.

A record is OpenAI style, ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``,
or ShareGPT, ``{"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...], "system": str}`` (the
optional ``system`` is the system turn, as ShareGPT readers take it, unless the first turn is one); ``columns`` names
other fields (``{"messages": "dialog", "role": "speaker", "content": "text"}``). Records come from a ``.json``,
``.jsonl`` or ``.parquet`` file or a directory of them (``waypoint.data.records``). An item is
``{"tokens", "labels"}``: the conversation as ``apply_chat_template(tokenize=True)`` tokenizes it, labels -100
outside the assistant turns (``waypoint.text.chat_template`` says how those are found), both cut to
``max_seq_len``. Every record is checked, rendered and tokenized when the file is read, so a record the template
cannot render stops the run before its first step, naming its file and index (``skip_bad_records`` counts it out).
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from waypoint.data.records import column_names, converted, Skipped
from waypoint.text.chat_template import ChatTemplate, load_chat_template
from waypoint.data.tokenized import TokenizedRecords

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
        skip_bad_records: leave malformed records (and records the template refuses) out, counted and noted
            once, instead of stopping; a template that runs past its limits stops the run whatever this says.
    """

    def __init__(self, source: str | Path, tokenizer, max_seq_len: int, train_on_input: bool = False,
                 template: str | None = None, columns: dict[str, str] | None = None,
                 skip_bad_records: bool = False) -> None:
        columns = column_names(columns, COLUMN_KEYS)
        self.source = Path(source)
        self.tokenizer = tokenizer
        self.columns = columns
        self.items = TokenizedRecords(max_seq_len, train_on_input)
        self.template: ChatTemplate = load_chat_template(tokenizer, template)
        skipped = Skipped()  # every record rendered and tokenized now: one the template cannot render stops the run here
        encode = lambda record, where: self.template.encode(self._messages(record), tokenizer)  # noqa: E731
        for where, (tokens, mask) in converted(self.source, encode, skip_bad_records, skipped):
            self.items.add(tokens, mask, where)
        self.skipped = skipped.count
        if self.skipped:
            print(f"note: {self.source}: skipped {self.skipped} malformed record(s) (skip_bad_records); first: {skipped.first}")
        if not len(self.items):
            raise ValueError(f"{self.source}: no usable conversations")

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
        system = data.get("system") if field == "conversations" else None  # ShareGPT's system prompt, beside the turns
        if system is not None:
            if not isinstance(system, str):
                raise ValueError(f"{where}: 'system' must be a string, got {type(system).__name__}")
            if system and ROLES.get(turns[0].get(role_key) if isinstance(turns[0], dict) else None) != "system":
                messages.append({"role": "system", "content": system})
        messages += read_messages(turns, where, role_key, content_key)
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no assistant message (nothing to train on)")
        return messages

    @property
    def prompt_format(self) -> ChatTemplate:
        """The template conversations were rendered with: the output's, so it is prompted as it trained."""
        return self.template

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.items[index]


def read_messages(turns: list, where: str, role_key: str = "role", content_key: str = "content",
                  field: str | None = None) -> list[dict[str, str]]:
    """``turns`` (a record's list of messages) as ``{"role", "content"}`` dicts with the roles' standard names; a
    malformed message is a ``ValueError`` naming ``where`` (the file and record), ``field`` when given, and the
    message's number."""
    at = f"{where}: {field!r}" if field else where
    messages = []
    for n, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise ValueError(f"{at}: message {n}: expected an object, got {type(turn).__name__}")
        for key in (role_key, content_key):
            if key not in turn:
                raise ValueError(f"{at}: message {n}: missing key {key!r}")
        role, content = turn[role_key], turn[content_key]
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"{at}: message {n}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise ValueError(f"{at}: message {n}: {content_key!r} must be a string, got {type(content).__name__}")
        messages.append({"role": ROLES[role], "content": content})
    return messages
