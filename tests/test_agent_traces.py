"""Agent traces as chat data (TRL's conversational format): a ``tools`` column, assistant turns with reasoning and
``tool_calls``, ``tool`` results, contents as lists of parts; rendered and tokenized as transformers'
``apply_chat_template(messages, tools=...)`` does, and trained on each assistant turn as the model writes it, tool
calls included, tool results never.

The Qwen3 / Qwen3.5 / Qwen3.6 / Qwen3-Next templates (assets/chat_templates/, as published) find their assistant
turns through marked copies in one rendering (``waypoint.text.generation_marks``). The oracles: what is trained,
written out by hand per template and switch; and, on every conversation the rendering-based derivation can mark
(no tool calls), the derivation's spans, a different algorithm checked against transformers' own masks elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.test_chat_template_gemma4 as GEMMA4
from tests.test_chat_template_qwen35 import CONTROLS, CONVERSATIONS, SPECIALS, SWITCHES, TOOLS, write_checkpoint
from tests.conftest import ROOT
from waypoint.data.chat_dataset import ChatDataset
from waypoint.text.chat_template import ChatTemplate, ChatTemplateError
from waypoint.text.generation_marks import MARKS, digest
from waypoint.text.tokenizer import load_tokenizer

DATA = ROOT / "assets" / "chat_templates"
MARKED = ["qwen3", "qwen3_5", "qwen3_5_small", "qwen3_6", "qwen3_next_thinking", "qwen3_next_instruct", "llama3_2",
          "llama3_1"]
TEXT = {name: (DATA / f"{name}.jinja").read_text(encoding="utf-8") for name in MARKED}

# What the model writes in the "tool-calls" conversation, per template and switches: its three turns.
_CALLS_XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n"
              "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
              "</parameter>\n<parameter=days>\n[1, 2]\n</parameter>\n<parameter=options>\n"
              '{"wind": true, "note": "vent, ça souffle"}\n</parameter>\n</function>\n</tool_call><|im_end|>')
_SEARCH_XML = ("Let me check for warnings.\n\n<tool_call>\n<function=search>\n<parameter=query>\nOslo weather warnings\n"
               "</parameter>\n<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>")
_CALLS_JSON = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2], "options": '
               '{"wind": true, "note": "vent, ça souffle"}}}\n</tool_call><|im_end|>')
_SEARCH_JSON = ('Let me check for warnings.\n<tool_call>\n{"name": "search", "arguments": {"query": '
                '"Oslo weather warnings", "limit": 3}}\n</tool_call><|im_end|>')
_ANSWER = "Paris 21 °C, Oslo 9 °C; no warnings.<|im_end|>"
_REASONED = "Two cities: two calls.\n</think>\n\n"
_XML_THINKING = [_REASONED + _CALLS_XML, "\n</think>\n\n" + _SEARCH_XML, "\n</think>\n\n" + _ANSWER]  # prompt opens <think>
_XML_NOT_THINKING = [_REASONED + _CALLS_XML, _SEARCH_XML, _ANSWER]  # the prompt closes an empty <think> block
TRAINED_CALLS = {
    ("qwen3_5", ()): _XML_THINKING,
    ("qwen3_6", ()): _XML_THINKING,
    ("qwen3_6", (("preserve_thinking", True),)): _XML_THINKING,
    ("qwen3_5", (("enable_thinking", False),)): _XML_NOT_THINKING,
    ("qwen3_5_small", ()): _XML_NOT_THINKING,
    # Qwen3's prompt writes no <think>: a turn's whole block is the model's (the last one's, even empty)
    ("qwen3", ()): ["<think>\n" + _REASONED + _CALLS_JSON, _SEARCH_JSON, "<think>\n\n</think>\n\n" + _ANSWER],
    ("qwen3", (("enable_thinking", False),)): [_REASONED + _CALLS_JSON, _SEARCH_JSON, _ANSWER],
    ("qwen3_next_thinking", ()): [_REASONED + _CALLS_JSON, _SEARCH_JSON, "\n</think>\n\n" + _ANSWER],
    ("qwen3_next_instruct", ()): [_CALLS_JSON, _SEARCH_JSON, _ANSWER],
}
# Conversations the derivation can mark, and a few more turns of reasoning in and out of the history
DERIVABLE = {**{k: v for k, v in CONVERSATIONS.items() if k != "tool-calls"},
             "history": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                         {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                         {"role": "assistant", "reasoning_content": "r", "content": "d"}, {"role": "user", "content": "e"},
                         {"role": "assistant", "content": "f"}],
             "empty-reasoning": [{"role": "user", "content": "a"}, {"role": "assistant", "reasoning_content": "", "content": "b"}],
             "two-in-a-row": [{"role": "user", "content": "a"}, {"role": "assistant", "reasoning_content": "x", "content": "b"},
                              {"role": "assistant", "content": "more"}],
             "thinking-alias": [{"role": "user", "content": "a"}, {"role": "assistant", "thinking": "deep", "content": "b"}]}


def chat(name, **switches) -> ChatTemplate:
    return ChatTemplate(TEXT[name], name, SPECIALS, CONTROLS, switches)


def test_each_marked_template_is_the_published_one():
    published = [TEXT[name] for name in MARKED] + list(GEMMA4.TEXT.values()) + [(DATA / "gpt_oss.jinja").read_text()]
    assert {digest(text) for text in published} == set(MARKS)
    for name in MARKED:
        assert chat(name)._marked is not None, name


@pytest.mark.parametrize("name, switches", TRAINED_CALLS, ids=[n + "".join(f"-{k}={v}" for k, v in s) for n, s in TRAINED_CALLS])
def test_tool_call_turns_are_trained_as_the_model_writes_them(name, switches):
    ours = chat(name, **dict(switches))
    messages = CONVERSATIONS["tool-calls"]
    text, spans = ours.assistant_spans(messages, TOOLS)
    assert text == ours.render(messages, tools=TOOLS)
    assert [text[s:e] for s, e in spans] == TRAINED_CALLS[name, switches]
    # nothing of the tools' results, the system or the user, whatever the template writes around them
    assert not any("<tool_response>" in text[s:e] or "Weather in Paris" in text[s:e] for s, e in spans)


@pytest.mark.parametrize("name", MARKED)
def test_the_marked_copy_trains_what_the_derivation_finds(name):
    for switches in SWITCHES:
        ours = chat(name, **switches)
        for conversation, messages in DERIVABLE.items():
            for tools in (None, TOOLS):
                try:
                    ours.render(messages, tools=tools)
                except ChatTemplateError:  # one the template refuses (Llama 3.2's: a list of parts) is refused alike
                    with pytest.raises(ChatTemplateError):
                        ours.assistant_spans(messages, tools)
                    continue
                text, spans = ours.assistant_spans(messages, tools)
                derived_text, derived = ours._derive_spans(messages, tools)
                assert text == derived_text and spans == derived, (conversation, switches, tools is not None)


def test_llama_3_2_trains_its_single_tool_call_and_never_the_ipython_result():
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": [1]}}}]},
                {"role": "ipython", "content": '{"temp": 9}'}, {"role": "assistant", "content": " It is 9 °C. "}]
    ours = ChatTemplate(TEXT["llama3_2"], "llama3_2", {"bos_token": "<|begin_of_text|>"}, ["<|eot_id|>"])
    text, spans = ours.assistant_spans(messages, TOOLS)
    assert text == render_jinja_template([messages], tools=TOOLS, chat_template=TEXT["llama3_2"],
                                         bos_token="<|begin_of_text|>")[0][0]
    assert [text[s:e] for s, e in spans] == ['{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1]}}<|eot_id|>',
                                             "It is 9 °C.<|eot_id|>"]
    with pytest.raises(ChatTemplateError, match="This model only supports single tool-calls at once!"):
        ours.assistant_spans(CONVERSATIONS["tool-calls"], TOOLS)


def test_llama_3_1_trains_built_in_and_custom_calls_through_eom_in_ipython_mode():
    """Llama 3.1: with built-in tools (a template switch), a built-in call is <|python_tag|>NAME.call(...) and
    every call ends with <|eom_id|>; without them a call ends with <|eot_id|>."""
    from transformers.utils.chat_template_utils import render_jinja_template

    call = lambda name, arguments: {"type": "function", "function": {"name": name, "arguments": arguments}}  # noqa: E731
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "tool_calls": [call("brave_search", {"query": "Oslo weather"})]},
                {"role": "ipython", "content": "Rain."},
                {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
                {"role": "tool", "content": "9"}, {"role": "assistant", "content": "Rain, 9 °C."}]
    for switches, end in (({"builtin_tools": ["brave_search", "wolfram_alpha"]}, "<|eom_id|>"), ({}, "<|eot_id|>")):
        ours = ChatTemplate(TEXT["llama3_1"], "llama3_1", {"bos_token": "<|begin_of_text|>"}, ["<|eot_id|>", "<|eom_id|>"],
                            switches)
        text, spans = ours.assistant_spans(messages, TOOLS)
        assert text == render_jinja_template([messages], tools=TOOLS, chat_template=TEXT["llama3_1"],
                                             bos_token="<|begin_of_text|>", **switches)[0][0]
        first = ('<|python_tag|>brave_search.call(query="Oslo weather")' if switches else
                 '{"name": "brave_search", "parameters": {"query": "Oslo weather"}}')
        assert [text[s:e] for s, e in spans] == [first + end, '{"name": "get_weather", "parameters": {"city": "Oslo"}}' + end,
                                                 "Rain, 9 °C.<|eot_id|>"], switches


def test_masks_take_one_rendering_of_each_template_whatever_the_length(monkeypatch):
    """100 turn pairs with reasoning: the marked copy and the template, once each (the derivation renders three
    times per turn, each time the conversation up to it)."""
    import waypoint.text.chat_template as module

    renders = []
    original = module.render_limited
    monkeypatch.setattr(module, "render_limited", lambda *a, **k: renders.append(1) or original(*a, **k))
    messages = [{"role": "system", "content": "S"}]
    for n in range(100):
        messages += [{"role": "user", "content": f"Question {n}"},
                     {"role": "assistant", "reasoning_content": f"think {n}", "content": f"{n}"}]
    ours = chat("qwen3_5")
    ours._generation_prompt_tail()
    renders.clear()
    text, spans = ours.assistant_spans(messages, TOOLS)
    assert len(renders) == 2 and len(spans) == 100
    renders.clear()
    assert ours._derive_spans(messages, TOOLS) == (text, spans)
    assert len(renders) > 200


def test_an_edited_template_is_not_taken_for_the_published_one():
    edited = ChatTemplate(TEXT["qwen3_5"] + "\n", "edited.jinja", SPECIALS, CONTROLS)
    assert edited._marked is None
    messages = DERIVABLE["history"]
    assert edited.assistant_spans(messages) == chat("qwen3_5").assistant_spans(messages)


# Through the chat dataset ------------------------------------------------------------------------------------

AGENT_RECORDS = [
    {"tools": TOOLS, "messages": CONVERSATIONS["tool-calls"]},
    {"tools": json.dumps(TOOLS), "messages": CONVERSATIONS["tool-calls"]},  # a string column, as parquet often holds it
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                  {"role": "assistant", "thinking": "A greeting.", "content": [{"type": "text", "text": "Hello!"}]}]},
    {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [  # content None or left out, arguments as a JSON string
            {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "ipython", "name": "get_weather", "tool_call_id": "c1", "content": '{"temp": 9}'},
        {"role": "assistant", "content": "9 °C."}]},
]


@pytest.fixture(scope="module")
def qwen35_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3.5-agent"), TEXT["qwen3_5"])


def as_transformers_takes_it(record):
    """The record as one passes it to apply_chat_template: ipython as tool, the tools and the arguments as objects."""
    messages = [{**m, "role": "tool" if m["role"] == "ipython" else m["role"]} for m in record["messages"]]
    for m in messages:
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               if isinstance(c.get("function", {}).get("arguments"), str) else c for c in m["tool_calls"]]
    tools = record.get("tools")
    return messages, json.loads(tools) if isinstance(tools, str) else tools


def test_the_chat_dataset_trains_agent_traces_as_transformers_tokenizes_them(tmp_path, qwen35_checkpoint):
    from transformers import AutoTokenizer

    source = tmp_path / "agent.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in AGENT_RECORDS))
    theirs = AutoTokenizer.from_pretrained(qwen35_checkpoint)
    for option in ({}, {"assistant_only_loss": True}):
        dataset = ChatDataset(source, load_tokenizer(qwen35_checkpoint), max_seq_len=4096, **option)
        trained = []
        for n, record in enumerate(AGENT_RECORDS):
            messages, tools = as_transformers_takes_it(record)
            expected = theirs.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
            item = dataset[n]
            assert item["tokens"] == expected, n
            trained.append(theirs.decode([t for t in item["labels"] if t != -100], skip_special_tokens=False))
        assert trained[0] == trained[1] == "".join(_XML_THINKING)
        assert trained[2] == "A greeting.\n</think>\n\nHello!<|im_end|>"
        assert trained[3] == ("\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                              "</function>\n</tool_call><|im_end|>\n</think>\n\n9 °C.<|im_end|>")
    everything = ChatDataset(source, load_tokenizer(qwen35_checkpoint), max_seq_len=4096, assistant_only_loss=False)
    assert all(t != -100 for t in everything[0]["labels"])
    from omegaconf import OmegaConf  # the template's switches, as a config gives them

    switched = ChatDataset(source, load_tokenizer(qwen35_checkpoint), max_seq_len=4096,
                           chat_template_kwargs=OmegaConf.create({"enable_thinking": False}))
    messages, tools = as_transformers_takes_it(AGENT_RECORDS[0])
    assert switched[0]["tokens"] == theirs.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                               enable_thinking=False)["input_ids"]
    assert theirs.decode([t for t in switched[0]["labels"] if t != -100], skip_special_tokens=False) == \
        "".join(_XML_NOT_THINKING)
    with pytest.raises(ValueError, match=r"^dataset\.chat_template_kwargs=\['enable_thinking'\]: expected a mapping"):
        ChatDataset(source, load_tokenizer(qwen35_checkpoint), max_seq_len=4096, chat_template_kwargs=["enable_thinking"])


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}, "message 2: missing key 'content'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": {"name": "f"}}]},
     "message 2: 'tool_calls' must be a non-empty list of calls"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "message 2: tool call 1: expected {'type': 'function', 'function': {'name': ..., 'arguments': {...}}}"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "message 2: tool call 1 (f): arguments are not JSON (Expecting property name enclosed in double quotes)"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}]},
     "message 2: tool call 1 (f): arguments must be an object, got list"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}, {"role": "assistant", "content": "b"}]},
     "message 1: 'content' must be a string or a list of parts ({'type': 'text', 'text': ...}), got list"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "reasoning_content": 3, "content": "b"}]},
     "message 2: 'reasoning_content' must be a string, got int"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "name": ["f"], "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "message 2: 'name' must be a string, got list"),
    ({"tools": "[{", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "'tools' is a string but not JSON (Expecting property name enclosed in double quotes)"),
    ({"tools": {"name": "f"}, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "'tools' must be a list of tool definitions (objects)"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}],
      "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "'tools': a tool definition without a name: expected {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}"),
], ids=["no-content", "calls-not-list", "call-without-name", "arguments-not-json", "arguments-list", "parts", "reasoning",
        "tool-name", "tools-not-json", "tools-not-list", "tool-without-name"])
def test_a_malformed_agent_record_is_one_line_naming_it(tmp_path, qwen35_checkpoint, record, message):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"messages": CONVERSATIONS["plain"]}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError) as info:
        ChatDataset(source, load_tokenizer(qwen35_checkpoint), max_seq_len=4096)
    assert str(info.value).startswith(f"{source}: record 2 (line 2): ") and str(info.value).endswith(message), str(info.value)
    assert "\n" not in str(info.value)
    skipped = ChatDataset(source, load_tokenizer(qwen35_checkpoint), max_seq_len=4096, skip_bad_records=True)
    assert len(skipped) == 1 and skipped.skipped == 1
    with pytest.raises(ValueError, match=r"^dataset: train_on_input=true and assistant_only_loss=true contradict"):
        ChatDataset(source, load_tokenizer(qwen35_checkpoint), max_seq_len=4096, train_on_input=True, assistant_only_loss=True)


def test_arguments_reach_each_template_in_the_form_it_takes():
    """Objects where a template takes them (Qwen3.5's refuses a string), JSON text where it refuses an object
    (DeepSeek-V3's writes the arguments into a string); the rendering is then transformers' of that form."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def call(arguments):
        return [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}]

    as_object, as_text = {"city": "Oslo", "note": "ça souffle"}, '{"city": "Oslo", "note": "ça souffle"}'
    for name, taken in (("qwen3_5.jinja", as_object), ("deepseek_v3.jinja", as_text), ("llama3_2.jinja", as_object)):
        text = (DATA / name).read_text(encoding="utf-8")
        ours = ChatTemplate(text, name, {"bos_token": "<s>", "eos_token": "</s>"}, CONTROLS)
        expected = render_jinja_template([call(taken)], chat_template=text, bos_token="<s>", eos_token="</s>")[0][0]
        for given in (as_object, as_text):
            assert ours.render(ours.with_arguments_it_takes(call(given))) == expected, (name, given)
    with pytest.raises(Exception, match="Can only get item pairs from a mapping"):  # the negative control
        render_jinja_template([call(as_text)], chat_template=TEXT["qwen3_5"])



# DeepSeek-V3 (TRL's copy of the original template): its turns found by the rendering-based derivation. One round of
# calls (one or several in a message) and its results; a tool-calling message needs "content" ("" when it has none):
# without it the template fails, as it does under TRL, which drops None values too.
_DSV3 = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
_DSV3_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{{\"city\": \"{}\"}}\n```"
              "<｜tool▁call▁end｜>")


def _weather(*cities, content=""):
    return {"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}} for city in cities]}


def _trained_text(text: str, name: str, messages: list[dict]) -> list[str]:
    """The text of each span ``text`` (a DeepSeek-V3 template) trains in ``messages``."""
    template = ChatTemplate(text, name, _DSV3, ())
    rendered, spans = template.assistant_spans(template.with_arguments_it_takes(messages))
    return [rendered[a:b] for a, b in spans]


_DSV3_TEXT = (DATA / "deepseek_v3.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize("calls, content", [(["Paris"], ""), (["Paris", "Oslo"], "Checking.")], ids=["one-call", "two-calls"])
def test_deepseek_v3_trains_its_calls_and_answer_as_trls_training_copy_less_the_template_s_own_tokens(calls, content):
    """The model's calls through <｜end▁of▁sentence｜>, then its answer; never the results. TRL 1.16's training copy
    (deepseekv3_training.jinja, with {% generation %}) trains the same plus the text the template writes before each:
    the <｜Assistant｜> header and <｜tool▁outputs▁end｜> (the generation prompt writes both: the model does not)."""
    import trl

    messages = [{"role": "user", "content": "Weather?"}, _weather(*calls, content=content),
                *({"role": "tool", "name": "get_weather", "content": str(20 + i)} for i in range(len(calls))),
                {"role": "assistant", "content": "Mild."}]
    eos = _DSV3["eos_token"]
    trained = [content + "<｜tool▁calls▁begin｜>" + "\n".join(_DSV3_CALL.format(c) for c in calls) + "<｜tool▁calls▁end｜>" + eos,
               "Mild." + eos]
    assert _trained_text(_DSV3_TEXT, "deepseek_v3", messages) == trained
    trl_copy = (Path(trl.__file__).parent / "chat_templates/deepseekv3_training.jinja").read_text(encoding="utf-8")
    assert _trained_text(trl_copy, "deepseekv3_training", messages) == ["<｜Assistant｜>" + trained[0],
                                                                       "<｜tool▁outputs▁end｜>" + trained[1]]


def test_deepseek_v3_refuses_a_second_round_of_calls_its_template_writes_without_a_header():
    """The original template renders every call after the conversation's first without <｜Assistant｜>, its message's
    content or <｜tool▁calls▁begin｜> (its namespace flag is never reset): not text the model writes, so not trained."""
    messages = [{"role": "user", "content": "Weather?"}, _weather("Paris"), {"role": "tool", "name": "get_weather", "content": "21"},
                {"role": "assistant", "content": "Mild."}, {"role": "user", "content": "And Oslo?"},
                _weather("Oslo", content="Checking."), {"role": "tool", "name": "get_weather", "content": "9"}]
    with pytest.raises(ChatTemplateError, match=r"^deepseek_v3: cannot find the assistant turns in the rendered "
                                                r"conversation: assistant message 3 \(message 6\) is not rendered exactly once"):
        _trained_text(_DSV3_TEXT, "deepseek_v3", messages)


# Gemma 4: a model turn holds the model's calls, the <|tool_response> it stops at, the results (not trained), then its
# content, through <turn|>; the turn's earlier reasoning is dropped by the template (a user message follows).
_PARIS_OSLO = ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|><|tool_call>call:'
               'get_weather{city:<|"|>Oslo<|"|>,days:[1,2],options:{gust:null,note:<|"|>vent, ça souffle<|"|>,wind:true}}'
               '<tool_call|><|tool_response>')
_SEARCH = '<|tool_call>call:search{limit:3,query:<|"|>Oslo warnings<|"|>}<tool_call|><|tool_response>'
GEMMA4_CALLS = {
    "tool-calls": [_PARIS_OSLO, _SEARCH, "Let me check for warnings.Paris 21 °C, Oslo 9 °C; no warnings.<turn|>",
                   "You're welcome.<turn|>"],
    "tool-responses": ['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|><|tool_response>',
                       "21 °C and clear.<turn|>"],
    "pending-call": ['<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:[1,2],options:{gust:null,note:<|"|>vent, ça '
                     'souffle<|"|>,wind:true}}<tool_call|>Checking.<|tool_response>'],
}
GEMMA4_REASONED = [  # the last turn's reasoning is kept: thinking off, the larger models' prompt opened its channel
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "One call.", "tool_calls": [GEMMA4.CALL_PARIS]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "assistant", "reasoning_content": "Warm.", "content": "21 °C."}]


def gemma4(name, **switches) -> ChatTemplate:
    return ChatTemplate(GEMMA4.TEXT[name], name, GEMMA4.SPECIALS, GEMMA4.CONTROLS, switches)


@pytest.mark.parametrize("name", list(GEMMA4.SHA256))
def test_gemma4_trains_the_calls_and_the_stop_but_never_the_results(name):
    for switches in GEMMA4.SWITCHES:
        ours = gemma4(name, **switches)
        for conversation, expected in GEMMA4_CALLS.items():
            if switches.get("preserve_thinking") and conversation == "tool-calls":  # the calling turns keep their reasoning
                thinking = switches.get("enable_thinking", False)
                opened = name == "gemma4.jinja" and not thinking  # a fresh turn's prompt opened the channel
                expected = [("" if opened else "<|channel>thought\n") + "Two cities: two calls.\n<channel|>" + _PARIS_OSLO,
                            ("" if thinking else "<|channel>thought\n") + "Any warnings?\n<channel|>" + _SEARCH,
                            *expected[2:]]
            text, spans = ours.assistant_spans(GEMMA4.CONVERSATIONS[conversation], GEMMA4.TOOLS)
            assert text == GEMMA4.transformers_render(GEMMA4.TEXT[name], GEMMA4.CONVERSATIONS[conversation],
                                                      tools=GEMMA4.TOOLS, **switches)
            assert [text[s:e] for s, e in spans] == expected, (conversation, switches)
            assert not any("response:" in text[s:e] for s, e in spans)
    opened = "<|channel>thought\n" if name == "gemma4.jinja" else ""  # the part of the channel the prompt wrote
    text, spans = gemma4(name).assistant_spans(GEMMA4_REASONED, GEMMA4.TOOLS)
    assert [text[s:e] for s, e in spans] == [
        ("" if opened else "<|channel>thought\n") + 'One call.\n<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,'
        'unit:<|"|>celsius<|"|>}<tool_call|><|tool_response>', "<|channel>thought\nWarm.\n<channel|>21 °C.<turn|>"]
    thinking = gemma4(name, enable_thinking=True)  # after the results, a thinking prompt opens the channel itself
    text, spans = thinking.assistant_spans(GEMMA4_REASONED, GEMMA4.TOOLS)
    assert [text[s:e] for s, e in spans][1] == "Warm.\n<channel|>21 °C.<turn|>"


@pytest.mark.parametrize("name", list(GEMMA4.SHA256))
def test_gemma4_marked_copy_masks_what_the_derivation_finds(name):
    """On the conversations the derivation marks (tests/test_chat_template_gemma4.py's MASKED) and every switch."""
    for switches in GEMMA4.SWITCHES:
        ours = gemma4(name, **switches)
        assert ours._marked is not None
        for conversation in GEMMA4.MASKED:
            for tools in (None, GEMMA4.TOOLS):
                messages = GEMMA4.CONVERSATIONS[conversation]
                assert ours.assistant_spans(messages, tools) == ours._derive_spans(messages, tools), (conversation, switches)


def test_the_chat_dataset_trains_gemma4_agent_traces_as_transformers_tokenizes_them(tmp_path, tmp_path_factory):
    from transformers import AutoTokenizer

    checkpoint = GEMMA4.write_checkpoint(tmp_path_factory.mktemp("gemma4-agent"), GEMMA4.LARGE)
    records = [{"tools": GEMMA4.TOOLS, "messages": GEMMA4.CONVERSATIONS[c]} for c in GEMMA4_CALLS]
    source = tmp_path / "agent.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    theirs = AutoTokenizer.from_pretrained(checkpoint)
    dataset = ChatDataset(source, load_tokenizer(checkpoint), max_seq_len=4096)
    for n, (conversation, expected) in enumerate(GEMMA4_CALLS.items()):
        messages = GEMMA4.CONVERSATIONS[conversation]
        assert dataset[n]["tokens"] == theirs.apply_chat_template(messages, tools=GEMMA4.TOOLS, tokenize=True,
                                                                  return_dict=True)["input_ids"]
        trained = theirs.decode([t for t in dataset[n]["labels"] if t != -100], skip_special_tokens=False)
        assert trained == "".join(expected), conversation


def test_gpt_oss_trains_its_calls_with_their_analysis_unless_a_later_final_message_drops_it():
    """Harmony: a call's analysis is written only while no final message follows it; the arguments and <|call|> are
    trained either way, the header and analysis only where the model wrote them as shown; the result never."""
    from tests.test_chat_template_harmony import CONTROLS as HARMONY_CONTROLS
    from tests.test_chat_template_harmony import CONVERSATIONS as HARMONY_CONVERSATIONS
    from tests.test_chat_template_harmony import HARMONY, SPECIALS as HARMONY_SPECIALS
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = ChatTemplate(HARMONY, "gpt_oss.jinja", HARMONY_SPECIALS, HARMONY_CONTROLS)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    trace = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "thinking": "Need the tool.", "tool_calls": [call]},
             {"role": "tool", "content": "9 °C"},
             {"role": "assistant", "reasoning_content": "Answer.", "content": "It is 9 °C."}]
    header = "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    final = "<|channel|>analysis<|message|>Answer.<|end|><|start|>assistant<|channel|>final<|message|>It is 9 °C.<|return|>"
    for messages, expected in ((trace[:3], [header + '{"city": "Oslo"}<|call|>']),
                               (trace, ['{"city": "Oslo"}<|call|>', final])):
        text, spans = ours.assistant_spans(messages, TOOLS)
        assert text == render_jinja_template([messages], tools=TOOLS, chat_template=HARMONY, **HARMONY_SPECIALS)[0][0]
        assert [text[s:e] for s, e in spans] == expected
        assert "9 °C" not in "".join(text[s:e] for s, e in spans[:1])
    for conversation, messages in HARMONY_CONVERSATIONS.items():  # no tool calls: as the derivation finds
        assert ours.assistant_spans(messages) == ours._derive_spans(messages), conversation
