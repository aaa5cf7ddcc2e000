"""Conversations rendered with a checkpoint's own chat template, as transformers' ``apply_chat_template`` does.

The template is untrusted input (it comes with a checkpoint from the Hub), so it runs in jinja2's sandbox as
transformers sets it up, with a step and a size limit on each rendering (``waypoint.text.template_sandbox``).
A template is rendered with ``messages``, ``tools`` (None unless ``render`` is given tool definitions),
``documents=None``, ``add_generation_prompt`` and the tokenizer's named special tokens (``bos_token``,
``eos_token``, ...). The text is tokenized as ``apply_chat_template(tokenize=True)`` does it: no BOS/EOS added,
the special tokens written in the text read as those tokens.

Assistant masks (which tokens a model is trained on) come from rendering, whether or not the template marks
the assistant's text with ``{% generation %}``:

* A template with ``{% generation %}`` blocks: the characters they render, as transformers takes them.
* Otherwise, for each assistant message: its turn starts where the prompt for it ends, the rendering of the
  messages before it with ``add_generation_prompt=True`` (when that is a prefix of the whole conversation's
  rendering; when it is not but the messages before it render as a prefix, after the part of the generation prompt
  the conversation writes there, cut at whitespace: Qwen3.5 writes earlier turns as ``<|im_start|>assistant\\n``
  without the prompt's ``<think>\\n``; else, as with templates that move the system message, at the place before
  the content where the conversation's text agrees longest with the end of that prompt, else where the content
  starts),
  and ends with its end-of-turn text: the content is rendered
  between private-use marker characters to find where it ends, and the end-of-turn text is what follows up to
  and including the first control token (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, ``</s>``,
  ``<|end|>``, ...), or, when the tokenizer has none in that text, the text the template writes after the
  content both there and when the message ends the conversation, cut at whitespace. So what the model is
  trained to write is exactly what it must write after the generation prompt to end its turn.
* A template may write an earlier turn in a history form, unlike the turn the model writes (the same messages
  rendered with that turn last, without a generation prompt): gpt-oss's harmony template ends the last turn with
  ``<|return|>``, the token generation stops at, but earlier ones with ``<|end|>``, after which the model would
  go on; and it drops earlier turns' analysis (``thinking``). Such a turn is trained only where it is what the
  model writes: its end-of-turn text is left out when its control token differs from the one the template ends
  the turn with when it is last, and the text between the prompt and the content (harmony's
  ``<|channel|>final<|message|>``), whitespace after it aside, is left out when it differs from that rendering's
  (the analysis dropped).

Tokens are in the mask when their character span overlaps an assistant span (transformers maps a span's first
and last characters to tokens; the two agree whenever every character belongs to a token, as with byte-level
and byte-fallback tokenizers).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from pathlib import Path

from waypoint.text.generation_marks import marked_copy
from waypoint.text.instruction_templates import TEMPLATES as INSTRUCTION_TEMPLATES
from waypoint.text.message_forms import takes_arguments_as_text, with_arguments_as, with_reasoning_aliases
from waypoint.text.template_sandbox import TemplateLimitError, render_limited, sandboxed_environment

# Templates for checkpoints without their own (base models), by name: chat.template = "chatml" | "llama3" | "alpaca".
BUILTIN_TEMPLATES: dict[str, str] = {
    # ChatML (Qwen, many fine-tunes), without a default system prompt.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Meta Llama 3 Instruct's original template (no tools, no date header).
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
        " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    # Alpaca's instruction prompt (waypoint.text.instruction_templates): what an instruction run trains on.
    **{name: template.as_chat_template() for name, template in INSTRUCTION_TEMPLATES.items()},
}

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MARK_BASE = 0xE000  # private-use characters marking assistant contents; two per assistant message
_MARK_LIMIT = 0xF8FF


class ChatTemplateError(ValueError):
    """A template that cannot be compiled or rendered, or whose assistant turns cannot be found."""


class ChatTemplateLimitError(ChatTemplateError):
    """A template that ran past the sandbox's step or size limit: broken or hostile, whatever it renders."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _template_line(error: BaseException) -> str:
    """`` (line N)`` for the template line an error was raised from, when jinja's traceback has it."""
    lineno = getattr(error, "lineno", None)
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {lineno})" if lineno else ""


class ChatTemplate:
    """A compiled chat template.

    Args:
        text: the jinja source.
        source: where it came from (a file, or ``built-in template 'chatml'``), named in every error.
        special_tokens: ``{"bos_token": "<s>", ...}``, passed to the template as variables.
        control_tokens: the tokenizer's added tokens (end-of-turn detection).
        template_kwargs: further variables (e.g. ``enable_thinking``); they override the special tokens.
    """

    def __init__(self, text: str, source: str, special_tokens: dict[str, str] | None = None,
                 control_tokens: Sequence[str] = (), template_kwargs: dict | None = None) -> None:
        if not isinstance(text, str):
            raise ChatTemplateError(f"{source}: a chat template must be a string, got {type(text).__name__}")
        self.text = text
        self.source = source
        self.variables = {**(special_tokens or {}), **(template_kwargs or {})}
        self.control_tokens = tuple(sorted({t for t in control_tokens if t and not t.isspace()}, key=len, reverse=True))
        self._control_re = re.compile("|".join(map(re.escape, self.control_tokens))) if self.control_tokens else None
        self.marks_generation = bool(_GENERATION_TAG.search(text))
        try:
            self._env = sandboxed_environment()
        except ImportError as e:
            raise ChatTemplateError(f"{source}: {e}") from e
        try:
            self._template = self._env.from_string(text)
        except Exception as e:  # TemplateSyntaxError and friends
            raise ChatTemplateError(f"{source}: chat template does not compile{_template_line(e)}: {_one_line(e)}") from e
        marked = None if self.marks_generation else marked_copy(text)
        self._marked = self._env.from_string(marked) if marked is not None else None  # waypoint.text.generation_marks
        self._prompt_tail: str | None = None
        self._arguments_as_text: bool | None = None  # the form the template takes tool calls' arguments in

    def __repr__(self) -> str:
        return f"ChatTemplate({self.source})"

    # Rendering --------------------------------------------------------------------------------------------

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        """The conversation as text, as ``apply_chat_template(messages, tokenize=False, tools=tools)`` writes it
        (``tools``: JSON-schema tool definitions, as the template reads them)."""
        return self._render(messages, add_generation_prompt, tools=tools)[0]

    def _render(self, messages, add_generation_prompt, track=False, tools=None, template=None,
                **extra) -> tuple[str, list[tuple[int, int]]]:
        messages = [with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
        variables = {**self.variables, **extra, "messages": messages, "tools": tools, "documents": None,
                     "add_generation_prompt": add_generation_prompt}
        template = self._template if template is None else template
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            if track:
                with self._env.track_generation(blocks, spans):
                    return render_limited(self._env, template, variables, blocks), spans
            return render_limited(self._env, template, variables, blocks), spans
        except ChatTemplateError:
            raise
        except TemplateLimitError as e:
            raise ChatTemplateLimitError(f"{self.source}: chat template stopped{_template_line(e)}: {e}; a real template "
                                    "renders a conversation far within this, so this one is broken or hostile") from e
        except Exception as e:  # raise_exception, SecurityError, UndefinedError, TypeError, ...
            kind = "refused" if type(e).__name__ == "SecurityError" else "failed"
            raise ChatTemplateError(f"{self.source}: chat template {kind}{_template_line(e)}: "
                                    f"{type(e).__name__}: {_one_line(e)}") from e

    # Assistant spans --------------------------------------------------------------------------------------

    def assistant_spans(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans the model is trained on (see the module doc)."""
        if self.marks_generation:
            return self._render(messages, False, track=True, tools=tools)
        if self._marked is not None:  # a published template marked here: one rendering, checked against the template's
            text = self.render(messages, tools=tools)
            try:
                marked, spans = self._render(messages, False, track=True, tools=tools, template=self._marked,
                                             wp_prompt_tail=self._generation_prompt_tail())
            except ChatTemplateError:
                marked = None
            if marked == text:
                return text, _merged(spans)
        return self._derive_spans(messages, tools)

    def _generation_prompt_tail(self) -> str:
        """What the generation prompt writes after ``<|im_start|>assistant\\n`` (waypoint.text.generation_marks)."""
        if self._prompt_tail is None:
            probe = [{"role": "user", "content": "x"}]
            prompt = self.render(probe, add_generation_prompt=True)
            header = "<|im_start|>assistant\n"
            self._prompt_tail = prompt[prompt.rindex(header) + len(header):] if header in prompt else ""
        return self._prompt_tail

    def _derive_spans(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        text = self.render(messages, tools=tools)
        assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not assistants:
            return text, []
        if _MARK_BASE + 2 * len(assistants) > _MARK_LIMIT:
            raise ChatTemplateError(f"{self.source}: too many assistant messages ({len(assistants)}) to find their turns")
        n_marks = 2 * len(assistants)
        if any(_MARK_BASE <= ord(ch) < _MARK_BASE + n_marks for m in messages for v in m.values() if isinstance(v, str)
               for ch in v):
            raise self._cannot("a message holds private-use characters U+E000.. that mark contents")
        marked_messages = [dict(m) for m in messages]
        opens, closes = {}, {}
        for k, i in enumerate(assistants):
            opens[i], closes[i] = chr(_MARK_BASE + 2 * k), chr(_MARK_BASE + 2 * k + 1)
            content = marked_messages[i].get("content")
            if isinstance(content, str):
                core = content.strip()
                lead = content[: len(content) - len(content.lstrip())]
                trail = content[len(content.rstrip()):] if core else ""
                marked_messages[i]["content"] = lead + opens[i] + core + closes[i] + trail
        marked = self.render(marked_messages, tools=tools)
        mark_positions = [p for p, ch in enumerate(marked) if _MARK_BASE <= ord(ch) < _MARK_BASE + n_marks]
        if "".join(ch for ch in marked if not _MARK_BASE <= ord(ch) < _MARK_BASE + n_marks) != text:
            raise self._cannot("the template renders a message differently when its content changes")

        def plain(position: int) -> int:  # a position in `marked` -> the same place in `text`
            return position - bisect.bisect_left(mark_positions, position)

        spans, previous_end = [], 0
        for number, i in enumerate(assistants, start=1):
            if marked.count(closes[i]) != 1 or marked.count(opens[i]) > 1:
                raise self._cannot(f"assistant message {number} (message {i + 1}) is not rendered exactly once")
            close = marked.index(closes[i])
            open_ = marked.find(opens[i])
            start = None
            try:
                prompt = self.render(marked_messages[:i], add_generation_prompt=True, tools=tools)
            except ChatTemplateError:
                prompt = None
            content_at = open_ if open_ >= 0 else close
            from_prompt = prompt is not None and marked.startswith(prompt) and previous_end <= len(prompt) <= content_at
            if from_prompt:
                start = len(prompt)
            else:  # the prompt for this turn renders differently from the conversation: where it ends in the latter
                start = self._header_end(marked_messages[:i], prompt, marked, previous_end, content_at, tools)
                if start is None:
                    start = _prompt_end(marked, previous_end, content_at, prompt or "")
                if start is None and open_ < 0:
                    raise self._cannot(f"the start of assistant message {number} (message {i + 1}) is not found")
                start = open_ + 1 if start is None else start
            # The turn as the model writes it: the conversation up to it, rendered with it last (see the module doc).
            as_last = marked if i == len(marked_messages) - 1 else self.render_or_none(marked_messages[: i + 1], tools)
            header = marked[start:open_].rstrip() if from_prompt and open_ >= 0 else ""
            if header and as_last is not None and as_last.startswith(prompt) and opens[i] in as_last \
                    and as_last[len(prompt): as_last.index(opens[i])].rstrip() != header:
                start += len(header)  # a history form of the header (harmony's, the analysis dropped): not trained
            end = close + 1 + len(self._end_of_turn(marked, close, marked_messages, i, closes[i], 2 * len(assistants),
                                                    as_last, tools))
            if start < previous_end:
                raise self._cannot(f"assistant message {number} (message {i + 1}) overlaps the one before it")
            previous_end = end
            spans.append((plain(start), plain(end)))
        return text, spans

    def _header_end(self, before: list[dict], prompt: str | None, marked: str, low: int, high: int,
                    tools: list[dict] | None = None) -> int | None:
        """Where a turn's header ends in ``marked[low:high]`` when the conversation renders the messages ``before`` it
        as they render alone but writes the turn's header unlike the generation prompt (Qwen3.5's earlier turns:
        ``<|im_start|>assistant\\n`` without the prompt's ``<think>\\n``): after the part of the generation prompt it
        writes, cut at whitespace when they part mid-way; None when that is not so."""
        base = self.render_or_none(before, tools)
        if prompt is None or base is None or not prompt.startswith(base) or not marked.startswith(base) \
                or not low <= len(base) <= high:
            return None
        generation_prompt, header = prompt[len(base):], marked[len(base):high]
        common = 0
        while common < min(len(generation_prompt), len(header)) and generation_prompt[common] == header[common]:
            common += 1
        if common < len(generation_prompt):  # they part mid-way: keep whole whitespace-separated pieces
            common = max((p + 1 for p in range(common) if header[p].isspace()), default=0)
        return len(base) + common if common else None

    def render_or_none(self, messages: list[dict], tools: list[dict] | None = None) -> str | None:
        """``render`` (no generation prompt), or None where the template refuses the conversation."""
        try:
            return self.render(messages, tools=tools)
        except ChatTemplateError:
            return None

    def _end_of_turn(self, marked: str, close: int, marked_messages: list[dict], i: int, close_mark: str,
                     n_marks: int, as_last: str | None = None, tools: list[dict] | None = None) -> str:
        """The text the template writes after an assistant content to end the turn (``as_last``: the conversation up to
        the turn, rendered with it last)."""
        after = marked[close + 1:]
        limit = next((p for p, ch in enumerate(after) if _MARK_BASE <= ord(ch) < _MARK_BASE + n_marks), len(after))
        tail = after[:limit]
        last_tail = as_last[as_last.index(close_mark) + 1:] if as_last is not None and close_mark in as_last else ""
        if self._control_re is not None:
            found = self._control_re.search(tail)
            if found:
                own = self._control_re.search(last_tail)
                if own is not None and own.group() != found.group():
                    return ""  # a history form (harmony's <|end|> for <|return|>): not what the model writes to end it
                return tail[: found.end()]
        # No control token: what the template writes after the content both here and when the message is the last.
        if as_last is None:
            last = self.render(marked_messages[: i + 1], tools=tools)
            last_tail = last[last.index(close_mark) + 1:] if close_mark in last else ""
        common = 0
        while common < min(len(tail), len(last_tail)) and tail[common] == last_tail[common]:
            common += 1
        eot = tail[:common]
        if common < len(last_tail) and common < len(tail):  # they part mid-way: keep whole whitespace-separated pieces
            cut = max((p for p, ch in enumerate(eot) if ch.isspace()), default=-1)
            eot = eot[: cut + 1]
        return eot.rstrip()

    def with_arguments_it_takes(self, messages: list[dict]) -> list[dict]:
        """``messages`` with their tool calls' arguments in the form this template takes (``message_forms``)."""
        if self._arguments_as_text is None and any(m.get("tool_calls") for m in messages):
            self._arguments_as_text = takes_arguments_as_text(self.render_or_none)
        return with_arguments_as(messages, as_text=bool(self._arguments_as_text))

    def _cannot(self, why: str) -> ChatTemplateError:
        return ChatTemplateError(f"{self.source}: cannot find the assistant turns in the rendered conversation: {why} "
                                 "(mark them with {% generation %}...{% endgeneration %} in the template)")

    # Tokens -----------------------------------------------------------------------------------------------

    def encode(self, messages: list[dict], tokenizer, tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation and its assistant mask (1 on the tokens trained on), as
        ``apply_chat_template(messages, tokenize=True, return_assistant_tokens_mask=True)`` gives them; tool calls'
        arguments in the form the template takes (:meth:`with_arguments_it_takes`)."""
        text, spans = self.assistant_spans(self.with_arguments_it_takes(messages), tools)
        ids, offsets = tokenizer.encode_with_offsets(text)
        return ids, spans_to_mask(offsets, spans)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted spans with those that touch joined: a turn marked in pieces (thought, calls, content) as one."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _prompt_end(marked: str, low: int, high: int, prompt: str) -> int | None:
    """The position in ``marked[low:high]`` after which the text agrees longest with the end of ``prompt`` (the
    latest on ties), or None if no position ends with the prompt's last character."""
    best, best_length = None, 0
    for q in range(max(low, 1), high + 1):
        if not prompt or marked[q - 1] != prompt[-1]:
            continue
        length = 0
        while length < min(q - low, len(prompt)) and marked[q - 1 - length] == prompt[-1 - length]:
            length += 1
        if length >= best_length:
            best, best_length = q, length
    return best


def spans_to_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose character span overlaps one of ``spans`` (sorted, disjoint), else 0."""
    mask = [0] * len(offsets)
    starts = [s for s, _ in spans]
    for t, (a, b) in enumerate(offsets):
        k = bisect.bisect_right(starts, max(a, b - 1)) - 1
        while k >= 0:
            s, e = spans[k]
            if (a < e and b > s) or (a == b and s <= a < e):
                mask[t] = 1
                break
            if e <= a:
                break
            k -= 1
    return mask


def load_chat_template(tokenizer, template: str | None = None, template_kwargs: dict | None = None) -> ChatTemplate:
    """The template to render with: ``template`` (a name in ``BUILTIN_TEMPLATES`` or a ``.jinja`` file) when given,
    else the checkpoint's own (``chat_template.jinja``, else ``chat_template`` in tokenizer_config.json; of
    several named ones, ``default``)."""
    special = dict(getattr(tokenizer, "special_tokens", {}) or {})
    controls = tuple(getattr(tokenizer, "added_tokens", ()) or ())
    if template is not None:
        if template in BUILTIN_TEMPLATES:
            return ChatTemplate(BUILTIN_TEMPLATES[template], f"built-in template {template!r}", special, controls, template_kwargs)
        path = Path(template)
        if path.suffix == ".jinja" or path.is_file():
            if not path.is_file():
                raise FileNotFoundError(f"{path}: chat template file not found")
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path), special, controls, template_kwargs)
        raise ChatTemplateError(f"template: unknown chat template {template!r}; known: "
                                f"{', '.join(sorted(BUILTIN_TEMPLATES))}, or a path to a .jinja file")
    own = getattr(tokenizer, "chat_template", None)
    where = getattr(tokenizer, "chat_template_source", None) or "the tokenizer"
    if own is None:
        directory = getattr(tokenizer, "directory", None) or "the tokenizer"
        raise ChatTemplateError(f"{directory}: the checkpoint has no chat template (no chat_template.jinja, no chat_template "
                                f"in tokenizer_config.json); set template to one of {', '.join(sorted(BUILTIN_TEMPLATES))} "
                                "or a .jinja file")
    if isinstance(own, dict):
        if "default" not in own:
            raise ChatTemplateError(f"{where}: no template named 'default' among {', '.join(sorted(own))}; "
                                    "set template to a .jinja file")
        return ChatTemplate(own["default"], f"{where}['default']", special, controls, template_kwargs)
    return ChatTemplate(own, where, special, controls, template_kwargs)
