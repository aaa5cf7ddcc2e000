"""Where generation stops: the end-of-sequence token, the end-of-turn token a chat template closes an assistant
turn with (Llama 3's ``<|eot_id|>``, ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``, Phi-3's ``<|end|>``), and
the ``eos_token_id`` of the checkpoint's ``generation_config.json``."""

from __future__ import annotations

import json
from pathlib import Path

from waypoint.text.chat_template import ChatTemplate, ChatTemplateError

_MARK = "W4YP01NT"  # assistant content no template writes on its own


def _after_assistant(template: ChatTemplate) -> str:
    try:
        text = template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}])
    except ChatTemplateError:
        return ""
    return text[text.rindex(_MARK) + len(_MARK):].lstrip(" \n") if _MARK in text else ""


def end_of_turn_text(template: ChatTemplate) -> str | None:
    """The text the template closes an assistant turn with (``<|im_end|>``), a stop string where the tokenizer has
    no single token for it; None if the template writes nothing after the content."""
    after = _after_assistant(template).split()
    return after[0] if after else None


def end_of_turn(template: ChatTemplate, tokenizer) -> str | None:
    """The control token the template writes right after an assistant message's content, or None."""
    after = _after_assistant(template)
    for token in sorted(getattr(tokenizer, "added_tokens", ()) or (), key=len, reverse=True):
        if token and after.startswith(token):
            return token
    return None


def stop_token_ids(tokenizer, template: ChatTemplate | None) -> list[int]:
    """The ids generation stops at, the end-of-sequence one first."""
    ids = [tokenizer.eos_id]
    token = end_of_turn(template, tokenizer) if template is not None else None
    if token is not None:
        encoded = tokenizer.encode_with_offsets(token)[0]
        if len(encoded) == 1:
            ids.append(encoded[0])
    directory = getattr(tokenizer, "directory", None)
    config = Path(directory) / "generation_config.json" if directory else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids += [int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    return list(dict.fromkeys(ids))
