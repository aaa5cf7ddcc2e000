"""One tokenizer interface over a checkpoint's ``tokenizer.json`` or ``tokenizer.model``.

``load_tokenizer(checkpoint_dir)`` prefers ``tokenizer.json`` (Hugging Face
``tokenizers``), then ``tokenizer.model`` (sentencepiece). Either way the text is
encoded without the backend's own special tokens and BOS/EOS are added here, so
what a sequence starts and ends with never depends on a post-processor hidden in
a file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SENTENCEPIECE_MODEL = "tokenizer.model"

# Names tried, in order, when tokenizer_config.json does not name the token.
WELL_KNOWN_BOS = ("<s>", "<|begin_of_text|>", "<bos>")
WELL_KNOWN_EOS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")


class Tokenizer:
    """Text <-> token ids with explicit BOS/EOS.

    Attributes:
        bos_id: the beginning-of-sequence id, or None if the tokenizer has none
            (then ``add_bos`` adds nothing).
        eos_id: the end-of-sequence id.
        pad_id: the tokenizer's pad id if it defines one, else ``eos_id``.
        vocab_size: the number of ids, special and added tokens included.
    """

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 bos_id: int | None, eos_id: int, pad_id: int | None, vocab_size: int) -> None:
        self._encode = encode
        self._decode = decode
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = eos_id if pad_id is None else pad_id
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """The ids of ``text``, with BOS first and/or EOS last on request."""
        ids = list(self._encode(text))
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens (BOS, EOS, pad, ...) are left out."""
        return self._decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id})")


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    """The tokenizer of ``checkpoint_dir``: its ``tokenizer.json``, else its ``tokenizer.model``."""
    directory = Path(checkpoint_dir)
    if (directory / TOKENIZER_JSON).is_file():
        return _from_tokenizer_json(directory)
    if (directory / SENTENCEPIECE_MODEL).is_file():
        return _from_sentencepiece(directory / SENTENCEPIECE_MODEL)
    raise FileNotFoundError(f"{directory}: no tokenizer found (looked for {TOKENIZER_JSON} and {SENTENCEPIECE_MODEL})")


def _from_tokenizer_json(directory: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    path = directory / TOKENIZER_JSON
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exceptions
        raise ValueError(f"{path}: not a readable tokenizer ({e})") from e
    config = _read_tokenizer_config(directory / TOKENIZER_CONFIG)

    def token_id(role: str, well_known: Sequence[str]) -> int | None:
        if f"{role}_token" in config:  # named there (null: the tokenizer has none)
            named = _token_name(config[f"{role}_token"])
            if named is None:
                return None
            found = backend.token_to_id(named)
            if found is None:
                raise ValueError(f"{directory / TOKENIZER_CONFIG}: {role}_token {named!r} is not in {path.name}")
            return found
        for name in well_known:
            found = backend.token_to_id(name)
            if found is not None:
                return found
        return None

    bos_id = token_id("bos", WELL_KNOWN_BOS)
    eos_id = token_id("eos", WELL_KNOWN_EOS)
    if eos_id is None:
        raise ValueError(f"{directory}: no EOS token (set eos_token in {TOKENIZER_CONFIG}; "
                         f"none of {', '.join(WELL_KNOWN_EOS)} is in {path.name})")
    pad_id = token_id("pad", ())
    if pad_id is None and backend.padding is not None:
        pad_id = backend.padding["pad_id"]
    return Tokenizer(
        encode=lambda text: backend.encode(text, add_special_tokens=False).ids,
        decode=lambda ids: backend.decode(ids, skip_special_tokens=True),
        bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
    )


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, a dict with "content", or null (None)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _from_sentencepiece(path: Path) -> Tokenizer:
    import sentencepiece

    backend = sentencepiece.SentencePieceProcessor()
    try:
        backend.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path}: not a readable sentencepiece model ({e})") from e
    if backend.eos_id() < 0:
        raise ValueError(f"{path}: the sentencepiece model has no EOS token")
    return Tokenizer(
        encode=lambda text: backend.EncodeAsIds(text),
        decode=lambda ids: backend.DecodeIds(ids),
        bos_id=backend.bos_id() if backend.bos_id() >= 0 else None,
        eos_id=backend.eos_id(),
        pad_id=backend.pad_id() if backend.pad_id() >= 0 else None,
        vocab_size=backend.GetPieceSize(),
    )
