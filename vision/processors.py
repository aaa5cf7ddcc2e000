"""One interface over the families' image processors, so that one dataset (``training.vision_chat_dataset``) and one
collate (``training.collate.vision_collate``) serve every vision-language family, each tokenized as its Hugging Face
processor tokenizes it.

The families differ in what an image becomes, and the interface says only that: the chat template writes a
``placeholder`` per image; the processor replaces each, in the TEXT and before tokenizing, by that image's
``expansion`` (Gemma 3: a fixed sequence, the same for every image; Qwen3.5: ``<|image_pad|>`` repeated by the image's
patch grid, so by its size); the model takes ``model_inputs`` of the images (``pixel_values``, and Qwen's
``image_grid_thw``) and the token types under the family's own name (``token_type_ids`` or ``mm_token_type_ids``),
1 on the image tokens. ``image_only_tokens`` and ``expected_counts`` let a dataset refuse text that holds image tokens
of its own (the model would take a text token for an image's), and ``image_end_id`` lets it never cut an image's
tokens short.

:func:`image_processor_for` picks the family's class from the checkpoint's own files, as transformers'
``AutoProcessor`` would: ``processor_config.json``'s or ``preprocessor_config.json``'s ``processor_class``, else
the image processor's ``image_processor_type``, else ``config.json``'s ``model_type``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from PIL import Image

from waypoint.vision.processor_files import MODEL_CONFIG, PREPROCESSOR_CONFIG, PROCESSOR_CONFIG, read_json
# What each field's value says of the family ("gemma3" or "qwen"); a prefix matches the Fast and Pil variants too.
PROCESSOR_CLASSES = {"Gemma3Processor": "gemma3", "Gemma4Processor": "gemma4", "Qwen3VLProcessor": "qwen"}
IMAGE_PROCESSOR_TYPES = {"Gemma3ImageProcessor": "gemma3", "Gemma4ImageProcessor": "gemma4", "Qwen2VLImageProcessor": "qwen"}
MODEL_TYPES = {"gemma3": "gemma3", "gemma4": "gemma4", "qwen3_5": "qwen", "qwen3_5_moe": "qwen"}


@runtime_checkable
class ImageProcessor(Protocol):
    """What a dataset needs of a family's processor (see the module doc).

    Attributes:
        placeholder: the text the chat template writes where an image goes, which :meth:`expansion` replaces.
        image_token: the tokens the model puts the image's features at, as text; ``image_token_id`` their id.
        image_end_id: the id of the token that closes an image's tokens (a cut before it cuts the image).
        token_type_key: the model input the token types go by (``token_type_ids``, ``mm_token_type_ids``).
        image_only_tokens: the tokens, as text, and their ids, that only an image's own tokens may hold.
    """

    placeholder: str
    image_token: str
    image_token_id: int
    image_end_id: int
    token_type_key: str
    image_only_tokens: dict[str, int]

    def expansion(self, image: Image.Image) -> str:
        """The text one placeholder becomes for ``image`` (decoded, as the processor is given it)."""

    def expected_counts(self, n_images: int, n_image_tokens: int) -> dict[str, int]:
        """How many of each of ``image_only_tokens`` a conversation with these images holds, when none is its text's."""

    def model_inputs(self, images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        """The processor's image tensors for ``images``, in order (none: empty tensors of the right shape)."""

    def token_types(self, ids: Sequence[int]) -> list[int]:
        """The processor's token types of one sequence: 1 on the image tokens, 0 on text."""


def image_processor_for(checkpoint_dir: str | Path, tokenizer) -> ImageProcessor:
    """The image processor of the checkpoint (or processor) folder ``checkpoint_dir``, its settings read from there,
    its tokens checked against ``tokenizer``; a ``ValueError`` of one line when the folder names no family this
    knows."""
    directory = Path(checkpoint_dir)
    family, why = _family(directory)
    if family == "gemma3":
        from waypoint.vision.gemma3_images import Gemma3Images
        return Gemma3Images.from_checkpoint(directory, tokenizer)
    if family == "qwen":
        from waypoint.vision.qwen_images import QwenImages
        return QwenImages.from_checkpoint(directory, tokenizer)
    if family == "gemma4":
        from waypoint.vision.gemma4_images import Gemma4Images
        return Gemma4Images.from_checkpoint(directory, tokenizer)
    if why:
        raise ValueError(f"{directory}: {why}: no image processor for it here (Gemma 3: Gemma3Processor; Gemma 4: "
                         "Gemma4Processor; Qwen3.5 and Qwen3.6: Qwen3VLProcessor)")
    raise ValueError(f"{directory}: no {PROCESSOR_CONFIG}, {PREPROCESSOR_CONFIG} or {MODEL_CONFIG} names the model's "
                     "processor; is this a vision-language checkpoint?")


def _family(directory: Path) -> tuple[str | None, str | None]:
    """The family the first field present names (``(None, what it says)`` when it names another; ``(None, None)``
    when none is present)."""
    processor, preprocessor = read_json(directory / PROCESSOR_CONFIG), read_json(directory / PREPROCESSOR_CONFIG)
    nested = processor.get("image_processor") if isinstance(processor.get("image_processor"), dict) else {}
    model = read_json(directory / MODEL_CONFIG)
    fields = [(PROCESSOR_CONFIG, "processor_class", processor, PROCESSOR_CLASSES),
              (PREPROCESSOR_CONFIG, "processor_class", preprocessor, PROCESSOR_CLASSES),
              (f"{PROCESSOR_CONFIG} (image_processor)", "image_processor_type", nested, IMAGE_PROCESSOR_TYPES),
              (PREPROCESSOR_CONFIG, "image_processor_type", preprocessor, IMAGE_PROCESSOR_TYPES),
              (MODEL_CONFIG, "model_type", model, MODEL_TYPES)]
    for file, field, config, known in fields:
        value = config.get(field)
        if value is None:
            continue
        family = (known.get(value) if field == "model_type"
                  else next((f for name, f in known.items() if str(value).startswith(name)), None))
        return family, None if family else f"{file}'s {field} is {value!r}"
    return None, None
