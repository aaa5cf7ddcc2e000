"""waypoint.agents.tool_call_formats: a model's turn read back as TRL's assistant message, tool calls included.

The oracle is what TRL 1.16's GRPOTrainer(tools=...) runs on each turn: ``trl.chat_template_utils.parse_response``
(transformers 5.24's response parser, its ``tools=`` typing and prefix handling, and TRL's fallback and tool-call
validation around it) on a real ``PreTrainedTokenizerFast`` with the family's response template
(``qwen3_template``, ``qwen3_5_template``, ``llama3_template``, ``gptoss_template``, ``gemma4_template``). The
tokenizer is a byte-level BPE without merges (every byte a token) with the family's special tokens added, so the
token ids TRL gets decode back to exactly the text given (checked on every call), special tokens included.

Prompts (``prefix``) are the asset templates' own renderings with ``add_generation_prompt=True``: first turns and
turns after a tool response, thinking on and off (Qwen3.5's opens ``<think>\\n``, Gemma 4's ``<|channel>thought\\n``).
"""

from __future__ import annotations

import functools
import json
import random

import pytest

from tests.conftest import ROOT, TRL_ORACLE, needs
from waypoint.agents import tool_call_formats as tcf
from waypoint.agents.tool_call_formats import FORMATS, Field, ParsedTurn, ToolCallFormat, detect_format
from waypoint.text.chat_template import ChatTemplate, ChatTemplateError

pytestmark = [needs("trl", "transformers", "tokenizers"), TRL_ORACLE]

TEMPLATES = ROOT / "assets" / "chat_templates"


def _tool(name, properties):
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.", "parameters": {
        "type": "object", "properties": {k: {"type": t, "description": k} for k, t in properties.items()},
        "required": list(properties)}}}


TOOLS = [_tool("add", {"a": "integer", "b": "integer"}), _tool("lookup", {"query": "string"}), _tool("noop", {}),
         _tool("typed", {"s": "string", "i": "integer", "x": "number", "flag": "boolean", "items": "array",
                         "opts": "object"})]

# --- The oracle -------------------------------------------------------------------------------------------------

FAMILIES = {  # format -> (TRL response template name, tokenizer EOS, special tokens, added non-special, templates)
    "hermes": ("qwen3_template", "<|im_end|>", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
               ["<think>", "</think>", "<tool_call>", "</tool_call>"], ["qwen2_5", "qwen3", "qwen3_next_thinking"]),
    "qwen3_5": ("qwen3_5_template", "<|im_end|>", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                ["<think>", "</think>", "<tool_call>", "</tool_call>"], ["qwen3_5", "qwen3_5_small", "qwen3_6"]),
    "llama3": ("llama3_template", "<|eot_id|>", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                                 "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], [],
               ["llama3_1", "llama3_2"]),
    "harmony": ("gptoss_template", "<|return|>", ["<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                                  "<|constrain|>", "<|return|>", "<|call|>"], [], ["gpt_oss"]),
    "gemma4": ("gemma4_template", "<turn|>", ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>",
                                              "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<eos>"],
               [], ["gemma4", "gemma4_small"]),
}


@pytest.fixture(scope="module")
def oracle():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import chat_template_utils as trl_templates

    tokenizers = {}
    for name, (template, eos, special, added, _) in FAMILIES.items():
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        bpe.decoder = decoders.ByteLevel()
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, clean_up_tokenization_spaces=False)
        tok.add_special_tokens({"additional_special_tokens": special})
        tok.add_tokens(added)
        tok.response_template = getattr(trl_templates, template)
        tokenizers[name] = tok

    def parse(fmt: str, text: str, prefix: str = "", tools=TOOLS) -> dict:
        tok = tokenizers[fmt]
        ids, prefix_ids = (tok.encode(s, add_special_tokens=False) for s in (text, prefix))
        assert tok.decode(ids) == text and tok.decode(prefix_ids) == prefix
        return trl_templates.parse_response(tok, ids, prefix=prefix_ids, tools=tools)

    parse.fallback = lambda fmt, text: {  # TRL's answer to a turn it cannot parse
        "role": "assistant", "content": tokenizers[fmt].decode(tokenizers[fmt].encode(text), skip_special_tokens=True)}
    return parse


# --- Prompts and completions as each family writes them -----------------------------------------------------------

@functools.cache
def _template(name: str, **kwargs) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), name,
                        {"bos_token": "<s>", "eos_token": "</s>"}, template_kwargs=kwargs)


FIRST = [{"role": "user", "content": "What is 2 + 3?"}]
SECOND = FIRST + [{"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "name": "add", "content": "5"}]


@functools.cache
def prompts(fmt: str) -> list[str]:
    out = []
    for name in FAMILIES[fmt][4]:
        for thinking in (False, True):
            for messages in (FIRST, SECOND):
                text = _template(name, enable_thinking=thinking).render(messages, add_generation_prompt=True, tools=TOOLS)
                out += [text] if text not in out else []
    return out


def _gemma_value(v) -> str:
    if isinstance(v, str):
        return f'<|"|>{v}<|"|>'
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_gemma_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_gemma_value(x) for x in v) + "]"
    return json.dumps(v)


def write_call(fmt: str, name: str, args: dict) -> str:
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
    if fmt == "qwen3_5":
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                         "</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if fmt == "llama3":
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
    if fmt == "harmony":
        return f" to=functions.{name}<|channel|>commentary json<|message|>{json.dumps(args, ensure_ascii=False)}<|call|>"
    return f"<|tool_call>call:{name}{_gemma_value(args)}<tool_call|>"


def write_turn(fmt: str, prefix: str, reasoning: str = "", content: str = "", calls=()) -> str:
    """The turn a model of the family writes after ``prefix`` (which may have opened its reasoning)."""
    calls = [write_call(fmt, name, args) for name, args in calls]
    if fmt in ("hermes", "qwen3_5"):
        text = f"{reasoning}\n</think>\n\n" if prefix.endswith("<think>\n") else \
            f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
        return text + content + ("\n\n" if content and calls else "") + "\n".join(calls) + "<|im_end|>"
    if fmt == "llama3":
        return content + (" " if content and calls else "") + "".join(calls) + "<|eot_id|>"
    if fmt == "harmony":
        parts = [f"<|channel|>analysis<|message|>{reasoning}<|end|>"] if reasoning else []
        parts += calls or [f"<|channel|>final<|message|>{content}<|return|>"]
        return "<|start|>assistant".join(parts)
    text = f"{reasoning}<channel|>" if prefix.endswith("<|channel>thought\n") else \
        f"<|channel>thought\n{reasoning}<channel|>" if reasoning else ""
    return text + content + "".join(calls) + ("<|tool_response>" if calls else "<turn|>")


TYPED = {"s": "hello world", "i": 7, "x": 2.5, "flag": True, "items": ["x", 1], "opts": {"k": {"deep": [1, 2]}, "on": False}}
ADD, LOOKUP = ("add", {"a": 2, "b": 3}), ("lookup", {"query": "weather in Paris"})
CASES = {
    "plain": dict(content="The answer is 5."),
    "empty": dict(),
    "reasoning_then_content": dict(reasoning="Two plus three.\nThat is 5.", content="5"),
    "one_call": dict(calls=[ADD]),
    "parallel_calls": dict(calls=[ADD, LOOKUP, ("add", {"a": -1, "b": 0})]),
    "reasoning_and_calls": dict(reasoning="I need both tools.", calls=[ADD, LOOKUP]),
    "typed_arguments": dict(calls=[("typed", TYPED)]),
    "typed_edge_values": dict(calls=[("typed", {"s": "42", "i": -3, "x": 3.0, "flag": False, "items": [],
                                                "opts": {}})]),
    "string_that_looks_like_a_number": dict(calls=[("lookup", {"query": "3.0"})]),
    "padded_string": dict(calls=[("lookup", {"query": "  two spaces around  "})]),
    "multiline_string": dict(calls=[("lookup", {"query": "line one\nline two"})]),
    "unicode": dict(reasoning="Überlegung 🤔", calls=[("lookup", {"query": "東京の天気 ☀ «quoted» 'single' ü"})]),
    "content_before_call": dict(content="Let me add those.", calls=[ADD]),
    "no_arguments": dict(calls=[("noop", {})]),
    "unknown_tool": dict(calls=[("weather", {"city": "Oslo", "days": "3"})]),
}
SKIP = {"llama3": {"reasoning_then_content", "parallel_calls", "reasoning_and_calls", "unicode"},  # no reasoning,
        "harmony": {"content_before_call"}}  # one call a turn in Llama 3; harmony's preamble: test_harmony_preamble
EXPECTED_CALLS = {"typed_arguments": [("typed", TYPED)], "string_that_looks_like_a_number": [("lookup", {"query": "3.0"})]}


def canon(message) -> str:
    """A message as text that tells 1 from 1.0 and from True (which == does not)."""
    return json.dumps(message, sort_keys=True, ensure_ascii=False)


def calls_of(pairs) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in pairs]


@pytest.mark.parametrize("fmt,case", [(f, c) for f in FORMATS for c in CASES if c not in SKIP.get(f, ())])
def test_parse_matches_trl(oracle, fmt, case):
    for prefix in prompts(fmt) + [""]:
        text = write_turn(fmt, prefix, **CASES[case])
        turn = FORMATS[fmt].parse(text, prefix, tools=TOOLS)
        assert isinstance(turn, ParsedTurn) and turn.errors == [], (prefix[-40:], text)
        assert canon(turn.message) == canon(oracle(fmt, text, prefix)), (prefix[-40:], text)
        if case in EXPECTED_CALLS:  # the typed values read back as written
            assert canon(turn.message["tool_calls"]) == canon(calls_of(EXPECTED_CALLS[case]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_template_rendered_turns_match_trl(oracle, fmt):
    """Assistant turns as the family's own templates write them (what SFT teaches), after their generation prompt."""
    add, typed = calls_of([ADD, ("typed", TYPED)])
    replies = [{"content": "5"}, {"content": "5", "reasoning_content": "Easy."}, {"content": "", "tool_calls": [add]},
               {"content": "", "reasoning_content": "Both.", "tool_calls": [add, typed]}]
    checked = 0
    for name in FAMILIES[fmt][4]:
        for thinking in (False, True):
            template = _template(name, enable_thinking=thinking)
            for reply in replies:
                if fmt in ("llama3", "harmony") and len(reply.get("tool_calls", ())) > 1:
                    continue  # Llama 3's template refuses parallel calls, gpt-oss's writes only the first
                prompt = template.render(FIRST, add_generation_prompt=True, tools=TOOLS)
                full = template.render(FIRST + [{"role": "assistant", **reply}], tools=TOOLS)
                if not full.startswith(prompt):
                    continue
                text = full[len(prompt):]
                turn = FORMATS[fmt].parse(text, prompt, tools=TOOLS)
                assert turn.errors == [] and canon(turn.message) == canon(oracle(fmt, text, prompt)), text
                assert canon(turn.message.get("tool_calls", [])) == canon(reply.get("tool_calls", []))
                checked += 1
    assert checked >= 3


WHITESPACE = {  # well-formed calls with less or more whitespace than the templates write
    "hermes": ['<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call><|im_end|>',
               '<tool_call>\n\n  {"name": "add", "arguments": {"a": 2, "b": 3}}  \n</tool_call>\n\n<|im_end|>\n'],
    "qwen3_5": ["<tool_call><function=add><parameter=a>2</parameter><parameter=b>3</parameter></function></tool_call>",
                "<tool_call>\n\n<function=add>\n<parameter=a>  2  </parameter>\n\n<parameter=b>\n3</parameter>"
                "</function></tool_call>\n<|im_end|>"],
    "llama3": ['{"name":"add","parameters":{"a":2,"b":3}}<|eot_id|>',
               '{"name": "add",  "parameters":   {"a": 2, "b": 3}}<|eot_id|>\n'],
    "harmony": [' to=functions.add<|channel|>commentary  json<|message|>{"a":2,"b":3}<|call|>',
                ' to=functions.add<|channel|>commentary\njson<|message|> {"a": 2, "b": 3} <|call|>\n'],
    "gemma4": ["<|tool_call>call:add{ a : 2 , b:3 }<tool_call|>", "<|tool_call>call:add{a:2,b:3}<tool_call|>\n\n<eos>"],
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_whitespace_variants_match_trl(oracle, fmt):
    for text in WHITESPACE[fmt]:
        turn = FORMATS[fmt].parse(text, tools=TOOLS)
        assert turn.errors == [] and canon(turn.message["tool_calls"]) == canon(calls_of([ADD])), text
        assert canon(turn.message) == canon(oracle(fmt, text)), text


def test_arguments_are_typed_by_the_tools_given(oracle):
    """Qwen3.5 writes every argument as text: only the tool's schema types it (transformers' tools=); without tools
    every value stays a string. A JSON format's string for an integer parameter becomes an integer too."""
    text = write_turn("qwen3_5", "", calls=[("typed", TYPED)])
    untyped = FORMATS["qwen3_5"].parse(text).message
    assert canon(untyped) == canon(oracle("qwen3_5", text, tools=None))
    assert untyped["tool_calls"][0]["function"]["arguments"] == {
        "s": "hello world", "i": "7", "x": "2.5", "flag": "true", "items": '["x", 1]', "opts": json.dumps(TYPED["opts"])}
    text = write_turn("hermes", "", calls=[("add", {"a": "7", "b": "3.0"}), ("lookup", {"query": 42})])
    typed = FORMATS["hermes"].parse(text, tools=TOOLS).message
    assert canon(typed) == canon(oracle("hermes", text))
    assert canon(typed["tool_calls"]) == canon(calls_of([("add", {"a": 7, "b": 3}), ("lookup", {"query": 42})]))
    # transformers' casts, string by string: "1" a boolean, "2.0" an integer, "1e3" the integer 1000 (no "."),
    # "3.0" a float, "nan" no number; JSON text for arrays and objects; a list for a scalar parameter item by item
    written = [("typed", {"flag": "1", "i": "2.0", "x": "1e3", "items": "[1]", "opts": '{"k": 1}', "s": 5}),
               ("typed", {"flag": "no", "i": "2.5", "x": "3.0", "items": "1", "opts": "[]"}), ("typed", {"x": "nan"}),
               ("add", {"a": ["1", "2"], "b": ["x", 3]})]
    text = write_turn("hermes", "", calls=written)
    typed = FORMATS["hermes"].parse(text, tools=TOOLS).message
    assert canon(typed) == canon(oracle("hermes", text))
    assert canon(typed["tool_calls"]) == canon(calls_of([
        ("typed", {"flag": True, "i": 2, "x": 1000, "items": [1], "opts": {"k": 1}, "s": 5}),
        ("typed", {"flag": "no", "i": "2.5", "x": 3.0, "items": "1", "opts": "[]"}), ("typed", {"x": "nan"}),
        ("add", {"a": [1, 2], "b": ["x", 3]})]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_turns_agree_with_trl_or_report_errors(oracle, fmt):
    """Random strings of the format's pieces: no exception; no errors -> exactly TRL's message; TRL giving up on the
    turn (its fallback) -> errors here."""
    rng = random.Random(fmt)
    pieces = {"hermes": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>assistant\n",
                         '{"name": "add", "arguments": {"a": "7", "b": 3}}', '{"name": "noop"}', '{"a":',
                         '{"name": "typed", "arguments": {"x": "3.0", "i": "2.0", "flag": "1", "s": 1}}'],
              "qwen3_5": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<function=add>",
                          "</function>", "<parameter=a>", "<parameter=b>", "</parameter>", "7", "[1]", "<function=typed>",
                          "<parameter=x>", "<parameter=flag>", "<parameter=items>", "3.0", "1"],
              "llama3": ['{"name": "add", "parameters": ', '{"a": "7"}', "}", "<|eot_id|>", '{"name": "noop", "arguments": {}}',
                         "{", '"'],
              "harmony": ["<|channel|>analysis<|message|>", "<|channel|>final<|message|>", "<|end|>", "<|return|>",
                          "<|start|>assistant", " to=functions.add", "<|channel|>commentary json<|message|>", '{"a": "7"}',
                          "<|call|>", "to=functions."],
              "gemma4": ["<|channel>thought\n", "<channel|>", "<|tool_call>call:add", '{a:<|"|>7<|"|>,b:3}', "{", "}",
                         "<tool_call|>", "<turn|>", "<|tool_response>", "<eos>", "<|turn>model\n", "<tool_response|>",
                         "<|tool_call>"]}[fmt] + ["hi", "é", "\n", " "]
    whole = [write_call(fmt, *call) for call in [ADD, LOOKUP, ("noop", {}), ("typed", TYPED), ("weather", {"d": "1"})]]
    pieces = [p for p in pieces + whole * 3 + [JOIN[fmt], END[fmt]] if p]
    agreed, calls = 0, 0
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3 if fmt == "llama3" else 10)))
        prefix = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 3))) if rng.random() < 0.3 else ""
        turn, expected = FORMATS[fmt].parse(text, prefix, tools=TOOLS), oracle(fmt, text, prefix)
        if not turn.errors:
            assert canon(turn.message) == canon(expected), (prefix, text)
            agreed, calls = agreed + 1, calls + bool(turn.message.get("tool_calls"))
        if expected == oracle.fallback(fmt, text) and "tool_calls" not in expected and turn.message != expected:
            assert turn.errors, (prefix, text)
    assert agreed >= 50 and calls >= 5, (agreed, calls)  # not a vacuous comparison


# --- Malformed calls: reported, the rest still read ----------------------------------------------------------------

BAD = {  # format -> kind -> (a malformed call as the model writes it, the name reported, a word of the reason,
    #                       what TRL does: "fallback" (the whole turn as content, no calls), "kept" (the call as
    #                       written), "content" (the call's text left in content) or "dropped")
    "hermes": {"bad_json": ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "add", "JSON", "fallback"),
               "no_name": ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', "unknown", "no name", "fallback"),
               "not_an_object": ('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', "add", "list", "kept"),
               "string_arguments": ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "add",
                                    "str", "kept")},
    "qwen3_5": {"no_function": ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "add",
                                "<function=", "content"),
                "no_name": ("<tool_call>\n<function=>\n</function>\n</tool_call>", "unknown", "<function=", "content"),
                "unclosed_parameter": ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>",
                                       "add", "</parameter>", "kept")},
    "llama3": {"bad_json": ('{"name": "add", "parameters": {"a": 1,}}', "add", "JSON", "fallback"),
               "no_name": ('{"parameters": {"a": 1}}', "unknown", "parameters", "content"),
               "arguments_key": ('{"name": "add", "arguments": {"a": 1}}', "add", "parameters", "content"),
               "not_an_object": ('{"name": "add", "parameters": [1, 2]}', "add", "list", "kept")},
    "harmony": {"bad_json": (' to=functions.add<|channel|>commentary json<|message|>{"a": 1,<|call|>', "add", "JSON",
                             "fallback"),
                "no_name": (" to=functions.<|channel|>commentary json<|message|>{}<|call|>", "unknown", "to=functions",
                            "dropped"),
                "constrain_form": ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>',
                                   "add", "to=functions", "dropped"),
                "not_an_object": (" to=functions.add<|channel|>commentary json<|message|>[1, 2]<|call|>", "add", "list",
                                  "kept")},
    "gemma4": {"bad_json": ("<|tool_call>call:add{a:1,,}<tool_call|>", "add", "JSON", "fallback"),
               "no_name": ("<|tool_call>call:{a:1}<tool_call|>", "unknown", "call:NAME", "content"),
               "not_an_object": ("<|tool_call>call:add[1,2]<tool_call|>", "add", "list", "kept")},
}
JOIN = {"hermes": "\n", "qwen3_5": "\n", "llama3": "", "harmony": "<|start|>assistant", "gemma4": ""}
END = {"hermes": "<|im_end|>", "qwen3_5": "<|im_end|>", "llama3": "<|eot_id|>", "harmony": "", "gemma4": "<|tool_response>"}


@pytest.mark.parametrize("fmt,kind", [(f, k) for f, kinds in BAD.items() for k in kinds])
def test_malformed_call_is_an_error_and_the_others_still_parse(oracle, fmt, kind):
    bad, name, word, trl = BAD[fmt][kind]
    if fmt == "llama3":  # one call a turn: the content before it stays
        parts, good = ["Calling:", bad], []
    else:
        parts, good = [write_call(fmt, *ADD), bad, write_call(fmt, *LOOKUP)], calls_of([ADD, LOOKUP])
    text = JOIN[fmt].join(parts) + END[fmt]
    turn = FORMATS[fmt].parse(text, tools=TOOLS)
    assert turn.message.get("tool_calls", []) == good
    assert [n for n, _ in turn.errors] == [name] and word in turn.errors[0][1]
    assert "\n" not in turn.errors[0][1]
    expected = oracle(fmt, text)  # what TRL makes of it, so that the caller never learns of the bad call
    if trl == "fallback":
        assert expected == oracle.fallback(fmt, text)
    elif trl == "kept":
        assert len(expected["tool_calls"]) == len(good) + 1 and expected["tool_calls"][0 if fmt == "llama3" else 1] \
            not in turn.message.get("tool_calls", [])
    else:
        assert expected.get("tool_calls", []) == good
        assert bad.strip() in expected["content"] if trl == "content" else expected["content"] == ""


def test_trl_difference_bad_json_loses_the_whole_turn(oracle):
    text = "<think>\nplan\n</think>\n\n" + write_call("hermes", *ADD) + "\n<tool_call>\n{oops}\n</tool_call><|im_end|>"
    assert oracle("hermes", text) == oracle.fallback("hermes", text)  # TRL: everything as content, no tool calls
    turn = FORMATS["hermes"].parse(text, tools=TOOLS)
    assert turn.message == {"role": "assistant", "content": "", "reasoning_content": "plan", "tool_calls": calls_of([ADD])}
    assert turn.errors == [("unknown", "bad JSON: Expecting property name enclosed in double quotes at character 2")]


def test_trl_difference_arguments_not_an_object_are_kept_by_trl(oracle):
    text = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call><|im_end|>'
    assert oracle("hermes", text)["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert FORMATS["hermes"].parse(text).errors == [("add", "arguments are str, not an object")]
    text = '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call><|im_end|>'  # TRL keeps an empty name too
    assert oracle("hermes", text)["tool_calls"][0]["function"]["name"] == ""
    assert FORMATS["hermes"].parse(text).errors == [("unknown", "the call has no name")]


@pytest.mark.parametrize("fmt", FORMATS)
def test_call_cut_off_by_the_length_limit(oracle, fmt):
    """Every cut of a well-formed turn: no exception, the calls before the cut read, at most the cut one an error, and
    where nothing is reported, TRL's message. A call whose JSON is complete but its end marker cut off is an error
    here; TRL keeps it."""
    calls = [ADD] if fmt == "llama3" else [ADD, ("typed", TYPED)]
    text = write_turn(fmt, "", reasoning="" if fmt == "llama3" else "Plan.", calls=calls)
    for cut in range(len(text) + 1):
        turn = FORMATS[fmt].parse(text[:cut], tools=TOOLS)
        read = turn.message.get("tool_calls", [])
        assert canon(read) == canon(calls_of(calls)[:len(read)]) and len(turn.errors) <= 1
        assert len(read) + len(turn.errors) <= len(calls)
        if not turn.errors and cut:  # (TRL's parse_response of no ids is [], which its trainer never asks for)
            assert canon(turn.message) == canon(oracle(fmt, text[:cut]))
    end = {"hermes": "</tool_call>", "qwen3_5": "</tool_call>", "llama3": "}<|eot_id|>", "harmony": "<|call|>",
           "gemma4": "<tool_call|>"}[fmt]
    cut = text[:text.index(end)]  # the first call complete but for its end marker
    turn = FORMATS[fmt].parse(cut, tools=TOOLS)
    assert turn.errors == [("add", "the call has no end marker (cut off?)")] and "tool_calls" not in turn.message
    if fmt != "llama3":  # TRL reads the complete JSON as a call (Llama 3's close takes the last '}', so it fails)
        assert oracle(fmt, cut)["tool_calls"] == calls_of([ADD])


def test_trl_difference_unreadable_openers(oracle):
    """A call opener the format cannot read: TRL keeps it as content (Qwen3.5, Gemma 4, Llama 3) or drops it
    (gpt-oss, text outside its channels); here it is an error."""
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
    assert oracle("qwen3_5", text) == {"role": "assistant", "content": text.removesuffix("<|im_end|>")}
    assert FORMATS["qwen3_5"].parse(text).message == {"role": "assistant", "content": ""}
    text = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>'
    assert oracle("harmony", text) == {"role": "assistant", "content": ""}
    assert FORMATS["harmony"].parse(text).errors[0][0] == "add"


# --- TRL's surprises, pinned (ours agrees) ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,text,expected", [
    # content before and after a call: only the part after survives (a field written twice keeps the last)
    ("hermes", "Before.\n" + write_call("hermes", *ADD) + "\nAfter.<|im_end|>", {"content": "After.", "tool_calls": [ADD]}),
    # gpt-oss: a commentary preamble (no recipient) is dropped; an unfinished final channel keeps what follows
    ("harmony", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + write_call("harmony", *ADD),
     {"content": "", "tool_calls": [ADD]}),
    ("harmony", "<|channel|>final<|message|>5<|end|>", {"content": "5<|end|>"}),
    # only the prefix is cut at the anchor: a tool response inside the text is content (the last part)
    ("gemma4", "<|tool_call>call:add{a:2,b:3}<tool_call|><|tool_response>response:add{value:5}<tool_response|>It is 5.",
     {"content": "response:add{value:5}<tool_response|>It is 5.", "tool_calls": [ADD]}),
    # a closing </think> with no opener (the prompt that opened it not given) leaves the reasoning in content
    ("hermes", "hm</think>\n\n5<|im_end|>", {"content": "hm</think>\n\n5"}),
    # Qwen3.5's parameter values are stripped; a bare-word value for an integer parameter stays a string
    ("qwen3_5", "<tool_call>\n<function=add>\n<parameter=a>\n two \n</parameter>\n</function>\n</tool_call><|im_end|>",
     {"content": "", "tool_calls": [("add", {"a": "two"})]}),
])
def test_trl_surprises(oracle, fmt, text, expected):
    expected = {"role": "assistant", **expected}
    if "tool_calls" in expected:
        expected["tool_calls"] = calls_of(expected["tool_calls"])
    turn = FORMATS[fmt].parse(text, tools=TOOLS)
    assert turn.errors == [] and canon(turn.message) == canon(expected) == canon(oracle(fmt, text))


def test_prefix_without_anchor_is_read_whole(oracle):
    """transformers reads the whole prefix when its assistant anchor is missing: a prompt without the generation
    prompt leaks into content."""
    prefix = "<|im_start|>user\nhi<|im_end|>\n"
    text = write_call("hermes", *ADD) + "<|im_end|>"
    turn = FORMATS["hermes"].parse(text, prefix, tools=TOOLS)
    assert turn.message == oracle("hermes", text, prefix) and turn.message["content"] == "<|im_start|>user\nhi"


# --- Detection ---------------------------------------------------------------------------------------------------

DETECTED = {"qwen2_5": "hermes", "qwen3": "hermes", "qwen3_next_instruct": "hermes", "qwen3_next_thinking": "hermes",
            "qwen3_5": "qwen3_5", "qwen3_5_small": "qwen3_5", "qwen3_6": "qwen3_5", "llama3_1": "llama3",
            "llama3_2": "llama3", "gpt_oss": "harmony", "gemma4": "gemma4", "gemma4_small": "gemma4",
            "gemma": None, "phi3": None, "deepseek_v3": None}


def renderer(template: ChatTemplate):
    def render(messages, tools):
        try:
            return template.render(messages, tools=tools)
        except ChatTemplateError:
            return None
    return render


def test_every_asset_template_is_listed():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(DETECTED)


@pytest.mark.parametrize("name", DETECTED)
def test_detect_format(name):
    fmt = detect_format(renderer(_template(name)))
    assert (fmt.name if fmt else None) == DETECTED[name]
    if fmt:
        assert fmt is FORMATS[DETECTED[name]]


def test_detect_format_none_for_refusing_or_ignoring_templates():
    assert detect_format(lambda messages, tools: None) is None
    assert detect_format(lambda messages, tools: "".join(f"{m['role']}: {m['content']}\n" for m in messages)) is None


def test_a_new_format_is_one_entry(monkeypatch):
    """A family with its own format: one FORMATS entry makes parse() and detect_format() know it."""
    toy = ToolCallFormat("toy", r"ASSISTANT:", [Field("tool_calls", r"\[CALL\]", r"\[/CALL\]\s*", tcf._json_call),
                                                Field("content", None, r"<END>")])
    monkeypatch.setitem(FORMATS, "toy", toy)

    def render(messages, tools):
        out = ""
        for m in messages:
            out += f"{m['role'].upper()}:{m['content']}"
            for call in m.get("tool_calls", ()):
                out += "[CALL]" + json.dumps(call["function"]) + "[/CALL]"
            out += "<END>"
        return out

    assert detect_format(render) is toy
    turn = toy.parse('Sure.[CALL]{"name": "add", "arguments": {"a": "2", "b": 3}}[/CALL]<END>', tools=TOOLS)
    assert turn.message == {"role": "assistant", "content": "Sure.", "tool_calls": calls_of([ADD])}
