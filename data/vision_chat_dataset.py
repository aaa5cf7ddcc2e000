"""Conversations with images (TRL's vision format) for a vision-language checkpoint (Gemma 3, Qwen3.5 / Qwen3.6),
tokenized as the family's Hugging Face processor (``Gemma3Processor``, ``Qwen3VLProcessor``) tokenizes them.

A record is ``{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}], "images": ["red.png"]}``: ``images`` holds one
image per ``{"type": "image"}`` part, in order (a path, relative to the data file's folder; bytes; or ``{"bytes",
"path"}`` as parquet files of the ``datasets`` Image feature hold them); an image part may carry its own
(``{"type": "image", "image": ...}``). As TRL does, a content may be a plain string, and when no message has image
parts the images go before the text of the first user message. Records come from a ``.json``, ``.jsonl`` or
``.parquet`` file or a directory of them (``waypoint.data.records``); ``columns`` names other fields.

The conversation is rendered with the checkpoint's chat template, given the list-of-parts contents as TRL gives
them to transformers (the assistant's text parts joined into one string, which the template must render the same,
so that its turns are found as ``waypoint.text.chat_template`` finds them); each image's placeholder is then
expanded in the TEXT, before tokenizing, as the processor does, by the family's ``ImageProcessor``
(``waypoint.vision.processors``: Gemma 3's ``<start_of_image>`` becomes the full image sequence, whose blank lines
tokenize together with the text around them; Qwen's ``<|image_pad|>`` one per merged patch, so as many as that
image's size gives), the assistant turns shifted by each image's own growth, and the text is tokenized. An item is
``{"tokens", "labels"}``, labels -100 outside the assistant turns (``train_on_input``: none), plus the processor's
image tensors (``pixel_values``, float32: Gemma 3's [images, 3, H, W], Qwen's patches [patches, C*T*P*P] with
``image_grid_thw`` [images, 3]) and its token types under its own name (``token_type_ids``, ``mm_token_type_ids``),
1 on the image tokens.

Every image is read, decoded and checked when the dataset is built, so a missing or broken one stops the run
before its first step, in one line naming the file, record and image (``skip_bad_records`` counts the record
out). Items re-read their images (pixel values of a 896 x 896 image are 9.6 MB; the dataset keeps only the paths or
the compressed bytes). Cutting to ``max_seq_len`` never cuts inside an image's tokens: a record whose images do
not all fit, up to the token that closes the last, is refused (the model would get an image with some of its
tokens, or none).
"""

from __future__ import annotations

import bisect
from collections import Counter
from itertools import accumulate
from pathlib import Path

from torch.utils.data import Dataset

from waypoint.text.chat_template import ChatTemplate, load_chat_template, spans_to_mask
from waypoint.data.chat_dataset import ROLES
from waypoint.data.records import Record, Skipped, column_names, converted
from waypoint.data.tokenized import TokenizedRecords
from waypoint.vision.image_files import MAX_PIXELS, load_image
from waypoint.vision.processors import ImageProcessor, image_processor_for

COLUMN_KEYS = ("messages", "role", "content", "images")


class VisionChatDataset(Dataset):
    """Image-and-text conversations from a local file (or directory), for a vision-language checkpoint.

    Args:
        source: the data file, or a directory of data files.
        tokenizer: a ``waypoint.text.tokenizer.Tokenizer`` (``load_tokenizer(checkpoint_dir)``).
        max_seq_len: items are cut to this many tokens (never inside an image's tokens).
        images: the checkpoint's image processor (``waypoint.vision.processors.ImageProcessor``); None:
            ``image_processor_for`` the tokenizer's checkpoint folder.
        train_on_input: supervise every token, not only the assistant turns.
        template: None for the checkpoint's own chat template; else a built-in name or a ``.jinja`` file.
        columns: field names of other layouts: ``messages``, ``role``, ``content``, ``images``.
        skip_bad_records: leave malformed records (bad images included) out, counted and noted once.
        max_image_pixels: an image with more pixels is refused before it is decoded.
    """

    def __init__(self, source: str | Path, tokenizer, max_seq_len: int, images: ImageProcessor | None = None,
                 train_on_input: bool = False, template: str | None = None, columns: dict[str, str] | None = None,
                 skip_bad_records: bool = False, max_image_pixels: int = MAX_PIXELS) -> None:
        self.columns = column_names(columns, COLUMN_KEYS)
        self.source = Path(source)
        self.tokenizer = tokenizer
        if images is None:
            if getattr(tokenizer, "directory", None) is None:
                raise ValueError(f"{self.source}: the tokenizer was not read from a checkpoint folder, so its image "
                                 "processor is unknown; pass images=image_processor_for(folder, tokenizer)")
            images = image_processor_for(tokenizer.directory, tokenizer)
        self.images = images
        self.max_image_pixels = max_image_pixels
        self.items = TokenizedRecords(max_seq_len, train_on_input)
        self.template: ChatTemplate = load_chat_template(tokenizer, template)
        self._image_sources: list[tuple[list, Path]] = []  # per item: its images' sources, and their folder
        skipped = Skipped()
        for where, (tokens, mask, sources, root) in converted(self.source, self._encode, skip_bad_records, skipped):
            self.items.add(tokens, mask, where)
            self._image_sources.append((sources, root))
        self.skipped = skipped.count
        if self.skipped:
            print(f"note: {self.source}: skipped {self.skipped} malformed record(s) (skip_bad_records); first: {skipped.first}")
        if not len(self.items):
            raise ValueError(f"{self.source}: no usable conversations")

    def _encode(self, record: Record, where: str) -> tuple[list[int], list[int], list, Path]:
        """A record's token ids, assistant mask and image sources, its images checked (see the module doc)."""
        as_trl, as_rendered, sources = self._conversation(record.data, where)
        text, spans = self.template.assistant_spans(as_rendered)
        if self.template.render(as_trl) != text:
            raise ValueError(f"{where}: the chat template renders an assistant message's text parts differently from "
                             "their joined text; give the assistant's content as one string")
        images, root = self.images, record.file.parent
        placeholders = _find_all(text, images.placeholder)
        if len(placeholders) != len(sources):
            raise ValueError(f"{where}: the rendered conversation has {len(placeholders)} image placeholder(s) "
                             f"({images.placeholder}) for {len(sources)} image(s): give one image per "
                             "{\"type\": \"image\"} part, and no image token in the text")
        expansions = [self._expansion(source, f"{where}: image {number}", root)
                      for number, source in enumerate(sources, start=1)]
        pieces = text.split(images.placeholder)
        expanded = "".join(p for piece, grown in zip(pieces, expansions + [""]) for p in (piece, grown))
        shift = [0, *accumulate(len(e) - len(images.placeholder) for e in expansions)]  # before the k-th placeholder
        spans = [(a + shift[bisect.bisect_left(placeholders, a)], b + shift[bisect.bisect_left(placeholders, b)])
                 for a, b in spans]
        ids, offsets = self.tokenizer.encode_with_offsets(expanded)
        self._check_image_tokens(ids, len(sources), sum(e.count(images.image_token) for e in expansions), where)
        return ids, spans_to_mask(offsets, spans), sources, root

    def _expansion(self, source, where: str, root: Path) -> str:
        """The text the image's placeholder becomes; the image decoded in full (so checked), then let go."""
        image = load_image(source, where, root, self.max_image_pixels)
        try:
            return self.images.expansion(image)
        except ValueError as e:  # e.g. an aspect ratio Qwen's processor refuses
            raise ValueError(f"{where}: {e}") from None

    def _check_image_tokens(self, ids: list[int], n_images: int, n_image_tokens: int, where: str) -> None:
        """Each image's tokens all there, none outside them, and all within ``max_seq_len``."""
        images = self.images
        found = Counter(ids)
        counts = {name: found[token] for name, token in images.image_only_tokens.items()}
        if counts != images.expected_counts(n_images, n_image_tokens):
            names = list(images.image_only_tokens)
            raise ValueError(f"{where}: the text holds image tokens ({', '.join(names[:-1])} or {names[-1]}) outside "
                             "the images' own; write images as {\"type\": \"image\"} parts")
        cut = self.items.max_seq_len
        ends = [p for p, i in enumerate(ids) if i == images.image_end_id]
        if ends and ends[-1] >= cut:
            first = next(k for k, end in enumerate(ends) if end >= cut)
            raise ValueError(f"{where}: image {first + 1} of {n_images} does not fit in max_seq_len={cut} (its tokens end "
                             f"at token {ends[first] + 1} of {len(ids)}) and an image is never cut; raise max_seq_len or "
                             "shorten the conversation")

    def _conversation(self, data, where: str) -> tuple[list[dict], list[dict], list]:
        """The record's messages as TRL gives them to the template (every content a list of parts), the same with
        the assistant's text parts joined, and the sources of its images in order."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        field, images_key = self.columns.get("messages", "messages"), self.columns.get("images", "images")
        role_key, content_key = self.columns.get("role", "role"), self.columns.get("content", "content")
        if field not in data:
            raise ValueError(f"{where}: missing key {field!r} (set columns.messages for another name)")
        turns = data[field]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: {field!r} must be a non-empty list of messages")
        images = data.get(images_key)
        if images is None and "images" not in self.columns and data.get("image") is not None:
            images = [data["image"]]  # TRL's single-image records
        images = [] if images is None else images
        if not isinstance(images, list):
            raise ValueError(f"{where}: {images_key!r} must be a list of images (paths, bytes or {{\"bytes\", \"path\"}}), "
                             f"got {type(images).__name__}")
        messages = [_read_message(turn, n, where, role_key, content_key) for n, turn in enumerate(turns, start=1)]
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no assistant message (nothing to train on)")
        if images and not any(p["type"] == "image" for m in messages for p in m["content"]):
            first_user = next((m for m in messages if m["role"] == "user" and m.get("plain")), None)
            if first_user is not None:  # TRL: the images go before the first user message's text
                first_user["content"] = [{"type": "image"} for _ in images] + first_user["content"]
        unfilled = sum(1 for m in messages for p in m["content"] if p["type"] == "image" and "source" not in p)
        if unfilled != len(images):
            raise ValueError(f"{where}: {len(images)} image(s) in {images_key!r} for {unfilled} image part(s) (without "
                             "an image of their own): give one image per {\"type\": \"image\"} part, in order")
        pending, sources = iter(images), []
        for message in messages:
            message.pop("plain", None)
            for part in message["content"]:
                if part["type"] == "image":
                    sources.append(part.pop("source") if "source" in part else next(pending))
        rendered = [dict(m, content="".join(p["text"] for p in m["content"])) if m["role"] == "assistant" else m
                    for m in messages]
        return messages, rendered, sources

    @property
    def prompt_format(self) -> ChatTemplate:
        """The template conversations were rendered with: the output's, so it is prompted as it trained."""
        return self.template

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        item = self.items[index]
        sources, root = self._image_sources[index]
        where = self.items.where[index]
        decoded = [load_image(s, f"{where}: image {n}", root, self.max_image_pixels) for n, s in enumerate(sources, 1)]
        images = self.images
        return {**item, **images.model_inputs(decoded), images.token_type_key: images.token_types(item["tokens"])}


def _read_message(turn, number: int, where: str, role_key: str, content_key: str) -> dict:
    """One message as ``{"role", "content": [parts]}`` (``plain``: its content was a string); image parts carry
    their own image, when they have one, as ``source``."""
    at = f"{where}: message {number}"
    if not isinstance(turn, dict):
        raise ValueError(f"{at}: expected an object, got {type(turn).__name__}")
    for key in (role_key, content_key):
        if key not in turn:
            raise ValueError(f"{at}: missing key {key!r}")
    role, content = turn[role_key], turn[content_key]
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"{at}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    role = ROLES[role]
    if isinstance(content, str):
        return {"role": role, "content": [{"type": "text", "text": content}], "plain": True}
    if not isinstance(content, list):
        raise ValueError(f"{at}: {content_key!r} must be a string or a list of parts, got {type(content).__name__}")
    parts = []
    for n, part in enumerate(content, start=1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{at}: part {n}: a text part needs 'text' (a string)")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            if role == "assistant":
                raise ValueError(f"{at}: part {n}: an image in an assistant message (the model reads images, it does "
                                 "not write them): move it to a user message")
            own = part.get("image")
            parts.append({"type": "image", "source": own} if own is not None else {"type": "image"})
        else:
            raise ValueError(f"{at}: part {n}: expected {{\"type\": \"text\" | \"image\", ...}}, got {part!r:.80}")
    return {"role": role, "content": parts}


def _find_all(text: str, token: str) -> list[int]:
    """Where ``token`` starts in ``text``, left to right, not overlapping (as ``str.split`` finds it)."""
    found, at = [], text.find(token)
    while at >= 0:
        found.append(at)
        at = text.find(token, at + len(token))
    return found
