"""Instruction prompt formats (Alpaca's), and each written as a chat template, so a model trained on it is prompted
the same way afterwards.

An instruction run (``waypoint.data.instruct_dataset``) tokenizes ``BOS + prompt`` and ``response + EOS``. The
chat-template form renders a user message as that prompt (its content the instruction) and an assistant message as
the response and EOS; with ``add_generation_prompt`` a conversation ending with the user's message renders exactly
the prompt the model was trained to answer. The run writes it beside its checkpoints (``chat_template.jinja``), where
recipes/generate.py, transformers' ``apply_chat_template`` and vLLM's chat endpoint find it. A record's ``input``
has no place in a conversation: the form is that of records without one. A system message goes before the prompt,
as a paragraph of its own.
"""

from __future__ import annotations

import json
from typing import NamedTuple


class PromptTemplate(NamedTuple):
    """A prompt with ``{instruction}`` and ``{input}`` fields, and one for records without input."""

    with_input: str
    without_input: str

    def format(self, instruction: str, input: str = "") -> str:
        if input:
            return self.with_input.format(instruction=instruction, input=input)
        return self.without_input.format(instruction=instruction)

    def as_chat_template(self) -> str:
        """The jinja chat template rendering a conversation in this format (records without input)."""
        before, after = self.without_input.split("{instruction}")
        return ("{%- if bos_token %}{{ bos_token }}{% endif -%}\n"
                "{%- for message in messages -%}\n"
                "  {%- if message['role'] == 'system' -%}{{ message['content'] + '\\n\\n' }}\n"
                f"  {{%- elif message['role'] == 'user' -%}}{{{{ {json.dumps(before)} + message['content'] + {json.dumps(after)} }}}}\n"
                "  {%- elif message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}\n"
                "  {%- endif -%}\n"
                "{%- endfor -%}\n")


TEMPLATES: dict[str, PromptTemplate] = {
    "alpaca": PromptTemplate(
        with_input=(
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\n\n"
            "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
        ),
        without_input=(
            "Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n"
            "### Instruction:\n{instruction}\n\n### Response:\n"
        ),
    ),
}
