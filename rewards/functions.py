"""Built-in verifiable rewards, each with TRL's reward-function signature.

``f(prompts, completions, completion_ids, **columns) -> list[float | None]``: one value per completion; the
dataset's other fields arrive by name as lists aligned with the completions. A completion is a string, or
conversational: a list of message dicts (TRL passes ``[{"role": "assistant", "content": ...}]``), whose assistant
contents are joined; a content given as blocks (``[{"type": "text", "text": ...}]``) counts its text blocks.

Options are keyword arguments, set with ``functools.partial`` (in a config: ``{name: answer_match, column:
solution}``). A dataset column with the same name as an option would override it.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

THINK_THEN_ANSWER = r"\s*<think>.*?</think>\s*\S.*"  # a closed think block, then something more


def completion_text(completion) -> str:
    """The text of one completion: itself if a string, else its assistant messages' contents, joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = []
    for message in completion:
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return "".join(parts)


def _boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (nested braces balanced), or None without a closed one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _after(text: str, marker: str) -> str | None:
    """The first non-blank line after the last ``marker`` (case-insensitive), or None without the marker."""
    found = list(re.finditer(re.escape(marker), text, re.IGNORECASE))
    if not found:
        return None
    lines = [line for line in text[found[-1].end():].splitlines() if line.strip()]
    return lines[0] if lines else ""


def extract_answer(text: str) -> str:
    """The answer part of a text, first match wins:

    1. only what follows the last ``</think>`` is looked at, if there is one;
    2. the contents of the last ``\\boxed{...}``;
    3. else the first non-blank line after the last ``####`` (GSM8K's marker);
    4. else the first non-blank line after the last ``answer:`` (any case);
    5. else the whole text.
    """
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    for found in (_boxed(text), _after(text, "####"), _after(text, "answer:")):
        if found is not None:
            return found
    return text


_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")
_TRAILING = ".,;:!?。"


def normalize_answer(text: str) -> str | Decimal:
    """Strip, case-fold, collapse whitespace runs to one space, strip trailing ``.,;:!?`` (and spaces between
    them); then a number (``3``, ``-3.0``, ``1e3``, ``1,000``; a leading ``$`` or trailing ``%`` is dropped)
    becomes a ``Decimal``, so ``3.0 == 3``."""
    text = " ".join(text.casefold().split()).rstrip(_TRAILING + " ")
    number = text.removeprefix("$").removesuffix("%").strip()
    if _THOUSANDS.fullmatch(number):
        number = number.replace(",", "")
    try:
        value = Decimal(number)
    except InvalidOperation:
        return text
    return value if value.is_finite() else text


def _column(columns: dict, name: str, fn: str) -> list:
    if name not in columns:
        have = ", ".join(sorted(k for k, v in columns.items() if isinstance(v, (list, tuple)))) or "none"
        raise ValueError(f"{fn}: no column {name!r} in the data (columns: {have}); set column: <name>")
    return columns[name]


def answer_match(prompts, completions, completion_ids=None, *, column: str = "answer", normalize: bool = True,
                 **columns) -> list[float | None]:
    """1.0 where a completion's answer matches the reference in ``columns[column]``, else 0.0; None (the sample
    is left out) where the reference is None.

    Both sides go through ``extract_answer`` (so a GSM8K reference ``"... #### 72"`` gives ``72``). With
    ``normalize`` (default) both are then compared after ``normalize_answer``; without it, after ``str.strip``
    only, case and all. An empty extracted answer scores 0.0.
    """
    answers = _column(columns, column, "answer_match")
    rewards = []
    for completion, answer in zip(completions, answers, strict=True):
        if answer is None:
            rewards.append(None)
            continue
        ours, theirs = extract_answer(completion_text(completion)), extract_answer(str(answer))
        if not ours.strip():
            rewards.append(0.0)  # no answer given never matches, not even an empty reference
            continue
        if normalize:
            ours, theirs = normalize_answer(ours), normalize_answer(theirs)
        else:
            ours, theirs = ours.strip(), theirs.strip()
        rewards.append(1.0 if ours == theirs else 0.0)
    return rewards


def format_reward(prompts, completions, completion_ids=None, *, pattern: str = THINK_THEN_ANSWER,
                  **columns) -> list[float]:
    """1.0 where the whole completion text matches ``pattern`` (``re.fullmatch``, with ``re.DOTALL`` so ``.``
    crosses lines), else 0.0. The default asks for a closed ``<think>...</think>`` block at the start and a
    non-blank answer after it."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"format_reward: pattern {pattern!r} is not a valid regular expression ({e})") from None
    return [1.0 if regex.fullmatch(completion_text(c)) else 0.0 for c in completions]


def length_penalty(prompts, completions, completion_ids=None, *, target: int = 1024, per_token: float = 1 / 1024,
                   max_penalty: float | None = None, **columns) -> list[float]:
    """``-per_token * max(0, len(ids) - target)`` per completion, counted in tokens (``completion_ids``): 0.0 up to
    ``target`` tokens, -1.0 at twice the default target; ``max_penalty`` (a positive number) caps its size."""
    if completion_ids is None:
        raise ValueError("length_penalty: needs completion_ids (the completions' token ids)")
    rewards = []
    for ids in completion_ids:
        over = max(0, len(ids) - target)
        penalty = per_token * over
        if max_penalty is not None:
            penalty = min(penalty, max_penalty)
        rewards.append(-penalty if penalty else 0.0)
    return rewards


BUILTINS = {f.__name__: f for f in (answer_match, format_reward, length_penalty)}
