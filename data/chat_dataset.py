"""Conversations rendered with the model's own chat template; loss on the assistant's turns only.

A record is OpenAI style, ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``,
or ShareGPT, ``{"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...], "system": str}`` (the
optional ``system`` is the system turn, as ShareGPT readers take it, unless the first turn is one); ``columns`` names
other fields (``{"messages": "dialog", "role": "speaker", "content": "text", "tools": "functions"}``).

Agent traces are records in TRL's conversational format: a ``tools`` column (JSON-schema function definitions, or
a string holding their JSON list), assistant messages with ``tool_calls`` (``{"type": "function", "function":
{"name", "arguments"}}``, arguments an object or a JSON string, given to the template in the form it takes;
``content`` may then be empty or left out) and
reasoning (``reasoning_content``, or ``thinking`` / ``reasoning``), ``tool`` messages (``ipython`` read as ``tool``)
with the result as content and optional ``name`` and ``tool_call_id`` (or Gemma's ``tool_responses`` on the
message that called), and contents given as a list of parts
(``[{"type": "text", "text": ...}, ...]``). The template renders them as ``apply_chat_template(messages, tools=...)``
does; what is trained is each assistant turn as the model writes it, reasoning and tool calls included, never the
tools' results (``waypoint.text.chat_template``, ``waypoint.text.generation_marks``). Records come from a ``.json``,
``.jsonl`` or ``.parquet`` file or a directory of them (``waypoint.data.records``). An item is
``{"tokens", "labels"}``: the conversation as ``apply_chat_template(tokenize=True)`` tokenizes it, labels -100
outside the assistant turns (``waypoint.text.chat_template`` says how those are found), both cut to
``max_seq_len``. Every record is checked, rendered and tokenized when the file is read, so a record the template
cannot render stops the run before its first step, naming its file and index (``skip_bad_records`` counts it out).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from torch.utils.data import Dataset

from waypoint.data.records import column_names, converted, Skipped
from waypoint.text.chat_template import ChatTemplate, load_chat_template
from waypoint.data.tokenized import TokenizedRecords

ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "model": "assistant", "tool": "tool", "ipython": "tool"}
FORMATS = {  # messages field -> (role field, content field)
    "messages": ("role", "content"),
    "conversations": ("from", "value"),
}
COLUMN_KEYS = ("messages", "role", "content", "tools")
OPTIONAL_KEYS = {"assistant": ("reasoning_content", "thinking", "reasoning"), "tool": ("name", "tool_call_id")}


class ChatDataset(Dataset):
    """Conversations from a local file (or directory), tokenized on access with a chat template.

    Args:
        source: the data file, or a directory of data files.
        tokenizer: a ``waypoint.text.tokenizer.Tokenizer`` (``encode_with_offsets``, its special tokens and
            chat template).
        max_seq_len: items are cut to this many tokens.
        train_on_input: supervise every token, not only the assistant turns.
        assistant_only_loss: TRL's name for the opposite of ``train_on_input`` (either may be given, not both).
        chat_template_kwargs: the template's switches, as TRL and transformers name them (``{enable_thinking: false}``
            for Qwen3, ``{builtin_tools: [brave_search]}`` for Llama 3.1).
        template: None for the checkpoint's own chat template; else a built-in name (``chatml``, ``llama3``) or
            a ``.jinja`` file.
        columns: field names of other layouts: ``messages`` (the list), ``role``, ``content``.
        skip_bad_records: leave malformed records (and records the template refuses) out, counted and noted
            once, instead of stopping; a template that runs past its limits stops the run whatever this says.
    """

    def __init__(self, source: str | Path, tokenizer, max_seq_len: int, train_on_input: bool = False,
                 template: str | None = None, columns: dict[str, str] | None = None,
                 skip_bad_records: bool = False, assistant_only_loss: bool | None = None,
                 chat_template_kwargs: dict | None = None) -> None:
        if assistant_only_loss is not None:
            if train_on_input and assistant_only_loss:
                raise ValueError("dataset: train_on_input=true and assistant_only_loss=true contradict each other; set one")
            train_on_input = not assistant_only_loss
        columns = column_names(columns, COLUMN_KEYS)
        self.source = Path(source)
        self.tokenizer = tokenizer
        self.columns = columns
        self.items = TokenizedRecords(max_seq_len, train_on_input)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(f"dataset.chat_template_kwargs={chat_template_kwargs!r}: expected a mapping of the template's "
                             "switches, e.g. {enable_thinking: false}")
        if hasattr(chat_template_kwargs, "_metadata"):  # from a config: plain values for the template's sandbox
            from omegaconf import OmegaConf

            chat_template_kwargs = OmegaConf.to_container(chat_template_kwargs, resolve=True)
        self.template: ChatTemplate = load_chat_template(tokenizer, template, dict(chat_template_kwargs or {}))
        skipped = Skipped()  # every record rendered and tokenized now: one the template cannot render stops the run here
        encode = lambda record, where: self._encode(record)  # noqa: E731
        for where, (tokens, mask) in converted(self.source, encode, skip_bad_records, skipped):
            self.items.add(tokens, mask, where)
        self.skipped = skipped.count
        if self.skipped:
            print(f"note: {self.source}: skipped {self.skipped} malformed record(s) (skip_bad_records); first: {skipped.first}")
        if not len(self.items):
            raise ValueError(f"{self.source}: no usable conversations")

    def _encode(self, record) -> tuple[list[int], list[int]]:
        """A record's token ids and assistant mask: its messages rendered with its tools."""
        messages = self._messages(record)
        tools = read_tools(record.data, f"{record.file}: {record.where}", self.columns.get("tools", "tools"))
        return self.template.encode(messages, self.tokenizer, tools)

    def _messages(self, record) -> list[dict]:
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
        messages += read_messages(turns, where, role_key, content_key, tool_use=True)
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
                  field: str | None = None, tool_use: bool = False) -> list[dict]:
    """``turns`` (a record's list of messages) as ``{"role", "content"}`` dicts with the roles' standard names; a
    malformed message is a ``ValueError`` naming ``where`` (the file and record), ``field`` when given, and the
    message's number. ``tool_use``: agent traces too (the module doc): tool calls, tool results, reasoning, and
    contents as lists of parts, kept under the names templates read."""
    at = f"{where}: {field!r}" if field else where
    messages = []
    for n, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise ValueError(f"{at}: message {n}: expected an object, got {type(turn).__name__}")
        if role_key not in turn:
            raise ValueError(f"{at}: message {n}: missing key {role_key!r}")
        role = turn[role_key]
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"{at}: message {n}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        message = {"role": ROLES[role]}
        calls = turn.get("tool_calls") if tool_use and message["role"] == "assistant" else None
        if calls is not None:
            message["tool_calls"] = _tool_calls(calls, f"{at}: message {n}")
            responses = turn.get("tool_responses")  # Gemma's own form: the results on the message that called
            if responses is not None:
                if not isinstance(responses, list) or not all(isinstance(r, dict) and "response" in r for r in responses):
                    raise ValueError(f"{at}: message {n}: 'tool_responses' must be a list of {{'name': ..., 'response': ...}}")
                message["tool_responses"] = responses
        content = turn.get(content_key)
        if content is None and not calls:
            raise ValueError(f"{at}: message {n}: missing key {content_key!r}")
        if content is not None:
            if not isinstance(content, str) and not (tool_use and _parts(content)):
                expected = "a string or a list of parts ({'type': 'text', 'text': ...})" if tool_use else "a string"
                raise ValueError(f"{at}: message {n}: {content_key!r} must be {expected}, got {type(content).__name__}")
            message["content"] = content
        for key in OPTIONAL_KEYS.get(message["role"], ()) if tool_use else ():
            value = turn.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise ValueError(f"{at}: message {n}: {key!r} must be a string, got {type(value).__name__}")
                message[key] = value
        messages.append(message)
    return messages


def _parts(content) -> bool:
    """Whether ``content`` is a list of parts, each an object with a string ``type`` (and a string ``text`` for text)."""
    return isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) and (p["type"] != "text" or isinstance(p.get("text"), str))
        for p in content)


def _tool_calls(calls, at: str) -> list[dict]:
    """An assistant message's ``tool_calls``, checked: each ``{"type": "function", "function": {"name", "arguments"}}``
    (or the flat ``{"name", "arguments"}``), arguments an object or a JSON string holding one; passed on as given
    (``ChatTemplate.encode`` hands the template the form it takes)."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{at}: 'tool_calls' must be a non-empty list of calls")
    for k, call in enumerate(calls, start=1):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{at}: tool call {k}: expected {{'type': 'function', 'function': {{'name': ..., "
                             "'arguments': {...}}}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"{at}: tool call {k} ({function['name']}): arguments are not JSON ({e.msg})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{at}: tool call {k} ({function['name']}): arguments must be an object, "
                             f"got {type(arguments).__name__}")
    return calls


def read_tools(record: dict, where: str, key: str = "tools") -> list[dict] | None:
    """A record's tool definitions (JSON-schema functions, as ``apply_chat_template(tools=...)`` takes them), given as
    a list or as a string holding its JSON; None when it has none."""
    tools = record.get(key)
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: {key!r} is a string but not JSON ({e.msg})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"{where}: {key!r} must be a list of tool definitions (objects)")
    for t in tools:
        function = t.get("function", t)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}: {key!r}: a tool definition without a name: "
                             "expected {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
    return tools
