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
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The named special tokens transformers passes to a chat template (as bos_token, eos_token, ...).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

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

    What chat templates need (``waypoint.text.chat_template``):
        special_tokens: the named special tokens as text, as transformers passes them to a template
            (``{"bos_token": "<s>", "eos_token": "</s>", ...}``; only those the checkpoint names).
        added_tokens: the text of the tokenizer's added (control) tokens, e.g. ``<|im_end|>``.
        chat_template: the checkpoint's own template as transformers reads it: ``chat_template.jinja``, else
            ``chat_template`` in tokenizer_config.json (a string, or a dict of named templates); None if none.
        chat_template_source: where ``chat_template`` came from (a file, for messages).
        directory: the checkpoint directory the tokenizer was read from (None when built by hand).
    """

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 bos_id: int | None, eos_id: int, pad_id: int | None, vocab_size: int,
                 encode_with_offsets: Callable[[str], tuple[list[int], list[tuple[int, int]]]] | None = None,
                 special_tokens: dict[str, str] | None = None, added_tokens: Sequence[str] = (),
                 chat_template: str | dict[str, str] | None = None, chat_template_source: str | None = None,
                 directory: Path | None = None, decode_all: Callable[[list[int]], str] | None = None) -> None:
        self._encode = encode
        self._decode = decode
        self._decode_all = decode_all or decode
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = eos_id if pad_id is None else pad_id
        self.vocab_size = vocab_size
        self._encode_with_offsets = encode_with_offsets
        self.special_tokens = dict(special_tokens or {})
        self.added_tokens = tuple(added_tokens)
        self.chat_template = chat_template
        self.chat_template_source = chat_template_source
        self.directory = directory

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """The ids of ``text``, with BOS first and/or EOS last on request."""
        ids = list(self._encode(text))
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` as a chat template's output is tokenized (no BOS/EOS added; special tokens written
        in the text are those tokens), and each token's ``(start, end)`` character span in ``text``."""
        if self._encode_with_offsets is None:
            raise ValueError(f"{self!r}: this tokenizer cannot give character offsets")
        return self._encode_with_offsets(text)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens (BOS, EOS, pad, ...) are left out."""
        return self._decode([int(i) for i in ids])

    def decode_with_special_tokens(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` with special and control tokens written out (``<|im_end|>``, ``<tool_call>``), as a
        chat template writes them: what a model's turn is parsed from (its tool calls)."""
        return self._decode_all([int(i) for i in ids])

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id})")


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    """The tokenizer of ``checkpoint_dir``: its ``tokenizer.json``, else its ``tokenizer.model``."""
    directory = Path(checkpoint_dir)
    if (directory / TOKENIZER_JSON).is_file():
        tokenizer = _from_tokenizer_json(directory)
    elif (directory / SENTENCEPIECE_MODEL).is_file():
        tokenizer = _from_sentencepiece(directory / SENTENCEPIECE_MODEL)
    else:
        raise FileNotFoundError(f"{directory}: no tokenizer found (looked for {TOKENIZER_JSON} and {SENTENCEPIECE_MODEL})")
    _add_chat_fields(tokenizer, directory)
    return tokenizer


def _add_chat_fields(tokenizer: Tokenizer, directory: Path) -> None:
    """The special tokens as text and the chat template, read as transformers reads them."""
    config = _read_tokenizer_config(directory / TOKENIZER_CONFIG)
    legacy = _read_tokenizer_config(directory / SPECIAL_TOKENS_MAP)  # older checkpoints name them here too
    for name in SPECIAL_TOKEN_NAMES:  # the file's names win over those found from the ids
        if name in config or name in legacy:
            value = _token_name(config[name]) if name in config else _token_name(legacy.get(name))
            if value is None:
                tokenizer.special_tokens.pop(name, None)
            else:
                tokenizer.special_tokens[name] = value
    tokenizer.directory = directory
    jinja_file = directory / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():  # transformers prefers the file to the config's entry
        tokenizer.chat_template, tokenizer.chat_template_source = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        return
    template = config.get("chat_template")
    where = f"{directory / TOKENIZER_CONFIG} (chat_template)"
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        try:
            template = {entry["name"]: entry["template"] for entry in template}
        except (TypeError, KeyError) as e:
            raise ValueError(f"{where}: expected a string or a list of {{name, template}} objects") from e
    if template is not None and not isinstance(template, (str, dict)):
        raise ValueError(f"{where}: expected a string or a list of {{name, template}} objects, got {type(template).__name__}")
    if template is not None:
        tokenizer.chat_template, tokenizer.chat_template_source = template, where


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
    def encode_with_offsets(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = backend.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(span) for span in encoding.offsets]

    names = {"bos_token": bos_id, "eos_token": eos_id, "pad_token": pad_id}
    return Tokenizer(
        special_tokens={name: backend.id_to_token(i) for name, i in names.items() if i is not None},
        encode=lambda text: backend.encode(text, add_special_tokens=False).ids,
        decode=lambda ids: backend.decode(ids, skip_special_tokens=True),
        decode_all=lambda ids: backend.decode(ids, skip_special_tokens=False),
        bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        encode_with_offsets=encode_with_offsets,
        added_tokens=[token.content for token in backend.get_added_tokens_decoder().values()],
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
    controls = [backend.IdToPiece(i) for i in range(backend.GetPieceSize())
                if backend.IsControl(i) and backend.IdToPiece(i)]
    names = {"bos_token": backend.bos_id(), "eos_token": backend.eos_id(), "pad_token": backend.pad_id(),
             "unk_token": backend.unk_id()}
    return Tokenizer(
        special_tokens={name: backend.IdToPiece(i) for name, i in names.items() if i >= 0},
        encode=lambda text: backend.EncodeAsIds(text),
        decode=lambda ids: backend.DecodeIds(ids),
        bos_id=backend.bos_id() if backend.bos_id() >= 0 else None,
        eos_id=backend.eos_id(),
        pad_id=backend.pad_id() if backend.pad_id() >= 0 else None,
        vocab_size=backend.GetPieceSize(),
        encode_with_offsets=lambda text: _sentencepiece_offsets(backend, text, controls),
        added_tokens=controls,
    )


def _sentencepiece_offsets(backend, text: str, controls: Sequence[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character spans of ``text``, control tokens written in it (``<s>``, ``</s>``, ...) taken as those
    tokens, the text between them encoded by sentencepiece."""
    import re

    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    pattern = "|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True) if c)
    position = 0
    for match in list(re.finditer(pattern, text)) if pattern else []:
        _sentencepiece_piece(backend, text, position, match.start(), ids, offsets)
        ids.append(backend.PieceToId(match.group()))
        offsets.append((match.start(), match.end()))
        position = match.end()
    _sentencepiece_piece(backend, text, position, len(text), ids, offsets)
    return ids, offsets


def _sentencepiece_piece(backend, text: str, start: int, end: int, ids: list[int], offsets: list) -> None:
    """Encode ``text[start:end]`` with each piece's span, from sentencepiece's own (serialized) SentencePieceText."""
    if start >= end:
        return
    segment = text[start:end]
    try:
        serialized = backend.Encode(segment, return_type="serialized_proto")
    except TypeError:  # older sentencepiece
        serialized = backend.Encode(segment, out_type="serialized_proto")
    encoded = segment.encode("utf-8")
    chars = [0] * (len(encoded) + 1)  # byte offset -> character offset
    position = 0
    for index, ch in enumerate(segment):
        width = len(ch.encode("utf-8"))
        for k in range(width):
            chars[position + k] = index
        position += width
    chars[len(encoded)] = len(segment)
    for field, value in _protobuf_fields(serialized):
        if field == 2:  # SentencePiece {piece = 1, id = 2, surface = 3, begin = 4, end = 5}
            piece = dict(_protobuf_fields(value))
            ids.append(piece.get(2, 0))
            offsets.append((start + chars[min(piece.get(4, 0), len(encoded))], start + chars[min(piece.get(5, 0), len(encoded))]))


def _protobuf_fields(data: bytes):
    """(field number, value) of a serialized protobuf message: varints as ints, length-delimited as bytes."""
    def varint(position: int) -> tuple[int, int]:
        result = shift = 0
        while True:
            byte = data[position]
            result |= (byte & 0x7F) << shift
            position += 1
            if byte < 0x80:
                return result, position
            shift += 7

    position = 0
    while position < len(data):
        key, position = varint(position)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, position = varint(position)
        elif wire == 2:
            length, position = varint(position)
            value, position = data[position:position + length], position + length
        elif wire == 5:
            value, position = data[position:position + 4], position + 4
        elif wire == 1:
            value, position = data[position:position + 8], position + 8
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        yield field, value
