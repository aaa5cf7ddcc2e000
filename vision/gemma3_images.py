"""Gemma 3's images as ``transformers.Gemma3Processor`` makes them, without transformers: pixel values equal to its
PIL image processor's (``Gemma3ImageProcessorPil``), and the prompt's image placeholders expanded as the processor
expands them.

Pixel values: each RGB image resized to the configured ``size`` with PIL (``resample``, bilinear by default), then
``x * rescale_factor`` computed in float64 and rounded to float32, then ``(x - mean) / std`` in float32, the
operations and their order and precision those of ``transformers.image_transforms``, so the values are equal to
the bit. Pan-and-scan (extra crops of wide images, off by default) is not done: a checkpoint that turns it on is
refused.

Text: the chat template writes ``<start_of_image>`` (boi) where an image goes; the processor replaces each with
``"\\n\\n" + boi + image_token * image_seq_length + eoi + "\\n\\n"`` before tokenizing, so the blank lines tokenize
with the text around them, and ``token_type_ids`` is 1 exactly on the ``image_token`` ids (where the model puts the
vision tower's output). The settings are read as transformers reads them: the image processor's from
``processor_config.json``'s ``image_processor`` (transformers 5 writes it there), else from
``preprocessor_config.json``; ``image_seq_length`` from ``processor_config.json`` (256 when absent, the
processor's default); the three tokens' names from ``tokenizer_config.json`` (``boi_token``, ``image_token``,
``eoi_token``, at the top or in ``extra_special_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from waypoint.vision.image_files import MAX_PIXELS, convert_to_rgb
from waypoint.vision.pixel_transforms import rescale_and_normalize
from waypoint.vision.processor_files import (PROCESSOR_CONFIG, image_processor_settings, over_pixel_limit, read_json,
                                             single_id, token_names)

TOKENIZER_CONFIG = "tokenizer_config.json"
# Gemma3ImageProcessorPil's class defaults: what a null or missing field means.
DEFAULTS = {"size": {"height": 224, "width": 224}, "resample": 2, "rescale_factor": 1 / 255,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True,
            "do_normalize": True, "do_convert_rgb": True, "do_pan_and_scan": False}
DEFAULT_IMAGE_SEQ_LENGTH = 256  # Gemma3Processor's default
DEFAULT_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


class Gemma3Images:
    """Pixel values and image tokens of a Gemma 3 checkpoint (see the module doc); a
    ``waypoint.vision.processors.ImageProcessor``: every image's placeholder (boi) becomes the same sequence.

    Args:
        config: the image processor's settings (``size``, ``resample``, ``rescale_factor``, ``image_mean``,
            ``image_std``, ``do_resize``, ``do_rescale``, ``do_normalize``, ``do_convert_rgb``,
            ``do_pan_and_scan``); a missing or null one takes the processor's default.
        image_seq_length: image tokens per image.
        tokens: ``{"boi_token", "image_token", "eoi_token"}``, the three tokens as text.
        tokenizer: a ``waypoint.text.tokenizer.Tokenizer``; each of the three must be one token of it.
        source: where the settings came from, named in errors.
    """

    def __init__(self, config: dict, image_seq_length: int, tokens: dict[str, str], tokenizer,
                 source: str = "the image processor") -> None:
        self.source = source
        setting = {key: default if config.get(key) is None else config[key] for key, default in DEFAULTS.items()}
        if setting["do_pan_and_scan"]:
            raise ValueError(f"{source}: do_pan_and_scan is true; pan-and-scan crops are not supported: set it to "
                             "false (the default)")
        for key in ("do_resize", "do_convert_rgb"):
            if setting[key] is not True:
                raise ValueError(f"{source}: {key} is {setting[key]!r}; only true is supported (Gemma 3's vision "
                                 "tower takes RGB images of one size)")
        self.height, self.width = _size(setting["size"], source)
        if self.height * self.width > MAX_PIXELS:  # every image is resized to it: refused before one is
            raise over_pixel_limit(source, f"size {json.dumps(setting['size'])}", self.height * self.width,
                                   "set it to the vision tower's input size (Gemma 3's: "
                                   '{"height": 896, "width": 896})')
        self.resample = setting["resample"]
        if not isinstance(self.resample, int) or not 0 <= self.resample <= 5:
            raise ValueError(f"{source}: resample must be a PIL filter number 0-5, got {self.resample!r}")
        self.rescale_factor = _number(setting["rescale_factor"], "rescale_factor", source)
        self.mean = _channels(setting["image_mean"], "image_mean", source)
        self.std = _channels(setting["image_std"], "image_std", source)
        self.do_rescale, self.do_normalize = bool(setting["do_rescale"]), bool(setting["do_normalize"])
        self.image_seq_length = _seq_length(image_seq_length, source)
        self.boi_token, self.image_token, self.eoi_token = (tokens[k] for k in ("boi_token", "image_token", "eoi_token"))
        self.boi_token_id, self.image_token_id, self.eoi_token_id = (
            single_id(tokenizer, tokens[k], k, source, "Gemma 3") for k in ("boi_token", "image_token", "eoi_token"))
        self.full_image_sequence = (f"\n\n{self.boi_token}{self.image_token * image_seq_length}"
                                    f"{self.eoi_token}\n\n")
        # the ImageProcessor interface
        self.placeholder, self.image_end_id, self.token_type_key = self.boi_token, self.eoi_token_id, "token_type_ids"
        self.image_only_tokens = {self.boi_token: self.boi_token_id, self.image_token: self.image_token_id,
                                  self.eoi_token: self.eoi_token_id}

    @classmethod
    def from_checkpoint(cls, directory: str | Path, tokenizer) -> "Gemma3Images":
        """The settings of the checkpoint (or processor) folder ``directory``, read as transformers reads them."""
        directory = Path(directory)
        processor = read_json(directory / PROCESSOR_CONFIG)
        config, source = image_processor_settings(directory)
        kind = processor.get("processor_class") or config.get("processor_class")
        if kind not in (None, "Gemma3Processor"):
            raise ValueError(f"{source}: processor_class is {kind!r}, not Gemma3Processor")
        image_processor = config.get("image_processor_type")
        if image_processor is not None and not str(image_processor).startswith("Gemma3ImageProcessor"):
            raise ValueError(f"{source}: image_processor_type is {image_processor!r}, not Gemma3ImageProcessor")
        seq_length = processor.get("image_seq_length")
        if seq_length is not None:  # named where it is read
            _seq_length(seq_length, str(directory / PROCESSOR_CONFIG))
        tokens = token_names(read_json(directory / TOKENIZER_CONFIG), DEFAULT_TOKENS)
        return cls(config, DEFAULT_IMAGE_SEQ_LENGTH if seq_length is None else seq_length, tokens, tokenizer, source)

    def pixel_values(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """float32 [len(images), 3, height, width]: the processor's ``pixel_values`` for these images."""
        arrays = [self._pixels(image) for image in images]
        if not arrays:
            return torch.zeros((0, 3, self.height, self.width), dtype=torch.float32)
        return torch.from_numpy(np.stack(arrays))

    def _pixels(self, image: Image.Image) -> np.ndarray:
        image = convert_to_rgb(image)  # also an RGB image with a transparent colour (a PNG's tRNS), as HF's does
        image = image.resize((self.width, self.height), resample=self.resample)
        pixels = np.asarray(image)  # [H, W, 3] uint8
        pixels = rescale_and_normalize(pixels, self.rescale_factor if self.do_rescale else None,
                                       self.mean if self.do_normalize else None, self.std)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)

    def expand(self, text: str, n_images: int | None = None, where: str = "") -> str:
        """``text`` with each boi token replaced by the full image sequence; a ``ValueError`` of one line (naming
        ``where``) when ``n_images`` is given and the text has another number of boi tokens."""
        parts = text.split(self.boi_token)
        if n_images is not None and len(parts) - 1 != n_images:
            at = f"{where}: " if where else ""
            raise ValueError(f"{at}the rendered conversation has {len(parts) - 1} image placeholder(s) "
                             f"({self.boi_token}) for {n_images} image(s): give one image per {{\"type\": \"image\"}} "
                             "part, and no image token in the text")
        return self.full_image_sequence.join(parts)

    def token_type_ids(self, ids: Sequence[int]) -> list[int]:
        """1 on the image-token ids, 0 elsewhere: the processor's ``token_type_ids``."""
        image = self.image_token_id
        return [1 if i == image else 0 for i in ids]

    token_types = token_type_ids

    def expansion(self, image: Image.Image) -> str:
        """What one boi token becomes: the full image sequence, whatever the image."""
        return self.full_image_sequence

    def expected_counts(self, n_images: int, n_image_tokens: int) -> dict[str, int]:
        """A boi and an eoi per image, and its image tokens."""
        return {self.boi_token: n_images, self.image_token: n_image_tokens, self.eoi_token: n_images}

    def model_inputs(self, images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        """``{"pixel_values"}``: :meth:`pixel_values`."""
        return {"pixel_values": self.pixel_values(images)}


def _size(size, source: str) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        size = {"height": size, "width": size}
    if not isinstance(size, dict) or set(size) != {"height", "width"} or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size.values()):
        raise ValueError(f"{source}: size must be {{\"height\": H, \"width\": W}} (positive integers), got {size!r}")
    return size["height"], size["width"]


def _seq_length(value, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: image_seq_length must be a positive integer, got {value!r}")
    if value > MAX_PIXELS:  # each image's text holds that many tokens, made before any image is read
        raise ValueError(f"{source}: image_seq_length {value:,} is more tokens than an image may have pixels "
                         f"({MAX_PIXELS:,}); set it to the vision tower's tokens per image (Gemma 3's: 256)")
    return value


def _number(value, name: str, source: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{source}: {name} must be a number, got {value!r}")
    return float(value)


def _channels(value, name: str, source: str) -> list[float]:
    values = [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple)) or len(values) != 3:
        raise ValueError(f"{source}: {name} must be a number or 3 numbers (one per RGB channel), got {value!r}")
    values = [_number(v, name, source) for v in values]
    if name == "image_std" and any(v == 0 for v in values):
        raise ValueError(f"{source}: image_std has a 0 (division by zero)")
    return values
