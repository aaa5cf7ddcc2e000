"""What a fine-tuned chat model needs beside its weights to stop where users expect: a ``generation_config.json``
whose ``eos_token_id`` includes the chat template's end-of-turn token (Llama 3's ``<|eot_id|>``, ChatML's
``<|im_end|>``, Gemma's ``<end_of_turn>``), which transformers' ``generate`` and vLLM stop at. The tokenizer files
and the template travel with every checkpoint as the input's side files, and beside every LoRA adapter
(``TOKENIZER_FILES``), where PEFT and vLLM users load the tokenizer from."""

from __future__ import annotations

import json
from pathlib import Path

from waypoint.text.chat_template import ChatTemplate
from waypoint.text.stop_tokens import end_of_turn

GENERATION_CONFIG = "generation_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers reads it before tokenizer_config.json's chat_template
# what transformers' AutoTokenizer (and AutoProcessor's chat template) reads from a directory, as its save_pretrained
# writes them: the files a LoRA adapter's directory gets from the input, as PEFT users put them there
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                             "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", TEMPLATE_FILE, "chat_template.json"})


def generation_config(checkpoint_dir: str | Path, tokenizer, template: ChatTemplate) -> tuple[bytes, str] | None:
    """(the generation_config.json to write, a note saying what changed), or None where the input's already stops at
    the template's end of turn (it is then copied as it is)."""
    path = Path(checkpoint_dir) / GENERATION_CONFIG
    config = json.loads(path.read_text()) if path.is_file() else {}
    eos = config.get("eos_token_id")
    ids = [int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    token = end_of_turn(template, tokenizer)
    turn = tokenizer.encode_with_offsets(token)[0] if token else []
    wanted = list(dict.fromkeys(ids + [tokenizer.eos_id] + (turn if len(turn) == 1 else [])))
    if config and wanted == ids:
        return None
    config = {**config, "eos_token_id": wanted if len(wanted) > 1 else wanted[0]}
    if tokenizer.bos_id is not None:
        config.setdefault("bos_token_id", tokenizer.bos_id)
    config.setdefault("pad_token_id", tokenizer.pad_id)
    added = [("the tokenizer's end of sequence" if i == tokenizer.eos_id else f"{token}, the chat template's end of turn")
             for i in wanted if i not in ids]
    what = (f"eos_token_id {wanted} adds {' and '.join(added)}" if path.is_file()
            else f"written from the chat template and tokenizer (the input has none): eos_token_id {wanted}")
    return (json.dumps(config, indent=2) + "\n").encode(), f"note: {GENERATION_CONFIG}: {what}"


def template_file(tokenizer, template: ChatTemplate) -> tuple[bytes, str] | None:
    """(chat_template.jinja, a note) where the run's template is not the checkpoint's own (a base model trained with
    ``template: chatml`` or a .jinja file): the output then renders prompts as it was trained. None otherwise."""
    own = getattr(tokenizer, "chat_template", None)
    owns = own == template.text or (isinstance(own, dict) and template.text in own.values())
    if owns:
        return None
    return template.text.encode(), f"note: {TEMPLATE_FILE}: the {template.source} the run trains with, for the output"
