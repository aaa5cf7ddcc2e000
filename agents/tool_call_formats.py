"""A model's turn read back as TRL's assistant message, its tool calls included (GRPO with ``tools=``).

TRL 1.16's ``GRPOTrainer(tools=...)`` reads each turn with ``trl.chat_template_utils.parse_response``: transformers'
response parser driven by a per-family ``response_template`` (``qwen3_template``, ``qwen3_5_template``,
``llama3_template``, ``gptoss_template``, ``gemma4_template``). Each format here is that template as a table (an
anchor; per field an open pattern, a close pattern and a reader) run by one small scanner with transformers' rules,
so a well-formed turn gives exactly TRL's message:

* ``prefix`` is cut after its last assistant anchor and read before the text (a prompt ending in ``<think>\\n``
  leaves the reasoning open); without the anchor the whole prefix is read;
* between fields the earliest open (or the implicit field's close) wins, at one place the longest, opens first;
  text outside every field goes to the implicit field (``content``), or nowhere (gpt-oss);
* text fields are stripped; a field written twice keeps the last (content before *and* after a call: only the part
  after); ``tool_calls`` collects; empty fields are dropped, then ``content`` defaults to ``""``;
* with ``tools`` a string argument is typed by its tool's JSON schema (``"7"`` -> ``7`` for an integer), as
  ``parse_response(tools=...)`` does; a call without arguments gets ``{}``.

Deliberately unlike TRL: a call the model started but wrote malformed (bad JSON, no name, arguments not an object,
cut off before its end marker, a ``<parameter=`` never closed, an opener in a form the format does not read) is
left out of ``tool_calls`` and reported in ``errors``, and the rest of the turn is read as usual, so the caller can
tell the model. TRL gives up on the whole turn instead (its fallback: the text without special tokens as content,
no calls), or keeps the call as written (arguments a string or a list; no end marker), or drops it silently (gpt-oss
text outside its channels). Not done: TRL strips ``tokenizer.eos_token`` off the content's end; for these families
that is the end-of-turn token, which the content's close pattern consumes first. Tools are JSON-schema dicts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedTurn:
    message: dict  # TRL's assistant message
    errors: list[tuple[str, str]] = field(default_factory=list)  # (tool name or "unknown", reason) per bad call


# Readers: (body, captures of the open pattern) -> value; a ValueError marks a malformed call -----------------

def _text(body: str, caps: dict) -> str:
    return body.strip()


def _json_call(body: str, caps: dict) -> dict:  # hermes: the whole {"name": ..., "arguments": ...} object
    return json.loads(body)


def _json_arguments(body: str, caps: dict) -> dict:  # llama3, gpt-oss: the name in the opener, the arguments JSON
    return {"name": caps["name"], "arguments": json.loads(body)}


def _xml_arguments(body: str, caps: dict) -> dict:  # Qwen3.5: <parameter=k>\nv\n</parameter>, values as text
    found = list(re.finditer(r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>", body, re.S))
    if len(found) != body.count("<parameter="):
        raise ValueError("a <parameter=...> without its </parameter>")
    return {"name": caps["name"], "arguments": {m["key"]: m["value"].strip() for m in found}}


def _gemma_arguments(body: str, caps: dict) -> dict:  # {k:<|"|>text<|"|>,n:1}: JSON with bare keys, odd quotes
    if "\x01" in body or "\x02" in body:
        raise ValueError("control characters \\x01/\\x02 in the arguments")
    strings: list[str] = []

    def hide(m: re.Match) -> str:
        strings.append(m[1])
        return f"\x01{len(strings) - 1}\x02"

    work = re.sub(r'<\|"\|>(.*?)<\|"\|>', hide, body, flags=re.S)
    work = re.sub(r'"(?:\\.|[^"\\])*"|(?<=[{,])(\s*)(\w+)(\s*):',
                  lambda m: m[0] if m[2] is None else f'{m[1]}"{m[2]}"{m[3]}:', work)
    for i, s in enumerate(strings):
        work = work.replace(f"\x01{i}\x02", json.dumps(s))
    return {"name": caps["name"], "arguments": json.loads(work)}


def _unreadable(reason: str) -> Callable[[str, dict], Any]:
    def read(body: str, caps: dict) -> Any:
        raise ValueError(reason)
    return read


@dataclass(frozen=True)
class Field:
    key: str  # the message key: "content", "reasoning_content", "thinking", "tool_calls", or "" (always an error)
    open: str | None  # regex; None for the implicit field, which takes the text outside every other field
    close: str | None  # regex; None: the field runs to the end
    read: Callable[[str, dict], Any] = _text


class ToolCallFormat:
    """One family's turn format: ``anchor`` (where the assistant's message starts in a prompt) and its fields;
    ``turn_ends``: the tokens that end a model's turn besides the template's end of turn (where sampling stops)."""

    def __init__(self, name: str, anchor: str, fields: list[Field], turn_ends: tuple[str, ...] = ()):
        self.name, self.fields, self.turn_ends = name, fields, turn_ends
        self.anchor = re.compile(anchor)
        self._open = [(re.compile(f.open), f) for f in fields if f.open is not None]
        self._close = {f: re.compile(f.close) for f in fields if f.close is not None}
        self._implicit = next((f for f in fields if f.open is None), None)

    def __repr__(self) -> str:
        return f"ToolCallFormat({self.name!r})"

    def parse(self, text: str, prefix: str = "", tools: list[dict] | None = None) -> ParsedTurn:
        """``text``: the model's turn with its special tokens; ``prefix``: the prompt before it; ``tools``: the
        JSON schemas the prompt offered (they type the arguments, as transformers' ``tools=`` does)."""
        anchors = list(self.anchor.finditer(prefix))
        buf = (prefix[anchors[-1].end():] if anchors else prefix) + text
        turn = ParsedTurn({"role": "assistant"})
        params = _tool_parameters(tools)
        current, caps, body, opened, pos = self._implicit, {}, "", False, 0  # the field being read, its text so far
        while True:
            if current is None or current is self._implicit:  # between fields: any open, or the implicit's close
                watch = [("open", pattern, f) for pattern, f in self._open]
                watch += [("close", self._close[current], current)] if current in self._close else []
            else:
                watch = [("close", self._close[current], current)] if current in self._close else []
            best = None
            for kind, pattern, f in watch:  # the earliest match; at one place the longest, opens first
                if m := pattern.search(buf, pos):
                    rank = (m.start(), m.start() - m.end(), kind == "close", not f.key, f.key)
                    best = min(best, (rank, kind, f, m), key=lambda b: b[0]) if best else (rank, kind, f, m)
            end = len(buf) if best is None else best[3].start()
            if current is not None and end > pos:  # (no implicit field: text between fields is dropped)
                body, opened = body + buf[pos:end], True
            if best is None:  # the end of the turn closes whatever is open
                if opened:
                    self._store(turn, current, body, caps, params, closed=False)
                break
            _, kind, f, m = best
            pos, groups = m.end(), {k: v for k, v in m.groupdict().items() if v is not None}
            if opened:  # an open closes the implicit field; a close closes the field it closes
                self._store(turn, current, body, {**caps, **groups} if kind == "close" else caps, params, closed=True)
            current, caps, body, opened = (self._implicit, {}, "", False) if kind == "close" else (f, groups, "", True)
        message = {k: v for k, v in turn.message.items() if k == "role" or v not in (None, "", [], {})}
        message["content"] = message.get("content") or ""
        turn.message = message
        return turn

    @staticmethod
    def _store(turn: ParsedTurn, f: Field, body: str, caps: dict, params: dict, closed: bool) -> None:
        if f.key not in ("tool_calls", ""):
            turn.message[f.key] = f.read(body, caps)
            return
        try:
            if not closed and f.key:
                raise ValueError("the call has no end marker (cut off?)")
            function = f.read(body, caps)
            if not isinstance(function, dict):
                raise ValueError(f"the call is {type(function).__name__}, not a JSON object")
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError("the call has no name")
            if function.get("arguments") is None:
                function["arguments"] = {}
            if not isinstance(function["arguments"], dict):
                raise ValueError(f"arguments are {type(function['arguments']).__name__}, not an object")
        except ValueError as e:
            reason = f"bad JSON: {e.msg} at character {e.pos}" if isinstance(e, json.JSONDecodeError) else str(e)
            turn.errors.append((_name_in(body, caps), " ".join(reason.split())[:200]))
            return
        _type_arguments(function["arguments"], params.get(function["name"]) or {})
        turn.message.setdefault("tool_calls", []).append({"type": "function", "function": function})


def _name_in(body: str, caps: dict) -> str:
    if caps.get("name"):
        return caps["name"]
    m = re.search(r'"name"\s*:\s*"([^"]+)"', body)
    return m[1] if m else "unknown"


# Argument typing by the tool's JSON schema (transformers' response_parser._schema_types and _coerce) -----------

def _tool_parameters(tools: list[dict] | None) -> dict[str, dict]:
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            parameters = fn.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            out[fn["name"]] = properties if isinstance(properties, dict) else {}
    return out


def _schema_types(schema: Any) -> tuple[str, ...]:
    if not isinstance(schema, dict):
        return ()
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared if isinstance(t, str)] \
        if isinstance(declared, list) else []
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or []:
            types.extend(_schema_types(choice))
    if schema.get("nullable") and "null" not in types:
        types.append("null")
    return tuple(types)


def _typed(raw: str, types: tuple[str, ...]) -> Any:
    for kind in types:
        try:
            if kind == "integer":
                try:
                    return int(raw)
                except ValueError:
                    number = float(raw)  # "3.0" is an integer too
                    if number.is_integer():
                        return int(number)
            elif kind == "number":
                number = float(raw)
                if number == number and number not in (float("inf"), float("-inf")):
                    return int(number) if number.is_integer() and "." not in raw else number
            elif kind == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
                return raw.strip().lower() in ("true", "1")
            elif kind == "null" and raw.strip() in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                decoded = json.loads(raw)
                if isinstance(decoded, dict if kind == "object" else list):
                    return decoded
        except ValueError:
            continue
    return raw


def _type_arguments(arguments: dict, properties: dict) -> None:
    for key, value in arguments.items():
        types = _schema_types(properties.get(key)) if key in properties else ()
        if not types:
            continue
        if isinstance(value, str):
            arguments[key] = _typed(value, types)
        elif isinstance(value, list) and "array" not in types:
            arguments[key] = [_typed(v, types) if isinstance(v, str) else v for v in value]


# The formats (TRL 1.16's response templates; each "" field catches a call opener the format cannot read) -------

_THINK = Field("reasoning_content", "<think>", r"</think>\s*")
_CHATML_CONTENT = Field("content", None, r"<\|im_end\|>\s*")

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in [
    ToolCallFormat("hermes", r"<\|im_start\|>assistant\n", [  # Qwen2.5, Qwen3, Qwen3-Next
        _THINK, Field("tool_calls", "<tool_call>", r"</tool_call>\s*", _json_call), _CHATML_CONTENT]),
    ToolCallFormat("qwen3_5", r"<\|im_start\|>assistant\n", [  # Qwen3.5, Qwen3.6
        _THINK,
        Field("tool_calls", r"<tool_call>\s*<function=(?P<name>[^\n>]+)>", r"</tool_call>\s*", _xml_arguments),
        Field("", "<tool_call>", r"</tool_call>\s*", _unreadable("no <function=NAME> after <tool_call>")),
        _CHATML_CONTENT]),
    ToolCallFormat("llama3", r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n", [  # Llama 3.1, 3.2
        Field("tool_calls", r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*', r"\}<\|eot_id\|>\s*",
              _json_arguments),
        Field("", r'\{\s*"name"\s*:\s*"(?P<name>[^"]*)"\s*,\s*"(?:parameters|arguments)"'
                  r'|\{\s*"(?:parameters|arguments)"\s*:',
              r"<\|eot_id\|>\s*", _unreadable('not {"name": "NAME", "parameters": {...}}')),
        Field("content", None, r"<\|eot_id\|>\s*")]),
    ToolCallFormat("harmony", r"<\|start\|>assistant", [  # gpt-oss
        Field("thinking", r"<\|channel\|>analysis<\|message\|>", r"<\|end\|>\s*"),
        Field("content", r"<\|channel\|>final<\|message\|>", r"<\|return\|>\s*"),
        Field("tool_calls", r"to=functions\.(?P<name>\S+?)<\|channel\|>commentary\s+json<\|message\|>",
              r"<\|call\|>\s*", _json_arguments),
        Field("", r"to=functions\.(?P<name>[\w.-]*)", r"<\|call\|>\s*",
              _unreadable("not 'to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>'"))],
        turn_ends=("<|call|>",)),  # a call ends the turn
    ToolCallFormat("gemma4", r"(?:<\|turn>model\n|<tool_response\|>)", [  # Gemma 4
        Field("reasoning_content", r"<\|channel>thought\n", r"<channel\|>\s*"),
        Field("tool_calls", r"<\|tool_call>call:(?P<name>\w+)", r"<tool_call\|>\s*", _gemma_arguments),
        Field("", r"<\|tool_call>", r"<tool_call\|>\s*", _unreadable("no call:NAME after <|tool_call>")),
        Field("content", None, r"(?:<turn\|>|<\|tool_response>|<eos>)\s*")],  # TRL's `|$` only matters streaming
        turn_ends=("<|tool_response>",)),  # the model hands over to the tool
]}


# Detection -------------------------------------------------------------------------------------------------------

PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool", "description": "A probe.", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "A city."}, "count": {"type": "integer", "description": "A count."}},
        "required": ["city", "count"]}}}
PROBE_CALL = {"type": "function", "function": {"name": "probe_tool", "arguments": {"city": "Paris", "count": 3}}}


def detect_format(render: Callable[[list[dict], list[dict]], str | None]) -> ToolCallFormat | None:
    """The format whose ``parse`` reads back exactly the probe call from a template's rendering of it (``render``:
    messages, tools -> text, None when the template refuses them), or None."""
    user = [{"role": "user", "content": "Probe?"}]
    for arguments in (PROBE_CALL["function"]["arguments"], json.dumps(PROBE_CALL["function"]["arguments"])):
        call = {"type": "function", "function": {"name": "probe_tool", "arguments": arguments}}
        full = render(user + [{"role": "assistant", "content": "", "tool_calls": [call]}], [PROBE_TOOL])
        if full is not None:
            break
    else:
        return None
    base = render(user, [PROBE_TOOL]) or ""
    tail = full[len(os.path.commonprefix([base, full])):]  # the assistant's turn
    for fmt in FORMATS.values():
        turn = fmt.parse("", prefix=tail, tools=[PROBE_TOOL])  # the prefix cut at the turn's anchor: the turn
        if not turn.errors and turn.message.get("tool_calls") == [PROBE_CALL]:
            return fmt
    return None
