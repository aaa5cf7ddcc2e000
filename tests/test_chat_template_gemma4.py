"""Gemma 4's chat templates as the Hub repos ship them: rendered as transformers renders them, and trained where the
model writes.

Templates: assets/chat_templates/, verbatim (their README names where each copy came from), Google's
2026-07-09 revision ("Google Gemma 4 Canonical Chat Template"):

* ``gemma4.jinja``: google/gemma-4-12B-it, -26B-A4B-it and -31B-it (one text); with thinking off, the generation
  prompt is ``<|turn>model\\n<|channel>thought\\n<channel|>`` (an empty, closed thought channel).
* ``gemma4_small.jinja``: google/gemma-4-E2B-it and -E4B-it; the generation prompt is ``<|turn>model\\n`` either
  way. Otherwise the same text (and one blank line, which renders nothing).

Turns are ``<|turn>ROLE\\n ... <turn|>\\n`` with the assistant's role written ``model``; ``enable_thinking`` puts
``<|think|>`` at the top of a system turn (written even when there is no system message), and reasoning
(``reasoning`` or ``reasoning_content``) is rendered as ``<|channel>thought\\n ... \\n<channel|>`` on the assistant
turns after the last user message (and, with ``preserve_thinking``, on earlier turns that call tools); a
``<|channel>...<channel|>`` block inside an assistant's content is dropped. Tool calls are
``<|tool_call>call:NAME{key:value,...}<tool_call|>`` (strings quoted by the ``<|"|>`` token), and a turn that calls
tools takes the tools' results into the same model turn, each as
``<|tool_response>response:NAME{...}<tool_response|>``, then goes on with the model's text; a turn whose calls have
no results yet ends with ``<|tool_response>``, where generation stops.

Rendering is compared with transformers' own (``render_jinja_template``, which ``apply_chat_template`` calls) on
conversations with a system (or developer) message, multi-turn, reasoning, thought blocks in the content, tool calls
(OpenAI style, with ``role: tool`` results, and Gemma's own ``tool_responses``), tool results with images,
``tools=[...]``, image/audio/video content, ``add_generation_prompt`` after every turn, and the templates' switches
``enable_thinking`` and ``preserve_thinking``. Token ids are compared with ``apply_chat_template``'s through a small
Gemma-style tokenizer (BPE with byte fallback, ``▁`` for spaces, a post-processor adding ``<bos>`` that
``apply_chat_template`` does not use: the template writes ``<bos>`` itself).

What is trained (assistant spans): everything the model writes after the generation prompt, through ``<turn|>``
(not the newline after it). With the closed thought channel in the prompt (12B/26B-A4B/31B, thinking off), a turn
written with its reasoning shares ``<|channel>thought\\n`` with the prompt, so its reasoning, ``<channel|>``, the
content and ``<turn|>`` are trained; otherwise the whole ``<|channel>thought\\n...<channel|>`` block is. The oracle
for the masks is transformers' ``{% generation %}`` masks of a copy of the template marked that way (``marked``).
Masks are checked here on conversations without tool calls (role and string content; reasoning too), which the
derivation from rendering can mark; those that call tools, whose results the template writes inside the model's
turn, are masked through the marked copy of ``waypoint.text.generation_marks`` (``tests/test_agent_traces.py``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import pytest

from tests.conftest import ROOT
from waypoint.text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from waypoint.text.template_sandbox import STEP_LIMIT
from waypoint.text.tokenizer import load_tokenizer
from waypoint.data.chat_dataset import ChatDataset

DATA = ROOT / "assets" / "chat_templates"
SHA256 = {  # the stored texts (the digests the Hub files have), so an edit to one shows
    "gemma4.jinja": "ae53464bf3be25802b3a5b37def7fd89667067d7577049b3b2d74c4d8de4c6d4",
    "gemma4_small.jinja": "0a2c8073c878ab1da004bee933a998606537bbb62016310352c7285c3f01c5b5",
}
TEXT = {name: (DATA / name).read_text(encoding="utf-8") for name in SHA256}
LARGE, SMALL = TEXT["gemma4.jinja"], TEXT["gemma4_small.jinja"]

# Gemma 4's named special tokens (tokenizer_config.json) and its added tokens that chat text uses, the first five at
# Gemma's ids 0-4.
SPECIALS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
CONTROLS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
            "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
            "<|image>", "<|image|>", "<image|>", "<|audio>", "<|audio|>", "<audio|>", "<|video|>"]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, in °C or °F.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "The city's name."},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "array", "items": {"type": "integer"}},
            "options": {"type": "object", "nullable": True, "required": ["wind"], "properties": {
                "wind": {"type": "boolean"}, "note": {"type": "string"}}}}},
        "response": {"type": "object", "description": "Temperature and sky."}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                                                      "limit": {"type": "integer"}}}}},
]
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CALL_PARIS = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": {"city": "Paris", "unit": "celsius"}}}
CALL_OSLO = {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {
    "city": "Oslo", "days": [1, 2], "options": {"wind": True, "note": "vent, ça souffle", "gust": None}}}}
CALL_SEARCH = {"type": "function", "function": {"name": "search", "arguments": {"query": "Oslo warnings", "limit": 3}}}
CONVERSATIONS = {
    "plain": [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
    "multi-turn": [
        {"role": "user", "content": "Pick a colour."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in French? {{ not jinja }} 🙂"},
        {"role": "assistant", "content": "  Rouge — c'est tout !  "}],
    "thought-in-content": [
        SYSTEM, {"role": "user", "content": "Is 9 prime?"},
        {"role": "assistant", "content": "<|channel>thought\n3 x 3 = 9.<channel|>No."},
        {"role": "user", "content": "And 11?"},
        {"role": "assistant", "content": "<|channel>thought\nNo divisors but 1 and 11.<channel|>Yes, 11 is prime."}],
    "reasoning": [  # a developer message is the system turn; `reasoning` and `reasoning_content` are both read
        {"role": "developer", "content": "  Answer in few words.\n"}, {"role": "user", "content": "Pick a colour."},
        {"role": "assistant", "reasoning_content": "Blue is calm.", "content": "Blue."},
        {"role": "user", "content": "Another, in French?"},
        {"role": "assistant", "reasoning": "  Red; rouge.\n", "content": "  Rouge — c'est tout !  "}],
    "multimodal": [
        {"role": "system", "content": [{"type": "text", "text": " Be terse. "}, {"type": "text", "text": "Name things."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "audio"}, {"type": "video"}, {"type": "image_url"},
                                     {"type": "text", "text": "And in these?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A dog barking."}]}],
    "tool-calls": [  # OpenAI style: results as role tool messages, named by tool_call_id or their own name
        SYSTEM, {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "reasoning_content": "Two cities: two calls.", "content": "",
         "tool_calls": [CALL_PARIS, CALL_OSLO]},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 9}'},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "reasoning_content": "Any warnings?", "content": "Let me check for warnings.",
         "tool_calls": [CALL_SEARCH]},
        {"role": "tool", "name": "search", "content": [{"type": "text", "text": "No warnings."}, {"type": "image"}]},
        {"role": "assistant", "content": "Paris 21 °C, Oslo 9 °C; no warnings."},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You're welcome."}],
    "tool-responses": [  # Gemma's own form: the results on the assistant message that called the tool
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [CALL_PARIS],
         "tool_responses": [{"name": "get_weather", "response": {"temp": 21, "sky": "clear", "rain": None}}]},
        {"role": "assistant", "content": "21 °C and clear."}],
    "pending-call": [{"role": "user", "content": "Weather in Oslo?"},
                     {"role": "assistant", "content": "Checking.", "tool_calls": [CALL_OSLO]}],
}
# Masked: no tool calls (see the module doc), and assistant contents as strings, as the chat dataset passes them (the
# masks derived from rendering mark a string content; transformers renders a list of parts as well, see "multimodal").
CONVERSATIONS["images"] = CONVERSATIONS["multimodal"][:-1] + [{"role": "assistant", "content": "A dog barking."}]
MASKED = ("plain", "multi-turn", "thought-in-content", "reasoning", "images")
SWITCHES = [{}, {"enable_thinking": True}, {"preserve_thinking": True}, {"enable_thinking": True, "preserve_thinking": True}]


def transformers_render(text, messages, add_generation_prompt=False, tools=None, **kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=text,
                                        add_generation_prompt=add_generation_prompt, **SPECIALS, **kwargs)
    return rendered[0]


def chat(name, **template_kwargs) -> ChatTemplate:
    return _compiled(name, tuple(sorted(template_kwargs.items())))


@functools.cache
def _compiled(name, template_kwargs) -> ChatTemplate:  # compiling the 18 KB template is most of a rendering test's time
    return ChatTemplate(TEXT[name], name, SPECIALS, CONTROLS, dict(template_kwargs))


def test_stored_templates_are_the_published_text():
    for name, digest in SHA256.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name
        assert TEXT[name].startswith("{#\n  Template: Google Gemma 4 Canonical Chat Template\n")
        assert "Published: 2026-07-09" in TEXT[name]
    # The two differ only in the closed thought channel of the large models' generation prompt (and a blank line).
    prompt = "        {{- '<|turn>model\\n' -}}\n"
    channel = ("        {%- if not enable_thinking -%}\n            {{- '<|channel>thought\\n<channel|>' -}}\n"
               "        {%- endif -%}\n")
    assert LARGE.replace(prompt + channel, prompt).replace("' + role + '\\n' }}\n\n", "' + role + '\\n' }}\n") == SMALL


# Rendering: text identical to transformers' -----------------------------------------------------------------

@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", SHA256)
def test_renders_as_transformers(name, conversation):
    messages = CONVERSATIONS[conversation]
    for switches in SWITCHES:
        ours = chat(name, **switches)
        for tools in (None, TOOLS):
            text = ours.render(messages, tools=tools)
            assert text == transformers_render(TEXT[name], messages, tools=tools, **switches), (switches, tools)
            assert text.startswith("<bos>")
            for end in range(1, len(messages) + 1):  # the prompt after every message
                prompt = ours.render(messages[:end], add_generation_prompt=True, tools=tools)
                assert prompt == transformers_render(TEXT[name], messages[:end], True, tools, **switches), (switches, end)


def test_tokenizer_apply_chat_template_agrees(checkpoint):
    from transformers import AutoTokenizer

    theirs, tokenizer = AutoTokenizer.from_pretrained(checkpoint), load_tokenizer(checkpoint)
    messages = CONVERSATIONS["tool-calls"]
    for switches in ({}, {"enable_thinking": True}):
        ours = load_chat_template(tokenizer, template_kwargs=switches)
        assert ours.render(messages, tools=TOOLS) == theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                                                **switches)
        assert ours.render(messages[:2], True, TOOLS) == theirs.apply_chat_template(
            messages[:2], tools=TOOLS, tokenize=False, add_generation_prompt=True, **switches)


def test_what_the_templates_write():
    plain = CONVERSATIONS["plain"]
    text = chat("gemma4.jinja").render(plain)
    assert text == ("<bos><|turn>system\nYou are a terse assistant.<turn|>\n<|turn>user\nWhat is 2 + 3?<turn|>\n"
                    "<|turn>model\n5<turn|>\n")
    assert chat("gemma4_small.jinja").render(plain) == text
    # The generation prompt: an empty closed thought channel on 12B/26B-A4B/31B with thinking off (the default).
    for name, off in (("gemma4.jinja", "<|turn>model\n<|channel>thought\n<channel|>"),
                      ("gemma4_small.jinja", "<|turn>model\n")):
        for switches, tail in (({}, off), ({"enable_thinking": False}, off), ({"enable_thinking": True}, "<|turn>model\n")):
            prompt = chat(name, **switches).render(plain[:2], True)
            assert prompt.endswith("What is 2 + 3?<turn|>\n" + tail), (name, switches)
            assert prompt.startswith("<bos><|turn>system\n<|think|>\nYou are" if switches.get("enable_thinking")
                                     else "<bos><|turn>system\nYou are"), (name, switches)
        # Thinking on writes a system turn even without a system message.
        assert chat(name, enable_thinking=True).render(plain[1:2]).startswith("<bos><|turn>system\n<|think|>\n<turn|>\n")
        assert chat(name).render(plain[1:2]) == "<bos><|turn>user\nWhat is 2 + 3?<turn|>\n"
    # Reasoning: only after the last user message; thought blocks in the content are dropped; contents trimmed.
    reasoning = chat("gemma4.jinja").render(CONVERSATIONS["reasoning"])
    assert reasoning.startswith("<bos><|turn>system\nAnswer in few words.<turn|>\n")
    assert "Blue is calm." not in reasoning and "<|turn>model\nBlue.<turn|>\n" in reasoning
    assert reasoning.endswith("<|turn>model\n<|channel>thought\n  Red; rouge.\n\n<channel|>Rouge — c'est tout !<turn|>\n")
    assert "3 x 3" not in chat("gemma4.jinja").render(CONVERSATIONS["thought-in-content"])
    # Tools: declarations in the system turn; calls, results and the model's text in one model turn.
    calls = CONVERSATIONS["tool-calls"]
    text = chat("gemma4.jinja").render(calls, tools=TOOLS)
    assert text.startswith(
        '<bos><|turn>system\nYou are a terse assistant.<|tool>declaration:get_weather{description:<|"|>The weather in '
        'a city, in °C or °F.<|"|>,parameters:{properties:{city:{description:<|"|>The city\'s name.<|"|>,type:<|"|>'
        'STRING<|"|>},days:{items:{type:<|"|>INTEGER<|"|>},type:<|"|>ARRAY<|"|>},options:{nullable:true,properties:{'
        'note:{type:<|"|>STRING<|"|>},wind:{type:<|"|>BOOLEAN<|"|>}},required:[<|"|>wind<|"|>],type:<|"|>OBJECT<|"|>},'
        'unit:{enum:[<|"|>celsius<|"|>,<|"|>fahrenheit<|"|>],type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:'
        '<|"|>OBJECT<|"|>},response:{description:<|"|>Temperature and sky.<|"|>,type:<|"|>OBJECT<|"|>}}<tool|>'
        '<|tool>declaration:search{')
    # Earlier turns that call tools keep their reasoning only with preserve_thinking.
    preserved = chat("gemma4.jinja", preserve_thinking=True).render(calls, tools=TOOLS)
    thoughts = ("<|channel>thought\nTwo cities: two calls.\n<channel|>", "<|channel>thought\nAny warnings?\n<channel|>")
    assert text == preserved.replace(thoughts[0], "").replace(thoughts[1], "")
    assert preserved.endswith(
        '<|turn>user\nWeather in Paris and Oslo?<turn|>\n<|turn>model\n<|channel>thought\nTwo cities: two calls.\n'
        '<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>'
        '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:[1,2],options:{gust:null,note:<|"|>vent, ça souffle<|"|>,'
        'wind:true}}<tool_call|><|tool_response>response:get_weather{value:<|"|>{"temp": 9}<|"|>}<tool_response|>'
        '<|tool_response>response:get_weather{value:<|"|>{"temp": 21}<|"|>}<tool_response|>'
        '<|channel>thought\nAny warnings?\n<channel|><|tool_call>call:search{limit:3,query:<|"|>Oslo warnings<|"|>}'
        '<tool_call|><|tool_response>response:search{value:<|"|>No warnings.<|"|>}<tool_response|><|image|>'
        'Let me check for warnings.Paris 21 °C, Oslo 9 °C; no warnings.<turn|>\n'
        "<|turn>user\nThanks!<turn|>\n<|turn>model\nYou're welcome.<turn|>\n")
    # After the last user message, a turn that calls tools shows its reasoning without preserve_thinking too.
    assert thoughts[0] + "<|tool_call>" in chat("gemma4.jinja").render(calls[:-2])
    # After a tool's result the model goes on in its turn: no prompt, or the opened thought channel.
    assert chat("gemma4.jinja").render(calls[:5], True).endswith('{"temp": 21}<|"|>}<tool_response|>')
    assert chat("gemma4.jinja", enable_thinking=True).render(calls[:5], True).endswith(
        "<tool_response|><|channel>thought\n")
    # A turn whose calls have no results yet ends where generation stops.
    assert chat("gemma4.jinja").render(CONVERSATIONS["pending-call"], True).endswith(
        '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:[1,2],options:{gust:null,note:<|"|>vent, '
        'ça souffle<|"|>,wind:true}}<tool_call|>Checking.<|tool_response>')
    native = chat("gemma4.jinja").render(CONVERSATIONS["tool-responses"])
    assert native.endswith('<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}'
                           '<tool_call|><|tool_response>response:get_weather{rain:null,sky:<|"|>clear<|"|>,temp:21}'
                           '<tool_response|>21 °C and clear.<turn|>\n')
    # A tool message with no call before it is not rendered at all: the chat dataset's records, which carry no
    # tool_calls, lose their tool messages.
    lone = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "ignored"}, {"role": "assistant", "content": "Hello."}]
    assert chat("gemma4.jinja").render(lone) == "<bos><|turn>user\nHi<turn|>\n<|turn>model\nHello.<turn|>\n"
    media = chat("gemma4.jinja").render(CONVERSATIONS["multimodal"])
    assert media.startswith("<bos><|turn>system\nBe terse. Name things. <turn|>\n<|turn>user\n<|image|>What is in this")
    assert "<|turn>user\n<|audio|><|video|><|image|>And in these?<turn|>\n<|turn>model\nA dog barking.<turn|>\n" in media


@pytest.mark.parametrize("name", SHA256)
def test_string_arguments_are_refused_as_transformers_refuses_them(name):
    from jinja2.exceptions import TemplateError

    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    message = ("chat_template: tool_calls[].function.arguments must be a JSON object (mapping), not a string. "
               "Deserialize arguments before passing to the template.")
    with pytest.raises(TemplateError, match=r"must be a JSON object"):
        transformers_render(TEXT[name], messages)
    with pytest.raises(ChatTemplateError) as info:
        chat(name).render(messages)
    assert str(info.value).startswith(f"{name}: chat template failed (line ")
    assert str(info.value).endswith(f"TemplateError: {message}") and "\n" not in str(info.value)


@pytest.mark.parametrize("attack", [
    "{{ messages[0].get.__self__.__class__.__mro__ }}",
    "{{ ns.__class__.__init__.__globals__['os'] }}",
    "{{ format_argument._func.__globals__['os'].system('id') }}",
    "{{ (messages[0] | dictsort | list).__class__.__base__.__subclasses__() }}",
])
def test_the_sandbox_still_refuses_what_the_template_does_not_need(attack):
    """The constructs Gemma 4's template uses (macros with keyword arguments, namespace, dict.get, block set,
    dictsort, map) reach nothing more."""
    evil = ChatTemplate(LARGE + "\n" + attack, "evil.jinja", SPECIALS, CONTROLS)
    with pytest.raises(ChatTemplateError, match=r"evil\.jinja: chat template refused \(line \d+\): SecurityError"):
        evil.render(CONVERSATIONS["tool-calls"], tools=TOOLS)


def test_steps_grow_with_the_square_of_the_messages():
    """From every message the template loops over all the messages after it (next_nt, whose loop runs to the end
    however early it finds one): a rendering takes about n²/2 steps for n messages, so STEP_LIMIT (250,000) stops
    conversations of more than about 700 messages."""
    ours = chat("gemma4.jinja")
    messages = [SYSTEM]
    for n in range(50):
        messages += [{"role": "user", "content": f"Question {n}"},
                     {"role": "assistant", "reasoning_content": "t", "content": f"{n}"}]
    assert ours.render(messages, tools=TOOLS) == transformers_render(LARGE, messages, tools=TOOLS)
    steps = ours._env.steps_used
    assert len(messages) ** 2 / 2 <= steps <= len(messages) ** 2 / 2 + 10 * len(messages), steps
    assert STEP_LIMIT / steps > 40


# Assistant spans: where the model writes -------------------------------------------------------------------

_SAME = {"plain": ["5<turn|>"],
         "multi-turn": ["Blue.<turn|>", "Rouge — c'est tout !<turn|>"],
         "thought-in-content": ["No.<turn|>", "Yes, 11 is prime.<turn|>"],
         "images": ["A cat.<turn|>", "A dog barking.<turn|>"]}
# The prompt holds <|channel>thought\n (12B/26B-A4B/31B, thinking off): the last turn's reasoning after it is trained.
TRAINED_CLOSED_CHANNEL = {**_SAME, "reasoning": ["Blue.<turn|>", "  Red; rouge.\n\n<channel|>Rouge — c'est tout !<turn|>"]}
# The prompt ends at <|turn>model\n: the whole thought channel is trained.
TRAINED_OPEN = {**_SAME, "reasoning": ["Blue.<turn|>",
                                       "<|channel>thought\n  Red; rouge.\n\n<channel|>Rouge — c'est tout !<turn|>"]}
TRAINED = {
    ("gemma4.jinja", ()): TRAINED_CLOSED_CHANNEL,
    ("gemma4.jinja", (("preserve_thinking", True),)): TRAINED_CLOSED_CHANNEL,
    ("gemma4.jinja", (("enable_thinking", True),)): TRAINED_OPEN,
    ("gemma4_small.jinja", ()): TRAINED_OPEN,
    ("gemma4_small.jinja", (("enable_thinking", True),)): TRAINED_OPEN,
}


@pytest.mark.parametrize("name, switches", TRAINED, ids=[n + "".join(f"-{k}={v}" for k, v in s) for n, s in TRAINED])
def test_assistant_spans(name, switches):
    ours = chat(name, **dict(switches))
    for conversation, expected in TRAINED[name, switches].items():
        text, spans = ours.assistant_spans(CONVERSATIONS[conversation])
        assert text == ours.render(CONVERSATIONS[conversation])
        assert [text[s:e] for s, e in spans] == expected, conversation


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def marked(name: str) -> str:
    """A Gemma 4 template with {% generation %} around what the model writes after the generation prompt (the
    module doc), for conversations without tool calls: the oracle for the masks."""
    text = TEXT[name]
    prompt_holds_channel = "role == 'model' and not enable_thinking" if name == "gemma4.jinja" else "false"
    text = _replace_once(text, "        {{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}\n", (
        f"        {{%- if {prompt_holds_channel} -%}}\n"
        "            {{- '<|channel>thought\\n' -}}{%- generation -%}{{- thinking_text + '\\n<channel|>' -}}"
        "{%- endgeneration -%}\n"
        "        {%- else -%}\n"
        "            {%- generation -%}{{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}"
        "{%- endgeneration -%}\n"
        "        {%- endif -%}\n"))
    text = _replace_once(text, "            {{- captured_content -}}\n", (
        "            {%- if role == 'model' -%}{%- generation -%}{{- captured_content -}}{%- endgeneration -%}\n"
        "            {%- else -%}{{- captured_content -}}{%- endif -%}\n"))
    text = _replace_once(text, "            {{- '<turn|>\\n' -}}\n", (
        "            {%- if role == 'model' -%}{%- generation -%}{{- '<turn|>' -}}{%- endgeneration -%}{{- '\\n' -}}\n"
        "            {%- else -%}{{- '<turn|>\\n' -}}{%- endif -%}\n"))
    return text


def write_checkpoint(directory: Path, template: str) -> Path:
    """A small Gemma-style tokenizer (BPE with byte fallback, spaces as ▁, <bos> added by its post-processor) with
    Gemma 4's control tokens, and the template as chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    corpus = [json.dumps(c, ensure_ascii=False) for c in CONVERSATIONS.values()] + [json.dumps(TOOLS), LARGE] * 2
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=CONTROLS, show_progress=False, limit_alphabet=70)
    backend.train_from_iterator(corpus, trainer)
    data = json.loads(backend.to_str())
    for byte in range(256):  # what falls outside the alphabet (emoji, accents) is spelled in bytes
        data["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(data["model"]["vocab"]))
    backend = Tokenizer.from_str(json.dumps(data))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bos = backend.token_to_id("<bos>")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                           special_tokens=[("<bos>", bos)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "model_max_length": 4096, **SPECIALS}))
    (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("gemma4"), LARGE)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("gemma4-small"), SMALL)


def test_the_tokenizer_spells_what_falls_outside_its_alphabet_in_bytes(checkpoint):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(checkpoint)
    assert theirs.tokenize("🙂 ç") == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "▁", "<0xC3>", "<0xA7>"]
    assert theirs("hi")["input_ids"][0] == theirs.convert_tokens_to_ids("<bos>")  # not used by apply_chat_template


@pytest.mark.parametrize("name", SHA256)
def test_ids_equal_transformers(checkpoint, small_checkpoint, name):
    from transformers import AutoTokenizer

    directory = checkpoint if name == "gemma4.jinja" else small_checkpoint
    theirs, tokenizer = AutoTokenizer.from_pretrained(directory), load_tokenizer(directory)
    for switches in ({}, {"enable_thinking": True}):
        ours = chat(name, **switches)  # as load_chat_template(tokenizer) reads it (test_tokenizer_apply_chat_template_agrees)
        for conversation, messages in CONVERSATIONS.items():
            for tools in (None, TOOLS):
                expected = theirs.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                      **switches)["input_ids"]
                assert expected.count(theirs.convert_tokens_to_ids("<bos>")) == 1
                ids, _ = tokenizer.encode_with_offsets(ours.render(messages, tools=tools))
                assert ids == expected, (conversation, switches, tools)


@pytest.mark.parametrize("name, switches", TRAINED, ids=[n + "".join(f"-{k}={v}" for k, v in s) for n, s in TRAINED])
def test_ids_and_masks_equal_transformers(checkpoint, small_checkpoint, name, switches):
    from transformers import AutoTokenizer

    switches = dict(switches)
    directory = checkpoint if name == "gemma4.jinja" else small_checkpoint
    theirs, tokenizer = AutoTokenizer.from_pretrained(directory), load_tokenizer(directory)
    ours, oracle_template = chat(name, **switches), marked(name)
    assert set(tokenizer.added_tokens) == set(CONTROLS) and tokenizer.special_tokens == SPECIALS
    for conversation in MASKED:
        messages = CONVERSATIONS[conversation]
        expected = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, **switches)["input_ids"]
        oracle = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                            chat_template=oracle_template, **switches)
        assert oracle["input_ids"] == expected  # the marked copy renders the same text
        ids, mask = ours.encode(messages, tokenizer)
        assert ids == expected, conversation
        assert mask == oracle["assistant_masks"], (conversation, theirs.decode([i for i, m in zip(ids, mask) if m]))
        assert theirs.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == "".join(
            TRAINED[name, tuple(switches.items())][conversation])


def test_chat_dataset_trains_on_the_assistant_turns(tmp_path, checkpoint, small_checkpoint):
    """Through the data path (role and content only): the labels are the assistant turns as the model writes them,
    <turn|> included, nothing of the system, user or header text."""
    from transformers import AutoTokenizer

    conversations = [CONVERSATIONS[c] for c in ("plain", "multi-turn", "thought-in-content")]
    records = [{"messages": messages} for messages in conversations]
    records.append({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."},
                                      {"from": "tool", "value": "dropped by the template"},
                                      {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye."}],
                    "system": "Be brief."})
    conversations.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello."}, {"role": "tool", "content": "dropped by the template"},
                          {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}])
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    expected_text = [_SAME["plain"], _SAME["multi-turn"], _SAME["thought-in-content"], ["Hello.<turn|>", "Bye.<turn|>"]]
    for name, directory in (("gemma4.jinja", checkpoint), ("gemma4_small.jinja", small_checkpoint)):
        theirs = AutoTokenizer.from_pretrained(directory)
        dataset = ChatDataset(tmp_path / "d.jsonl", load_tokenizer(directory), max_seq_len=4096)
        eot = theirs.convert_tokens_to_ids("<turn|>")
        for n, messages in enumerate(conversations):
            item = dataset[n]
            assert item["tokens"] == theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            oracle = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, chat_template=marked(name),
                                                return_assistant_tokens_mask=True)["assistant_masks"]
            assert [t != -100 for t in item["labels"]] == [bool(m) for m in oracle], (name, n)
            trained = [t for t in item["labels"] if t != -100]
            assert theirs.decode(trained, skip_special_tokens=False) == "".join(expected_text[n])
            assert trained.count(eot) == len(expected_text[n])
