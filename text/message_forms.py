"""Messages as a chat template is handed them, as transformers hands them: a message's reasoning under each name
templates read it by, and tool calls' arguments in the form the template takes.

* Reasoning: ``reasoning_content`` (the standard name), ``thinking`` (gpt-oss's templates) and ``reasoning`` are
  one field; given under any of them, a message carries it under the first two (transformers'
  ``_alias_reasoning_fields``).
* Arguments: transformers passes a tool call's ``arguments`` as given, and asks for an object; templates differ.
  Qwen3.5's and Gemma 4's refuse a string, Llama 3's would encode a string twice (``tojson``), and DeepSeek-V3's
  writes the arguments into a string and refuses an object. Data holds either form (OpenAI's API gives JSON text), so
  the chat dataset hands a template objects, or JSON text where a probe rendering shows it refuses an object.
"""

from __future__ import annotations

import json
from collections.abc import Callable

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for a message's reasoning


def with_reasoning_aliases(message: dict) -> dict:
    """``message`` with its reasoning under ``reasoning_content`` and ``thinking`` too, whichever name it came under."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def takes_arguments_as_text(render: Callable[[list[dict]], str | None]) -> bool:
    """Whether a template (``render``: its rendering of a conversation, None when it refuses it) refuses a tool call's
    arguments as an object and takes them as JSON text."""
    def conversation(arguments) -> list[dict]:
        call = {"type": "function", "id": "call_0", "function": {"name": "f", "arguments": arguments}}
        return [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]

    return render(conversation({"a": 1})) is None and render(conversation('{"a": 1}')) is not None


def with_arguments_as(messages: list[dict], as_text: bool) -> list[dict]:
    """``messages`` with each tool call's arguments as JSON text (``as_text``) or as an object."""
    if not any(m.get("tool_calls") for m in messages):
        return messages
    convert = (lambda a: a if isinstance(a, str) else json.dumps(a, ensure_ascii=False)) if as_text \
        else (lambda a: json.loads(a) if isinstance(a, str) else a)
    return [{**m, "tool_calls": [_with_arguments(call, convert) for call in m["tool_calls"]]} if m.get("tool_calls")
            else m for m in messages]


def _with_arguments(call: dict, convert: Callable) -> dict:
    """A tool call (nested ``{"function": {...}}`` or flat) with ``convert`` applied to its arguments."""
    function = call.get("function", call)
    if not isinstance(function, dict) or "arguments" not in function:
        return call
    function = {**function, "arguments": convert(function["arguments"])}
    return {**call, "function": function} if "function" in call else function
