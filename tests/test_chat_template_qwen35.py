"""Qwen3.5 / Qwen3.6 / Qwen3-Next chat templates as the Hub repos ship them: rendered as transformers renders
them, and trained where the model writes.

Templates: assets/chat_templates/, verbatim (their README names where each copy came from):

* ``qwen3_5.jinja``: Qwen/Qwen3.5-4B and larger (27B, 35B-A3B, 397B-A17B); huggingface/trl
  ``trl/chat_templates/qwen3_5_think.jinja``, identical to xorbitsai/inference ``xinference/model/llm/llm_family.json``
  entry ``qwen3.5`` (Qwen/Qwen3.5-397B-A17B).
* ``qwen3_5_small.jinja``: Qwen/Qwen3.5-0.8B and -2B (thinking off by default); huggingface/trl
  ``trl/chat_templates/qwen3_5_nothink.jinja``.
* ``qwen3_6.jinja``: Qwen/Qwen3.6-27B and -35B-A3B (``preserve_thinking``); huggingface/trl
  ``trl/chat_templates/qwen3_6.jinja``, identical to the xinference entry ``qwen3.6``.
* ``qwen3_next_instruct.jinja`` / ``qwen3_next_thinking.jinja``: Qwen/Qwen3-Next-80B-A3B-Instruct / -Thinking;
  xinference entries ``Qwen3-Next-Instruct`` / ``Qwen3-Next-Thinking``.

Rendering is compared with transformers' own (``render_jinja_template``, which ``apply_chat_template`` calls) on
conversations with a system message, multi-turn reasoning (``reasoning_content`` and ``<think>`` in the content),
tool calls (arguments as a dict, OpenAI-nested and flat), tool responses, ``tools=[...]``, multimodal content,
``add_generation_prompt`` and the templates' switches (``enable_thinking``, ``preserve_thinking``).

What is trained (assistant spans): everything the model writes after the generation prompt, to its ``<|im_end|>``.
With thinking off, or on turns the template writes without their reasoning (those before the last user query),
that is the content plus ``<|im_end|>``; on a turn rendered with a ``<think>`` block after a prompt that opened it
(``<|im_start|>assistant\\n<think>\\n``), the reasoning, ``</think>`` and the content, plus ``<|im_end|>``. The
oracle for the masks is transformers' ``{% generation %}`` masks of a copy of the template marked that way.
"""

from __future__ import annotations

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
SHA256 = {  # the stored texts, so an edit to one shows
    "qwen3_5.jinja": "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
    "qwen3_5_small.jinja": "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80",
    "qwen3_6.jinja": "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259",
    "qwen3_next_instruct.jinja": "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326",
    "qwen3_next_thinking.jinja": "3802169b2a02b81e6adb7ab4f64f91ff02db753c8c3a64a01c35192d3a61d8d7",
}
TEXT = {name: (DATA / name).read_text(encoding="utf-8") for name in SHA256}
QWEN35 = TEXT["qwen3_5.jinja"]

# Qwen's named special tokens (tokenizer_config.json: no BOS) and its added tokens that chat text uses.
SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
CONTROLS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>", "<think>", "</think>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city, in °C or °F.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                          "days": {"type": "array", "items": {"type": "integer"}}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                                                      "limit": {"type": "integer"}}}}},
]
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS = {
    "plain": [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
    "think-in-content": [
        SYSTEM, {"role": "user", "content": "Is 9 prime?"},
        {"role": "assistant", "content": "<think>\n3 x 3 = 9.\n</think>\n\nNo."},
        {"role": "user", "content": "And 11?"},
        {"role": "assistant", "content": "<think>\nNo divisors but 1 and 11.\n</think>\n\nYes, 11 is prime."}],
    "reasoning-content": [
        {"role": "user", "content": "Pick a colour."},
        {"role": "assistant", "reasoning_content": "Blue is calm.", "content": "Blue."},
        {"role": "user", "content": "Another, in French? {{ not jinja }} 🙂"},
        {"role": "assistant", "reasoning_content": "  Red; rouge.\n", "content": "  Rouge — c'est tout !  "}],
    "tool-calls": [
        SYSTEM, {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "reasoning_content": "Two cities: two calls.", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {
                "city": "Oslo", "days": [1, 2], "options": {"wind": True, "note": "vent, ça souffle"}}}}]},
        {"role": "tool", "content": '{"temp": 21}'}, {"role": "tool", "content": '{"temp": 9}'},
        {"role": "assistant", "content": "Let me check for warnings.",
         "tool_calls": [{"name": "search", "arguments": {"query": "Oslo weather warnings", "limit": 3}}]},  # flat form
        {"role": "tool", "content": "No warnings."},
        {"role": "assistant", "content": "Paris 21 °C, Oslo 9 °C; no warnings."}],
    "multimodal": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
                   {"role": "assistant", "content": "A cat."}],
}
SWITCHES = [{}, {"enable_thinking": True}, {"enable_thinking": False}, {"preserve_thinking": True}]


def transformers_render(text, messages, add_generation_prompt=False, tools=None, **kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=text,
                                        add_generation_prompt=add_generation_prompt, **SPECIALS, **kwargs)
    return rendered[0]


def chat(name, **template_kwargs) -> ChatTemplate:
    return ChatTemplate(TEXT[name], name, SPECIALS, CONTROLS, template_kwargs)


def test_stored_templates_are_the_published_text():
    for name, digest in SHA256.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name
    for name in ("qwen3_5.jinja", "qwen3_5_small.jinja", "qwen3_6.jinja"):
        assert "<tool_call>\\n<function=" in TEXT[name] and "render_content" in TEXT[name]  # Qwen3-Coder style calls
    for name in ("qwen3_next_instruct.jinja", "qwen3_next_thinking.jinja"):
        assert '<tool_call>\\n{"name": "' in TEXT[name]  # Hermes-style JSON calls


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
            assert text.endswith("<|im_end|>\n")
            for end in range(1, len(messages)):  # the prompt for every assistant turn
                if messages[end]["role"] == "assistant":
                    prompt = ours.render(messages[:end], add_generation_prompt=True, tools=tools)
                    assert prompt == transformers_render(TEXT[name], messages[:end], True, tools, **switches), (switches, end)


def test_tokenizer_apply_chat_template_agrees(checkpoint):
    from transformers import AutoTokenizer

    theirs, ours = AutoTokenizer.from_pretrained(checkpoint), load_chat_template(load_tokenizer(checkpoint))
    messages = CONVERSATIONS["tool-calls"]
    assert ours.render(messages, tools=TOOLS) == theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert ours.render(messages[:2], True, TOOLS) == theirs.apply_chat_template(messages[:2], tools=TOOLS, tokenize=False,
                                                                                add_generation_prompt=True)


def test_what_the_templates_write():
    messages = CONVERSATIONS["tool-calls"]
    text = chat("qwen3_5.jinja").render(messages, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a '
                           'city, in °C or °F."')  # tojson: no HTML or ASCII escaping
    assert "</IMPORTANT>\n\nYou are a terse assistant.<|im_end|>\n" in text
    assert ("<|im_start|>assistant\n<think>\nTwo cities: two calls.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n[1, 2]\n"
            '</parameter>\n<parameter=options>\n{"wind": true, "note": "vent, ça souffle"}\n</parameter>\n</function>\n'
            "</tool_call><|im_end|>\n") in text
    assert ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n{"temp": 9}\n'
            "</tool_response><|im_end|>\n") in text
    assert ("Let me check for warnings.\n\n<tool_call>\n<function=search>\n<parameter=query>\nOslo weather warnings\n"
            "</parameter>\n<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>") in text
    nxt = chat("qwen3_next_instruct.jinja").render(messages, tools=TOOLS)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2], "options": '
            '{"wind": true, "note": "vent, ça souffle"}}}\n</tool_call>') in nxt
    assert "Two cities" not in nxt and "<think>" not in nxt  # the instruct template has no reasoning
    # The generation prompt: thinking on by default (4B and larger, 3.6, Next-Thinking), off for 0.8B/2B.
    prompt = CONVERSATIONS["plain"][:2]
    expected = {"qwen3_5.jinja": ("<think>\n", "<think>\n\n</think>\n\n", "<think>\n"),
                "qwen3_6.jinja": ("<think>\n", "<think>\n\n</think>\n\n", "<think>\n"),
                "qwen3_5_small.jinja": ("<think>\n\n</think>\n\n", "<think>\n\n</think>\n\n", "<think>\n"),
                "qwen3_next_instruct.jinja": ("", "", ""),
                "qwen3_next_thinking.jinja": ("<think>\n", "<think>\n", "<think>\n")}
    for name, (default, off, on) in expected.items():
        for switches, tail in (({}, default), ({"enable_thinking": False}, off), ({"enable_thinking": True}, on)):
            assert chat(name, **switches).render(prompt, True).endswith("<|im_start|>assistant\n" + tail), (name, switches)
    # Reasoning is kept on turns after the last user query only, unless Qwen3.6 is told to preserve it.
    history = CONVERSATIONS["reasoning-content"]
    assert "Blue is calm." not in chat("qwen3_5.jinja").render(history)
    assert "<think>\nBlue is calm.\n</think>\n\nBlue." in chat("qwen3_6.jinja", preserve_thinking=True).render(history)
    assert "<think>\nRed; rouge.\n</think>\n\nRouge — c'est tout !<|im_end|>" in chat("qwen3_5.jinja").render(history)
    image = chat("qwen3_5.jinja").render(CONVERSATIONS["multimodal"])
    assert image.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in this picture?")


@pytest.mark.parametrize("messages, match", [
    ([SYSTEM], "No user query found in messages."),
    ([{"role": "user", "content": "hi"}, SYSTEM], "System message must be at the beginning."),
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}], "Unexpected message role."),
    ([{"role": "user", "content": 3}], "Unexpected content type."),
])
def test_template_errors_are_one_line(messages, match):
    with pytest.raises(ChatTemplateError, match=r"qwen3_5\.jinja: chat template failed \(line \d+\): TemplateError: "
                                                + match.replace(".", r"\.")) as info:
        chat("qwen3_5.jinja").render(messages)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("attack", [
    "{{ messages[0].content.__class__.__mro__ }}",
    "{% for m in messages %}{{ loop.__class__.__init__.__globals__ }}{% endfor %}",
    "{{ ns.__class__.__init__.__globals__['os'] }}",
    "{{ (tools[0] | items | list).__class__.__base__.__subclasses__() }}",
    "{{ render_content._func.__globals__['os'].system('id') }}",
    "{{ raise_exception.__globals__.os }}",
    "{{ messages[0].content.split.__self__.__class__.__mro__ }}",
    "{{ (messages[0].content | trim).__class__.__base__.__subclasses__() }}",
])
def test_the_sandbox_still_refuses_what_the_template_does_not_need(attack):
    """The constructs Qwen3.5's template uses (macros, namespace, loop, str methods, |items) reach nothing more."""
    evil = ChatTemplate(QWEN35 + "\n" + attack, "evil.jinja", SPECIALS, CONTROLS)
    with pytest.raises(ChatTemplateError, match=r"evil\.jinja: chat template refused \(line \d+\): SecurityError") as info:
        evil.render(CONVERSATIONS["plain"], tools=TOOLS)
    assert "\n" not in str(info.value)


def test_a_lone_unsafe_attribute_renders_nothing():
    """jinja's sandbox answers an unsafe attribute with an undefined value: printed, it is empty, not the object."""
    plain = chat("qwen3_5.jinja").render(CONVERSATIONS["plain"])
    for attack in ("{{ ns.__class__ }}", "{{ messages.__class__ }}", "{{ render_content.__globals__ }}",
                   "{{ ns | attr('__class__') }}", "{{ raise_exception.__globals__ }}"):
        assert ChatTemplate(QWEN35 + "\n" + attack, "evil.jinja", SPECIALS, CONTROLS).render(CONVERSATIONS["plain"]) == plain


def test_steps_stay_far_under_the_limit():
    ours = chat("qwen3_5.jinja")
    messages = [SYSTEM]
    for n in range(100):
        messages += [{"role": "user", "content": f"Question {n}"},
                     {"role": "assistant", "reasoning_content": "t", "content": f"{n}"}]
    assert ours.render(messages, tools=TOOLS) == transformers_render(QWEN35, messages, tools=TOOLS)
    steps = ours._env.steps_used
    assert 0 < steps <= 4 * len(messages) and STEP_LIMIT / steps > 300, steps


# Assistant spans: where the model writes -------------------------------------------------------------------

# Per template and switches: what is trained on, per assistant turn.
_REASONED = ["Blue.<|im_end|>", "Red; rouge.\n</think>\n\nRouge — c'est tout !<|im_end|>"]
TRAINED_THINKING = {  # a prompt that opens <think>: the last turn's (empty) reasoning and </think> are trained
    "plain": ["\n</think>\n\n5<|im_end|>"],
    "think-in-content": ["No.<|im_end|>", "No divisors but 1 and 11.\n</think>\n\nYes, 11 is prime.<|im_end|>"],
    "reasoning-content": _REASONED,
}
TRAINED_NOT_THINKING = {  # a prompt that closes it: the content (a last turn's reasoning, if any, after <think>)
    "plain": ["5<|im_end|>"],
    "think-in-content": ["No.<|im_end|>", "No divisors but 1 and 11.\n</think>\n\nYes, 11 is prime.<|im_end|>"],
    "reasoning-content": _REASONED,
}
TRAINED = {
    ("qwen3_5.jinja", ()): TRAINED_THINKING,
    ("qwen3_6.jinja", ()): TRAINED_THINKING,
    ("qwen3_5.jinja", (("enable_thinking", False),)): TRAINED_NOT_THINKING,
    ("qwen3_6.jinja", (("enable_thinking", False),)): TRAINED_NOT_THINKING,
    ("qwen3_5_small.jinja", ()): TRAINED_NOT_THINKING,
    ("qwen3_6.jinja", (("preserve_thinking", True),)): {  # earlier turns keep their reasoning: all trained
        "plain": ["\n</think>\n\n5<|im_end|>"],
        "think-in-content": ["3 x 3 = 9.\n</think>\n\nNo.<|im_end|>",
                             "No divisors but 1 and 11.\n</think>\n\nYes, 11 is prime.<|im_end|>"],
        "reasoning-content": ["Blue is calm.\n</think>\n\nBlue.<|im_end|>", _REASONED[1]]},
    ("qwen3_next_thinking.jinja", ()): {  # content and reasoning not trimmed, only stripped of newlines
        **TRAINED_THINKING,
        "reasoning-content": ["Blue.<|im_end|>", "  Red; rouge.\n</think>\n\n  Rouge — c'est tout !  <|im_end|>"]},
    ("qwen3_next_instruct.jinja", ()): {  # no reasoning handling: the content as written
        "plain": ["5<|im_end|>"],
        "think-in-content": ["<think>\n3 x 3 = 9.\n</think>\n\nNo.<|im_end|>",
                             "<think>\nNo divisors but 1 and 11.\n</think>\n\nYes, 11 is prime.<|im_end|>"],
        "reasoning-content": ["Blue.<|im_end|>", "  Rouge — c'est tout !  <|im_end|>"]},
}


@pytest.mark.parametrize("name, switches", TRAINED, ids=[n + "".join(f"-{k}={v}" for k, v in s) for n, s in TRAINED])
def test_assistant_spans(name, switches):
    ours = chat(name, **dict(switches))
    for conversation, expected in TRAINED[name, switches].items():
        text, spans = ours.assistant_spans(CONVERSATIONS[conversation])
        assert text == ours.render(CONVERSATIONS[conversation])
        assert [text[s:e] for s, e in spans] == expected, conversation


def marked(name: str) -> str:
    """A Qwen3.5-family template with {% generation %} around what the model writes after the generation prompt
    (the module doc): the oracle for the masks."""
    text = TEXT[name]
    lines = text.split("\n")
    k = next(n for n, line in enumerate(lines)
             if line.endswith("'\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}"))
    condition = lines[k - 1].strip().removeprefix("{%- if ").removesuffix(" %}")
    assert lines[k + 1: k + 4] == ["        {%- else %}", "            {{- '<|im_start|>' + message.role + '\\n' + content }}",
                                   "        {%- endif %}"]
    prompt_opens_think = {"qwen3_5_small.jinja": "enable_thinking is defined and enable_thinking is true"}.get(
        name, "not (enable_thinking is defined and enable_thinking is false)")
    block = [
        f"        {{%- set think_here = {condition} %}}",
        "        {%- if think_here %}",
        "            {{- '<|im_start|>' + message.role + '\\n<think>\\n' }}",
        f"            {{%- if not reasoning_content and not ({prompt_opens_think}) %}}",
        "                {{- '\\n</think>\\n\\n' }}",
        "            {%- endif %}",
        "        {%- else %}",
        "            {{- '<|im_start|>' + message.role + '\\n' }}",
        "        {%- endif %}",
        "        {%- generation %}",
        f"        {{%- if think_here and (reasoning_content or ({prompt_opens_think})) %}}",
        "            {{- reasoning_content + '\\n</think>\\n\\n' }}",
        "        {%- endif %}",
        "        {{- content }}",
    ]
    end = lines.index("        {{- '<|im_end|>\\n' }}", k)
    assert lines[end + 1] == '    {%- elif message.role == "tool" %}'
    lines = lines[:k - 1] + block + lines[k + 4:end] + ["        {{- '<|im_end|>' }}", "        {%- endgeneration %}",
                                                       "        {{- '\\n' }}"] + lines[end + 1:]
    return "\n".join(lines)


def write_checkpoint(directory: Path, template: str) -> Path:
    """A small byte-level BPE tokenizer with Qwen's control tokens, and the template as chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = [json.dumps(c) for c in CONVERSATIONS.values()] + [json.dumps(TOOLS), QWEN35] * 2
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=CONTROLS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "model_max_length": 4096, **SPECIALS}))
    (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3.5"), QWEN35)


@pytest.mark.parametrize("name, switches", [("qwen3_5.jinja", {}), ("qwen3_5.jinja", {"enable_thinking": False}),
                                            ("qwen3_5_small.jinja", {}), ("qwen3_6.jinja", {"preserve_thinking": True})])
def test_ids_and_masks_equal_transformers(tmp_path, checkpoint, name, switches):
    from transformers import AutoTokenizer

    directory = checkpoint if name == "qwen3_5.jinja" else write_checkpoint(tmp_path / name, TEXT[name])
    theirs, tokenizer = AutoTokenizer.from_pretrained(directory), load_tokenizer(directory)
    ours, oracle_template = load_chat_template(tokenizer, template_kwargs=switches), marked(name)
    for conversation in ("plain", "think-in-content", "reasoning-content"):
        messages = CONVERSATIONS[conversation]
        expected = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, **switches)["input_ids"]
        oracle = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                            chat_template=oracle_template, **switches)
        assert oracle["input_ids"] == expected  # the marked copy renders the same text
        ids, mask = ours.encode(messages, tokenizer)
        assert ids == expected, conversation
        assert mask == oracle["assistant_masks"], (conversation, theirs.decode([i for i, m in zip(ids, mask) if m]))


def test_chat_dataset_trains_on_the_assistant_turns(tmp_path, checkpoint):
    """Through the data path: the labels are the assistant turns as the model writes them, <|im_end|> included,
    nothing of the system, user or header text."""
    from transformers import AutoTokenizer

    records = [{"messages": CONVERSATIONS["plain"]}, {"messages": CONVERSATIONS["think-in-content"]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    theirs = AutoTokenizer.from_pretrained(checkpoint)
    for name, expected in (("qwen3_5.jinja", TRAINED_THINKING), ("qwen3_5_small.jinja", TRAINED_NOT_THINKING)):
        directory = checkpoint if name == "qwen3_5.jinja" else write_checkpoint(tmp_path / name, TEXT[name])
        dataset = ChatDataset(tmp_path / "d.jsonl", load_tokenizer(directory), max_seq_len=4096)
        for n, conversation in enumerate(("plain", "think-in-content")):
            item = dataset[n]
            messages = CONVERSATIONS[conversation]
            assert item["tokens"] == theirs.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                                chat_template=TEXT[name])["input_ids"]
            oracle = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, chat_template=marked(name),
                                                return_assistant_tokens_mask=True)["assistant_masks"]
            assert [t != -100 for t in item["labels"]] == [bool(m) for m in oracle], (name, conversation)
            assert theirs.decode([t for t in item["labels"] if t != -100]) == "".join(expected[conversation])
            im_end = theirs.convert_tokens_to_ids("<|im_end|>")
            assert [t for t in item["labels"] if t == im_end] == [im_end] * (len(messages) // 2)
