"""Published chat templates marked with ``{% generation %}``: what the model writes, found in one rendering.

A template without ``{% generation %}`` has its assistant turns derived from several renderings per turn
(``waypoint.text.chat_template``): exact, but its cost grows with the square of the conversation's length (more for
templates that look across messages), and a turn whose rendering changes when its content does (an empty content
with tool calls) cannot be marked. The templates agent traces are mostly written in get a marked copy here,
recognized by their text's SHA-256, rendered instead in one pass with transformers' ``{% generation %}`` semantics;
the copy renders the same text, which is checked on every conversation (the derivation answers where it does not).

What a copy marks is what the derivation finds where the derivation can mark a turn (checked on every conversation
of the template tests), and the same rule where it cannot: what the model writes after the generation prompt, to the
end of its turn, tool calls included, never the tools' results. The Qwen family's: to ``<|im_end|>`` (not the newline
after it); where a turn opens with a ``<think>`` block, the part of it the generation prompt already wrote
(``<think>\\n``, or the whole block when the prompt closes an empty one and the turn's reasoning is empty) is not
trained, the prompt's tail passed in as ``wp_prompt_tail``. Llama 3.1/3.2's, Gemma 4's and gpt-oss's say theirs
beside their edits. Each copy is a few exact edits of the published text, each found exactly once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

_HEADER = "'<|im_start|>' + message.role + '\\n'"
_IM_END = ("        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n",  # the assistant turn's end
           "        {{- '<|im_end|>' }}\n        {%- endgeneration %}\n        {{- '\\n' }}\n"
           "    {%- elif message.role == \"tool\" %}\n")


def _thinking_turn(think: str, reasoning: str, content: str) -> str:
    """The marked header and body of an assistant turn that may open a ``<think>`` block: ``think`` when it does,
    ``reasoning`` and ``content`` as the template writes them there."""
    return (
        f"        {{%- set wp_think = {think} %}}\n"
        "        {%- set wp_open = wp_think and wp_prompt_tail != '' %}\n"
        f"        {{%- set wp_closed = wp_open and wp_prompt_tail != '<think>\\n' and not {reasoning} %}}\n"
        f"        {{{{- {_HEADER} }}}}\n"
        "        {%- if wp_open %}{{- '<think>\\n' }}{%- endif %}\n"
        "        {%- if wp_closed %}{{- '\\n</think>\\n\\n' }}{%- endif %}\n"
        "        {%- generation %}\n"
        "        {%- if wp_think and not wp_open %}{{- '<think>\\n' }}{%- endif %}\n"
        f"        {{%- if wp_think and not wp_closed %}}{{{{- {reasoning} + '\\n</think>\\n\\n' }}}}{{%- endif %}}\n"
        f"        {{%- if wp_think %}}{{{{- {content} }}}}{{%- else %}}{{{{- content }}}}{{%- endif %}}\n")


# The assistant turn's header block in each template structure, and what replaces it.
_QWEN35_HEADER = (  # Qwen3.5, Qwen3.6: {condition} keeps the reasoning
    "        {{%- if {condition} %}}\n"
    "            {{{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}}}\n"
    "        {{%- else %}}\n"
    "            {{{{- '<|im_start|>' + message.role + '\\n' + content }}}}\n"
    "        {{%- endif %}}\n")
_QWEN3_HEADER = (  # Qwen3, Qwen3-Next-Thinking: the last turn, or one with reasoning, after the last user query
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n")
_PLAIN_HEADER = "        {{- '<|im_start|>' + message.role + '\\n' + content }}\n"  # Qwen3-Next-Instruct: no reasoning


def _qwen35(condition: str):
    return (_QWEN35_HEADER.format(condition=condition), _thinking_turn(condition, "reasoning_content", "content")), _IM_END


_QWEN3 = (_QWEN3_HEADER, _thinking_turn("loop.index0 > ns.last_query_index and (loop.last or reasoning_content)",
                                        "reasoning_content.strip('\\n')", "content.lstrip('\\n')")), _IM_END
_PLAIN = (_PLAIN_HEADER, f"        {{{{- {_HEADER} }}}}\n        {{%- generation %}}\n        {{{{- content }}}}\n"), _IM_END

# Llama 3.2 Instruct's: a message's turn (the assistant's content trimmed, then <|eot_id|>), and a single tool call
# written as {"name": ..., "parameters": ...} in the assistant's turn
_LLAMA_TURN = ("        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
               "'<|eot_id|>' }}\n")
_LLAMA32 = (
    (_LLAMA_TURN, "        {%- if message.role == 'assistant' %}\n"
                  "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- generation %}"
                  "{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}\n"
                  "        {%- else %}\n" + _LLAMA_TURN + "        {%- endif %}\n"),
    ("        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n",
     "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n        {%- generation %}\n"),
    ("        {{- \"<|eot_id|>\" }}\n    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n",
     "        {{- \"<|eot_id|>\" }}\n        {%- endgeneration %}\n"
     "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n"),
)


# Gemma 4's (2026-07-09, "Canonical"): a model turn holds the model's thought channel, its tool calls, the
# <|tool_response> it stops at, the results (not the model's: the same turn, written by whoever ran the tools), then
# its content and <turn|>. A thought channel the generation prompt opened (`<|channel>thought\n`: a fresh turn of the
# larger models with thinking off, whose prompt writes an empty channel; a turn continued after results with
# thinking on) has that opening outside.
def _gemma4(fresh_turn_prompt_opens_channel: str):
    thought = "        {{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}\n"
    return (
        ("{%- set ns = namespace(prev_message_type=None, prev_non_tool_role=None) -%}\n",
         "{%- set ns = namespace(prev_message_type=None, prev_non_tool_role=None) -%}\n"
         "{%- set wp = namespace(open_response=false) -%}\n"),
        ("    {{- '<|tool_response>' -}}\n    {%- if response is mapping -%}\n",  # the first result's opening
         "    {%- if wp.open_response -%}{%- set wp.open_response = false -%}"
         "{%- generation -%}{{- '<|tool_response>' -}}{%- endgeneration -%}\n"
         "    {%- else -%}{{- '<|tool_response>' -}}{%- endif -%}\n    {%- if response is mapping -%}\n"),
        (thought,
         "        {%- if role != 'model' -%}\n    " + thought +
         f"        {{%- elif (continue_same_model_turn and enable_thinking) or (not continue_same_model_turn and "
         f"{fresh_turn_prompt_opens_channel}) -%}}\n"
         "            {{- '<|channel>thought\\n' -}}{%- generation -%}{{- thinking_text + '\\n<channel|>' -}}"
         "{%- endgeneration -%}\n"
         "        {%- else -%}\n"
         "            {%- generation -%}{{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}"
         "{%- endgeneration -%}\n"
         "        {%- endif -%}\n"),
        ("            {%- if message.get('tool_calls') -%}\n                {%- for tool_call in message.get('tool_calls') -%}\n",
         "            {%- generation -%}\n"
         "            {%- if message.get('tool_calls') -%}\n                {%- for tool_call in message.get('tool_calls') -%}\n"),
        ("                {%- set ns.prev_message_type = 'tool_call' -%}\n            {%- endif -%}\n",
         "                {%- set ns.prev_message_type = 'tool_call' -%}\n"
         "                {%- set wp.open_response = role == 'model' -%}\n            {%- endif -%}\n"
         "            {%- endgeneration -%}\n"),
        ("            {{- captured_content -}}\n",
         "            {%- if role == 'model' -%}{%- generation -%}{{- captured_content -}}{%- endgeneration -%}\n"
         "            {%- else -%}{{- captured_content -}}{%- endif -%}\n"),
        ("        {%- if ns.prev_message_type == 'tool_call' and not ns_tr_out.flag -%}\n            {{- '<|tool_response>' -}}\n",
         "        {%- if ns.prev_message_type == 'tool_call' and not ns_tr_out.flag -%}\n"
         "            {%- set wp.open_response = false -%}"
         "{%- generation -%}{{- '<|tool_response>' -}}{%- endgeneration -%}\n"),
        ("            {{- '<turn|>\\n' -}}\n        {%- endif -%}\n",
         "            {%- if role == 'model' -%}{%- generation -%}{{- '<turn|>' -}}{%- endgeneration -%}{{- '\\n' -}}\n"
         "            {%- else -%}{{- '<turn|>\\n' -}}{%- endif -%}\n        {%- endif -%}\n"),
    )


# gpt-oss's harmony template: after the prompt's `<|start|>assistant`, the last turn (its analysis, then its final
# message through <|return|>) and a tool call (its analysis unless a later final message drops it, then
# ` to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`) are trained whole; an earlier final message
# in its history form has its content trained, after its `<|channel|>final<|message|>` header only when no analysis
# was dropped before it, never its <|end|> (the model ends a final message with <|return|>). A tool call whose analysis
# was dropped keeps its arguments and <|call|>. The tools' results are not the model's.
_HARMONY_CALL = """            {%- if message.content and message.thinking %}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls! Put the analysis message in one or the other, but not both.") }}
            {%- elif message.content and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" }}
            {%- elif message.thinking and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=" }}
            {{- "functions." + tool_call.name + "<|channel|>commentary " }}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
            {{- tool_call.arguments|tojson }}
            {{- "<|call|>" }}
"""
_HARMONY_CALL_MARKED = """            {%- set wp_header = " to=functions." + tool_call.name + "<|channel|>commentary " + (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" %}
            {%- if message.content and message.thinking %}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls! Put the analysis message in one or the other, but not both.") }}
            {%- elif (message.content or message.thinking) and future_final_message.found %}
                {{- "<|start|>assistant" + wp_header }}
                {%- generation %}{{- tool_call.arguments|tojson + "<|call|>" }}{%- endgeneration %}
            {%- else %}
                {{- "<|start|>assistant" }}
                {%- generation %}
                {%- if message.content or message.thinking %}
                    {{- "<|channel|>analysis<|message|>" + (message.content or message.thinking) + "<|end|><|start|>assistant" }}
                {%- endif %}
                {{- wp_header + tool_call.arguments|tojson + "<|call|>" }}
                {%- endgeneration %}
            {%- endif %}
"""
_HARMONY_LAST = """            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {#- <|return|> indicates the end of generation, but <|end|> does not #}
            {#- <|return|> should never be an input to the model, but we include it as the final token #}
            {#- when training, so the model learns to emit it. #}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
"""
_HARMONY_LAST_MARKED = """            {{- "<|start|>assistant" }}
            {%- generation %}
            {%- if "thinking" in message %}
                {{- "<|channel|>analysis<|message|>" + message.thinking + "<|end|><|start|>assistant" }}
            {%- endif %}
            {{- "<|channel|>final<|message|>" + message.content + "<|return|>" }}
            {%- endgeneration %}
"""
_HARMONY_EARLIER = """            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
"""
_HARMONY_EARLIER_MARKED = """            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>final<|message|>" }}
                {%- generation %}{{- message.content }}{%- endgeneration %}
            {%- else %}
                {{- "<|start|>assistant" }}
                {%- generation %}{{- "<|channel|>final<|message|>" + message.content }}{%- endgeneration %}
            {%- endif %}
            {{- "<|end|>" }}
"""
_HARMONY = ((_HARMONY_CALL, _HARMONY_CALL_MARKED), (_HARMONY_LAST, _HARMONY_LAST_MARKED),
            (_HARMONY_EARLIER, _HARMONY_EARLIER_MARKED))


def _generation_around(text: str, outside: int = 0) -> tuple[str, str]:
    """An edit that puts ``{% generation %}`` around ``text`` but its first ``outside`` lines, at their indent."""
    lines = text.splitlines(keepends=True)
    indent = " " * (len(lines[outside]) - len(lines[outside].lstrip()))
    return text, ("".join(lines[:outside]) + f"{indent}{{%- generation %}}\n" + "".join(lines[outside:])
                  + f"{indent}{{%- endgeneration %}}\n")


# Llama 3.1 Instruct's adds built-in tools: a call of one is written `<|python_tag|>NAME.call(...)`, and
# with built-in tools the call ends with <|eom_id|> (ipython mode) instead of <|eot_id|>
_LLAMA31 = (
    _LLAMA32[0],
    _generation_around("""            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
""", outside=1),
    _generation_around("""            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
""", outside=1),
    _generation_around("""        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
"""),
)


@dataclass(frozen=True)
class Marks:
    name: str  # the template, as its checkpoints ship it
    edits: tuple[tuple[str, str], ...]  # (text found exactly once, what replaces it), in order


# SHA-256 of the published text (assets/chat_templates/README.md says where each copy comes from) -> its marks
MARKS = {
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715":
        Marks("Qwen3.5 (4B and larger)", _qwen35("loop.index0 > ns.last_query_index")),
    "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80":
        Marks("Qwen3.5 (0.8B, 2B)", _qwen35("loop.index0 > ns.last_query_index")),
    "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259":
        Marks("Qwen3.6", _qwen35("(preserve_thinking is defined and preserve_thinking is true) or "
                                 "(loop.index0 > ns.last_query_index)")),
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": Marks("Qwen3", _QWEN3),
    "3802169b2a02b81e6adb7ab4f64f91ff02db753c8c3a64a01c35192d3a61d8d7": Marks("Qwen3-Next-Thinking", _QWEN3),
    "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326": Marks("Qwen3-Next-Instruct", _PLAIN),
    "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4": Marks("Llama 3.2 Instruct", _LLAMA32),
    "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65": Marks("Llama 3.1 Instruct", _LLAMA31),
    "ae53464bf3be25802b3a5b37def7fd89667067d7577049b3b2d74c4d8de4c6d4":
        Marks("Gemma 4 (12B, 26B-A4B, 31B)", _gemma4("not enable_thinking")),
    "0a2c8073c878ab1da004bee933a998606537bbb62016310352c7285c3f01c5b5": Marks("Gemma 4 (E2B, E4B)", _gemma4("false")),
    "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146": Marks("gpt-oss (harmony)", _HARMONY),
}


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def marked_copy(text: str) -> str | None:
    """The template ``text`` marked with ``{% generation %}`` (the module doc), or None when it is not one known here."""
    marks = MARKS.get(digest(text))
    if marks is None:
        return None
    for old, new in marks.edits:
        if text.count(old) != 1:
            raise AssertionError(f"{marks.name}: a part its marks edit is not in the template once")
        text = text.replace(old, new)
    return text
