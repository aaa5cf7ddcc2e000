"""Chat data: templates rendered and tokenized exactly as transformers' apply_chat_template does, assistant masks
derived from rendering (checked against transformers' {% generation %} masks), records, and a tiny training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT
from waypoint.data.chat_dataset import ChatDataset
from waypoint.text.chat_template import BUILTIN_TEMPLATES, ChatTemplate, load_chat_template
from waypoint.data.records import read_records
from waypoint.text.tokenizer import load_tokenizer

# The families' templates, shaped as the real ones (tools branches left out), each with a copy that marks the
# assistant's text plus its end-of-turn token with {% generation %} for transformers' mask (the oracle).

LLAMA3 = BUILTIN_TEMPLATES["llama3"]
LLAMA3_MARKED = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set header = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' %}"
    "{% if loop.index0 == 0 %}{% set header = bos_token + header %}{% endif %}{{ header }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA31_MARKED = LLAMA31.replace(
    """    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}""",
    """    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}""")

QWEN25 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN25_MARKED = QWEN25.replace(
    """        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif""",
    """        {%- if message.role == "assistant" %}
            {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
        {%- endif %}
    {%- elif""")

QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
QWEN3_MARKED = QWEN3.replace("""        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}""", """        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- content }}
            {%- endif %}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}""")
assert QWEN3_MARKED != QWEN3

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
GEMMA_MARKED = GEMMA.replace(
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}",
    "{% if role == 'model' %}{{ '<start_of_turn>model\\n' }}{% generation %}{{ message['content'] | trim + '<end_of_turn>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endif %}")

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
GEMMA3_MARKED = GEMMA3.replace(
    """    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}""",
    """    {%- if role == 'model' -%}
        {%- generation -%}{{ message['content'] | trim }}{{ '<end_of_turn>' }}{%- endgeneration -%}{{ '\\n' }}
    {%- else -%}
        {{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}
    {%- endif -%}""")

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""
MISTRAL_MARKED = MISTRAL.replace("{{- ' ' + message['content'] + eos_token}}",
                                 "{% generation %}{{- ' ' + message['content'] + eos_token}}{% endgeneration %}")

# Mistral v0.3: the system message goes into the LAST user message, so with an assistant message last it is left out,
# and the prompt for an earlier turn is not a prefix of the conversation (the turn then starts at its content).
MISTRAL_V03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""
MISTRAL_V03_MARKED = MISTRAL_V03.replace("""{{- " " + message["content"]|trim + eos_token}}""",
                                         """{% generation %}{{- " " + message["content"]|trim + eos_token}}{% endgeneration %}""")

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI3_MARKED = PHI3.replace("{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}",
                           "{{'<|assistant|>\\n'}}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\\n' }}")

CHATML = BUILTIN_TEMPLATES["chatml"]
CHATML_MARKED = CHATML.replace(
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}")

# family: (template, marked template, special tokens, bos, eos, system role supported)
FAMILIES = {
    "llama3": (LLAMA3, LLAMA3_MARKED, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                       "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", True),
    "llama3.1": (LLAMA31, LLAMA31_MARKED, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                           "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", True),
    "qwen2.5": (QWEN25, QWEN25_MARKED, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", True),
    "qwen3": (QWEN3, QWEN3_MARKED, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>", True),
    "gemma": (GEMMA, GEMMA_MARKED, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", False),
    "gemma3": (GEMMA3, GEMMA3_MARKED, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", True),
    "mistral": (MISTRAL, MISTRAL_MARKED, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", True),
    "mistral-v0.3": (MISTRAL_V03, MISTRAL_V03_MARKED, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", True),
    "phi3": (PHI3, PHI3_MARKED, ["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
             "<s>", "<|endoftext|>", True),
    "chatml": (CHATML, CHATML_MARKED, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>", True),
}

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sky."},
     {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Green."},
     {"role": "user", "content": "And a third, in French."}, {"role": "assistant", "content": "Rouge — c'est tout !"}],
    [{"role": "user", "content": "  Spaces around me  \n"}, {"role": "assistant", "content": "\n Trimmed or not?  "},
     {"role": "user", "content": "Line one\nline two"}, {"role": "assistant", "content": "Two lines:\n- one\n- two"}],
    [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": "ok"}],
    [{"role": "user", "content": "Emoji? 🙂 and {braces} {{ not jinja }}"}, {"role": "assistant", "content": "Sure 🙂 {ok}"}],
]
THINKING = [  # Qwen3: reasoning in the content, only kept for turns after the last user message
    [{"role": "user", "content": "Is 7 prime?"},
     {"role": "assistant", "content": "<think>\nIt has no divisors but 1 and 7.\n</think>\n\nYes."}],
    [{"role": "user", "content": "Is 9 prime?"}, {"role": "assistant", "content": "<think>\n3 x 3\n</think>\n\nNo."},
     {"role": "user", "content": "And 11?"}, {"role": "assistant", "content": "<think>\nno divisors\n</think>\n\nYes, 11 is prime."}],
]


def conversations(family):
    with_system = [[SYSTEM] + c for c in CONVERSATIONS[:3]] if FAMILIES[family][5] else []
    return CONVERSATIONS + with_system + (THINKING if family.startswith("qwen") else [])


def corpus():
    texts = [m["content"] for c in CONVERSATIONS + THINKING for m in c] + [SYSTEM["content"]]
    texts += ["user assistant system model Cutting Knowledge Date Today Jul December You are Qwen created by Alibaba"
              " Cloud helpful INST"] * 3
    return texts


def write_checkpoint_tokenizer(directory: Path, family: str, template: str | None = None, metaspace: bool = False) -> Path:
    """A small BPE tokenizer.json (byte-level, or sentencepiece-like with ``metaspace``) with the family's control
    tokens as added special tokens, and a tokenizer_config.json naming them and holding the template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    _, _, specials, bos, eos, _ = FAMILIES[family]
    directory.mkdir(parents=True, exist_ok=True)
    if metaspace:
        backend = Tokenizer(models.BPE(unk_token=specials[0], byte_fallback=False))
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        alphabet = sorted(set("".join(corpus()) + "\n▁!?-:'{}[]/|<>_.,0123456789" + "".join(FAMILIES[family][0])))
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False)
    else:
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus(), trainer)
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


# Oracle: ids and masks equal to transformers', per family --------------------------------------------------

@pytest.mark.parametrize("family, metaspace", [(f, False) for f in FAMILIES] + [(f, True) for f in ("mistral", "mistral-v0.3", "gemma")])
def test_ids_and_masks_equal_transformers(tmp_path, family, metaspace):
    from transformers import AutoTokenizer

    template, marked, *_ = FAMILIES[family]
    directory = write_checkpoint_tokenizer(tmp_path / family, family, template, metaspace)
    theirs = AutoTokenizer.from_pretrained(directory)
    ours = load_tokenizer(directory)
    own, with_generation = load_chat_template(ours), ChatTemplate(marked, "marked", ours.special_tokens, ours.added_tokens)
    assert not own.marks_generation and with_generation.marks_generation
    checked = 0
    for messages in conversations(family):
        expected = theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        oracle = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                            chat_template=marked)
        assert oracle["input_ids"] == expected  # the marked copy renders the same text
        assert own.render(messages) == theirs.apply_chat_template(messages, tokenize=False)
        for chat in (own, with_generation):
            ids, mask = chat.encode(messages, ours)
            assert ids == expected, (family, chat)
            assert mask == oracle["assistant_masks"], (family, chat, theirs.decode([i for i, m in zip(ids, mask) if m]),
                                                       theirs.decode([i for i, m in zip(ids, oracle["assistant_masks"]) if m]))
        supervised = theirs.decode([i for i, m in zip(ids, mask) if m])
        assert messages[-1]["content"].strip().split("</think>")[-1].strip() in supervised
        checked += 1
    assert checked >= len(CONVERSATIONS)


def test_gemma_rejects_a_system_message_in_one_line(tmp_path):
    directory = write_checkpoint_tokenizer(tmp_path / "g", "gemma", GEMMA)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [SYSTEM] + CONVERSATIONS[0]}) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl: record 1 \(line 1\): .*tokenizer_config\.json \(chat_template\): chat template "
                                         r"failed.*System role not supported") as info:
        ChatDataset(data, load_tokenizer(directory), max_seq_len=64)
    assert "\n" not in str(info.value)


def test_template_sources(tmp_path):
    directory = write_checkpoint_tokenizer(tmp_path / "q", "qwen2.5", QWEN25)
    assert load_chat_template(load_tokenizer(directory)).text == QWEN25
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(load_tokenizer(directory)).text == CHATML
    (directory / "chat_template.jinja").write_text(PHI3)  # transformers prefers the file
    chat = load_chat_template(load_tokenizer(directory))
    assert chat.text == PHI3 and chat.source.endswith("chat_template.jinja")
    assert load_chat_template(load_tokenizer(directory), "llama3").text == LLAMA3
    tiny = load_tokenizer(ROOT / "assets" / "tiny_llama")
    with pytest.raises(ValueError, match=r"tiny_llama: the checkpoint has no chat template.*chatml, llama3"):
        load_chat_template(tiny)
    with pytest.raises(ValueError, match=r"template: unknown chat template 'vicuna'; known: alpaca, chatml, llama3"):
        load_chat_template(tiny, "vicuna")


@pytest.mark.parametrize("attack", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
    "{% set ns = namespace(__class__=1) %}{{ ns }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
])
def test_templates_run_sandboxed(tmp_path, attack):
    (tmp_path / "evil.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}\n" + attack)
    chat = load_chat_template(load_tokenizer(ROOT / "assets" / "tiny_llama"), str(tmp_path / "evil.jinja"))
    with pytest.raises(ValueError, match=r"evil\.jinja: chat template refused \(line 2\): SecurityError") as info:
        chat.render(CONVERSATIONS[0])
    assert "\n" not in str(info.value)


def test_template_syntax_error_names_the_file_and_line(tmp_path):
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ValueError, match=r"bad\.jinja: chat template does not compile \(line 2\)") as info:
        load_chat_template(load_tokenizer(ROOT / "assets" / "tiny_llama"), str(tmp_path / "bad.jinja"))
    assert "\n" not in str(info.value)


def test_builtin_templates_on_a_tokenizer_without_their_tokens():
    """The tiny checkpoint has no <|im_end|>: the end of a turn is found from the text the template writes."""
    tokenizer = load_tokenizer(ROOT / "assets" / "tiny_llama")
    for name, eot in (("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")):
        chat = load_chat_template(tokenizer, name)
        text, spans = chat.assistant_spans([SYSTEM] + CONVERSATIONS[1])
        assert [text[s:e] for s, e in spans] == [m["content"].strip() + eot for m in CONVERSATIONS[1][1::2]]


def test_sentencepiece_tokenizer_gives_offsets_and_reads_control_tokens(tmp_path):
    from tests.test_training_data import train_sentencepiece

    train_sentencepiece(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.special_tokens["bos_token"] == "<s>"  # from the model, as no tokenizer_config names it
    messages = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "the lazy dog 42"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "fox"}]
    chat = load_chat_template(tokenizer, "llama3")
    text, _ = chat.assistant_spans(messages)
    ids, offsets = tokenizer.encode_with_offsets(text)
    assert ids[0] == tokenizer.bos_id and text.startswith("<s>") and offsets[0] == (0, 3)
    assert all(a <= b for a, b in offsets) and all(b1 <= a2 for (_, b1), (a2, _) in zip(offsets, offsets[1:]))
    _, mask = chat.encode(messages, tokenizer)
    supervised = "".join(text[a:b] for (a, b), m in zip(offsets, mask) if m)
    # (a token may straddle the end of a turn: this vocabulary has "|><|" as one unknown piece)
    assert supervised.strip().startswith("the lazy dog 42<|eot_id|>") and supervised.endswith("fox<|eot_id|>")
    assert "header" not in supervised and "again" not in supervised


# Records ---------------------------------------------------------------------------------------------------

def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    return load_tokenizer(write_checkpoint_tokenizer(tmp_path_factory.mktemp("chatml"), "chatml", CHATML))


def test_sharegpt_and_column_mapping_give_the_same_items(tmp_path, chatml_tokenizer):
    messages = [SYSTEM] + CONVERSATIONS[1]
    openai = ChatDataset(write_jsonl(tmp_path / "a.jsonl", [{"messages": messages}]), chatml_tokenizer, 512)
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}]
    (tmp_path / "b.json").write_text(json.dumps(sharegpt))
    mapped = [{"dialog": [{"speaker": m["role"], "text": m["content"]} for m in messages], "id": 1}]
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(mapped), tmp_path / "c.parquet")
    columns = {"messages": "dialog", "role": "speaker", "content": "text"}
    item = openai[0]
    assert ChatDataset(tmp_path / "b.json", chatml_tokenizer, 512)[0] == item
    assert ChatDataset(tmp_path / "c.parquet", chatml_tokenizer, 512, columns=columns)[0] == item
    supervised = chatml_tokenizer.decode([t for t in item["labels"] if t != -100])
    assert supervised == "Blue, like the sky.Green.Rouge — c'est tout !"  # (special tokens are not decoded)
    assert ChatDataset(tmp_path / "a.jsonl", chatml_tokenizer, 512, train_on_input=True)[0]["labels"] == item["tokens"]
    cut = ChatDataset(tmp_path / "a.jsonl", chatml_tokenizer, 10)[0]
    assert cut == {"tokens": item["tokens"][:10], "labels": item["labels"][:10]}


def test_a_directory_source_reads_its_data_files(tmp_path, chatml_tokenizer):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train-0.jsonl", [{"messages": CONVERSATIONS[0]}])
    write_jsonl(tmp_path / "data" / "train-1.jsonl", [{"messages": CONVERSATIONS[3]}, {"messages": CONVERSATIONS[4]}])
    (tmp_path / "README.md").write_text("card")
    (tmp_path / "dataset_info.json").write_text("{}")
    assert [r.where for r in read_records(tmp_path)] == ["record 1 (line 1)", "record 1 (line 1)", "record 2 (line 2)"]
    assert len(ChatDataset(tmp_path, chatml_tokenizer, 64)) == 3


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, r"record 2 \(line 2\): no assistant message"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]},
     r"record 2 \(line 2\): message 2: unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}]},
     r"record 2 \(line 2\): message 2: 'content' must be a string or a list of parts \({'type': 'text', 'text': \.\.\.}\), got int"),
    ({"messages": [{"role": "user"}]}, r"record 2 \(line 2\): message 1: missing key 'content'"),
    ({"dialog": []}, r"record 2 \(line 2\): missing key 'messages' \(or 'conversations'"),
    ({"messages": []}, r"record 2 \(line 2\): 'messages' must be a non-empty list"),
    (["not", "an", "object"], r"record 2 \(line 2\): expected an object, got list"),
]


@pytest.mark.parametrize("bad, match", BAD)
def test_bad_records_are_one_line_errors_or_skipped_and_counted(tmp_path, chatml_tokenizer, capsys, bad, match):
    good = {"messages": CONVERSATIONS[0]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, bad, good, bad])
    with pytest.raises(ValueError, match=match) as info:
        ChatDataset(path, chatml_tokenizer, 64)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    dataset = ChatDataset(path, chatml_tokenizer, 64, skip_bad_records=True)
    assert (len(dataset), dataset.skipped) == (2, 2)
    out = capsys.readouterr().out
    assert out.count("skipped 2 malformed record(s)") == 1 and len(out.strip().splitlines()) == 1


def test_records_are_tokenized_once_at_construction(tmp_path, chatml_tokenizer):
    """Every record is rendered before the first step (a record the template cannot render stops the run then),
    and only once: reading items tokenizes nothing again."""
    calls = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner
            self.special_tokens, self.added_tokens = inner.special_tokens, inner.added_tokens
            self.chat_template, self.chat_template_source = inner.chat_template, inner.chat_template_source

        def encode_with_offsets(self, text):
            calls.append(text)
            return self.inner.encode_with_offsets(text)

    dataset = ChatDataset(write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVERSATIONS]), Counting(chatml_tokenizer), 64)
    assert len(calls) == len(CONVERSATIONS)
    assert dataset[2] == ChatDataset(tmp_path / "d.jsonl", chatml_tokenizer, 64)[2]
    assert len(calls) == len(CONVERSATIONS)


def test_unknown_columns_option_is_named(tmp_path, chatml_tokenizer):
    with pytest.raises(ValueError, match=r"columns: expected names for messages, role, content"):
        ChatDataset(tmp_path / "x.jsonl", chatml_tokenizer, 64, columns={"turns": "dialog"})


# The embedded set and the recipe ---------------------------------------------------------------------------

def test_embedded_chat_set_fits_the_tiny_config():
    tokenizer = load_tokenizer(ROOT / "assets" / "tiny_llama")
    dataset = ChatDataset(ROOT / "assets" / "tiny_chat.jsonl", tokenizer, max_seq_len=10**6, template="chatml")
    assert 150 <= len(dataset) <= 400
    lengths = [len(dataset[i]["tokens"]) for i in range(len(dataset))]
    assert max(lengths) <= 320
    assert sum(any(t != -100 for t in dataset[i]["labels"]) for i in range(len(dataset))) == len(dataset)


def test_chat_dataset_trains_through_the_recipe(tmp_path):
    from recipes import full_finetune

    out = tmp_path / "run"
    code = full_finetune.main(["--config", str(ROOT / "configs" / "tiny_chat.yaml"), f"output_dir={out}", "epochs=1",
                               "max_steps_per_epoch=3", f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
                               f"dataset.source={ROOT / 'assets/tiny_chat.jsonl'}", "save_every_epoch=false"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(loss == loss and loss > 0 for loss in losses)
    # the output renders prompts as the run trained (a base model trained with the built-in chatml): generate
    # picks the template up from the checkpoint and stops at its end of turn
    from recipes import generate
    from waypoint.text.chat_template import BUILTIN_TEMPLATES

    step = out / "step_3"
    assert (step / "chat_template.jinja").read_text() == BUILTIN_TEMPLATES["chatml"]
    assert generate.main(["--config", str(ROOT / "configs/generate.yaml"), f"checkpoint_dir={step}", "prompt=Hi",
                          "max_new_tokens=4"]) == 0
