"""gpt-oss's harmony chat template: rendered as transformers renders it, trained where the model writes.

Template: assets/chat_templates/gpt_oss.jinja, verbatim chat_template.jinja of huggingface.co/openai/gpt-oss-20b at commit cbf31f62664d4b1360b3a78427f7b3c3ed8f0fa8 (read from its GitHub mirror EchoCog/gpt-oss-20b, path chat_template.jinja).

Harmony ends the last assistant turn with ``<|return|>`` (where generation stops) and earlier ones with ``<|end|>``
(after which the model would go on), and drops earlier turns' analysis: an earlier turn is trained on its content,
with its ``<|channel|>final<|message|>`` header only when no analysis was dropped before it, never on its ``<|end|>``;
the last turn on everything the model writes after the generation prompt ``<|start|>assistant``, analysis included,
up to and including ``<|return|>``. The oracle for the masks is transformers' ``{% generation %}`` masks of a copy
of the template marked that way (``HARMONY_MARKED``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import ROOT
from waypoint.text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from waypoint.text.stop_tokens import end_of_turn
from waypoint.text.template_sandbox import STEP_LIMIT
from waypoint.text.tokenizer import load_tokenizer

HARMONY = (ROOT / "assets" / "chat_templates" / "gpt_oss.jinja").read_text(encoding="utf-8")

# The last turn: {% generation %} from the generation prompt's end through <|return|>, the analysis included.
_LAST = """            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {#- <|return|> indicates the end of generation, but <|end|> does not #}
            {#- <|return|> should never be an input to the model, but we include it as the final token #}
            {#- when training, so the model learns to emit it. #}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}"""
_LAST_MARKED = """            {{- "<|start|>assistant" }}
            {%- generation %}
            {%- if "thinking" in message %}
                {{- "<|channel|>analysis<|message|>" + message.thinking + "<|end|><|start|>assistant" }}
            {%- endif %}
            {{- "<|channel|>final<|message|>" + message.content + "<|return|>" }}
            {%- endgeneration %}"""
# Earlier turns: the content, after the header when no analysis was dropped before it; not their <|end|>.
_EARLIER = """            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}"""
_EARLIER_MARKED = """            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>final<|message|>" }}
                {%- generation %}{{- message.content }}{%- endgeneration %}
            {%- else %}
                {{- "<|start|>assistant" }}
                {%- generation %}{{- "<|channel|>final<|message|>" + message.content }}{%- endgeneration %}
            {%- endif %}
            {{- "<|end|>" }}"""
assert HARMONY.count(_LAST) == 1 and HARMONY.count(_EARLIER) == 1
HARMONY_MARKED = HARMONY.replace(_LAST, _LAST_MARKED).replace(_EARLIER, _EARLIER_MARKED)

# gpt-oss's named special tokens and its added tokens other than the reserved ones (tokenizer_config.json).
SPECIALS = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}
CONTROLS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
            "<|message|>", "<|call|>", "<|endofprompt|>"]
DATE = datetime(2025, 8, 5, 9, 30)

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "What is 2 + 3?"}
CONVERSATIONS = {
    "system": [SYSTEM, USER, {"role": "assistant", "content": "5"}],
    "developer": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Rouge — c'est tout !"}],
    "thinking": [USER, {"role": "assistant", "thinking": "Two plus three is five.", "content": "5"}],
    "multi-turn": [SYSTEM, USER, {"role": "assistant", "thinking": "2 + 3 = 5.", "content": "5"},
                   {"role": "user", "content": "And times 4?"}, {"role": "assistant", "content": "20\n- that is 5 x 4"},
                   {"role": "user", "content": "Emoji? 🙂 {{ not jinja }}"},
                   {"role": "assistant", "thinking": "A smile.\nKeep it short.", "content": "  🙂 {ok}  "}],
}
# What the model is trained on, per assistant turn (the module doc).
TRAINED = {
    "system": ["<|channel|>final<|message|>5<|return|>"],
    "developer": ["<|channel|>final<|message|>Rouge — c'est tout !<|return|>"],
    "thinking": ["<|channel|>analysis<|message|>Two plus three is five.<|end|><|start|>assistant"
                 "<|channel|>final<|message|>5<|return|>"],
    "multi-turn": ["5", "<|channel|>final<|message|>20\n- that is 5 x 4",
                   "<|channel|>analysis<|message|>A smile.\nKeep it short.<|end|><|start|>assistant"
                   "<|channel|>final<|message|>  🙂 {ok}  <|return|>"],
}


class FrozenDate(datetime):
    @classmethod
    def now(cls, tz=None):
        return DATE


@pytest.fixture(autouse=True)
def frozen_date(monkeypatch):
    """``strftime_now`` reads the same date in our sandbox and in transformers'."""
    import transformers.utils.chat_template_utils as theirs

    import waypoint.text.template_sandbox as ours

    monkeypatch.setattr(theirs, "datetime", FrozenDate)
    monkeypatch.setattr(ours, "datetime", FrozenDate)


def transformers_render(messages, template=HARMONY, add_generation_prompt=False, **kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=add_generation_prompt,
                                        **SPECIALS, **kwargs)
    return rendered[0]


def harmony(**template_kwargs) -> ChatTemplate:
    return ChatTemplate(HARMONY, "gpt-oss", SPECIALS, CONTROLS, template_kwargs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer with gpt-oss's control tokens and the template as chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory = tmp_path_factory.mktemp("gpt-oss")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = [m.get("content", "") + m.get("thinking", "") for c in CONVERSATIONS.values() for m in c]
    corpus += ["You are ChatGPT, a large language model trained by OpenAI. Knowledge cutoff Current date Reasoning "
               "medium high Valid channels: analysis, commentary, final. Channel must be included for every message. "
               "system developer user assistant Instructions"] * 3
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=CONTROLS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "model_max_length": 4096, **SPECIALS}))
    (directory / "chat_template.jinja").write_text(HARMONY, encoding="utf-8")
    return directory


# Rendering: text identical to transformers' -----------------------------------------------------------------

@pytest.mark.parametrize("name", CONVERSATIONS)
def test_renders_as_transformers(name):
    chat, messages = harmony(), CONVERSATIONS[name]
    text = chat.render(messages)
    assert text == transformers_render(messages)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                           "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: medium\n\n# Valid channels:")
    assert text.endswith("<|return|>")
    for end in range(1, len(messages)):  # every prompt for a next turn
        if messages[end]["role"] == "assistant":
            prompt = chat.render(messages[:end], add_generation_prompt=True)
            assert prompt == transformers_render(messages[:end], add_generation_prompt=True)
            assert prompt.endswith("<|end|><|start|>assistant")
            assert text.startswith(prompt)


def test_developer_message_and_dropped_analysis():
    text = harmony().render(CONVERSATIONS["developer"])
    assert "<|start|>developer<|message|># Instructions\n\nAnswer in French.\n\n<|end|>" in text
    multi = harmony().render(CONVERSATIONS["multi-turn"])
    assert "2 + 3 = 5." not in multi and "A smile." in multi  # only the last turn keeps its analysis
    assert multi.count("<|return|>") == 1 and multi.endswith("<|return|>")


def test_template_kwargs_pass_through(checkpoint):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(checkpoint)
    messages = CONVERSATIONS["multi-turn"]
    kwargs = {"reasoning_effort": "high", "model_identity": "You are Waypoint.", "builtin_tools": ["browser", "python"]}
    chat = load_chat_template(load_tokenizer(checkpoint), template_kwargs=kwargs)
    assert chat.source.endswith("chat_template.jinja")
    text = chat.render(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs) == transformers_render(messages, **kwargs)
    assert "You are Waypoint.\n" in text and "Reasoning: high\n" in text and "## browser" in text and "## python" in text
    plain = load_chat_template(load_tokenizer(checkpoint), template_kwargs={"reasoning_effort": "low"})
    assert "Reasoning: low\n" in plain.render(messages) and "# Tools" not in plain.render(messages)


# Assistant spans: where the model writes -------------------------------------------------------------------

@pytest.mark.parametrize("name", CONVERSATIONS)
def test_assistant_spans(name):
    chat, messages = harmony(), CONVERSATIONS[name]
    text, spans = chat.assistant_spans(messages)
    assert text == chat.render(messages)
    assert [text[s:e] for s, e in spans] == TRAINED[name]
    marked = ChatTemplate(HARMONY_MARKED, "marked", SPECIALS, CONTROLS)
    assert marked.assistant_spans(messages) == (text, spans)  # the {% generation %} copy marks the same characters
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template([messages], chat_template=HARMONY_MARKED, return_assistant_tokens_mask=True,
                                              **SPECIALS)
    assert (rendered[0], indices[0]) == (text, spans)


def test_ids_and_masks_equal_transformers(checkpoint):
    from transformers import AutoTokenizer

    theirs, ours = AutoTokenizer.from_pretrained(checkpoint), load_tokenizer(checkpoint)
    chat = load_chat_template(ours)
    assert end_of_turn(chat, ours) == "<|return|>"  # where generation stops is the end of turn trained on
    for name, messages in CONVERSATIONS.items():
        expected = theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        oracle = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                            chat_template=HARMONY_MARKED)
        assert oracle["input_ids"] == expected
        ids, mask = chat.encode(messages, ours)
        assert ids == expected, name
        assert mask == oracle["assistant_masks"], name
        trained = [i for i, m in zip(ids, mask) if m]
        assert trained.count(ours.encode("<|return|>", add_bos=False)[0]) == 1, name
        assert theirs.decode(trained).endswith(messages[-1]["content"] + "<|return|>"), name


@pytest.mark.parametrize("message, match", [
    ({"role": "assistant", "content": "<|channel|>final<|message|>5"}, r"passed a message containing <\|channel\|> tags in the content"),
    ({"role": "tool", "content": "5"}, r"tool role, but there was no previous assistant message with a tool call"),
])
def test_template_errors_are_one_line(message, match):
    with pytest.raises(ChatTemplateError, match=r"gpt-oss: chat template failed \(line \d+\): TemplateError: .*" + match) as info:
        harmony().assistant_spans([USER, message])
    assert "\n" not in str(info.value)


# Limits ----------------------------------------------------------------------------------------------------

def test_steps_stay_far_under_the_limit():
    chat = harmony()
    messages = [SYSTEM]
    for n in range(100):
        messages += [{"role": "user", "content": f"Question {n}"}, {"role": "assistant", "thinking": "t", "content": f"{n}"}]
    assert chat.render(messages) == transformers_render(messages)
    steps = chat._env.steps_used
    assert 0 < steps <= 3 * len(messages) and STEP_LIMIT / steps > 1000, steps
