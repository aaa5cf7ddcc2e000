"""Images for Gemma 4 as its Hugging Face processor makes them (``Gemma4Processor`` over ``Gemma4ImageProcessorPil``).

:func:`preprocess` gives bitwise the image processor's outputs:

1. RGB: transparency composited onto white;
2. :func:`target_size`: the image scaled, keeping its aspect ratio, to the largest size of at most
   ``max_soft_tokens * k**2`` patches whose sides are multiples of ``k * patch_size`` (k = ``pooling_kernel_size``,
   so the tower pools whole blocks), by PIL with ``resample`` (bicubic); not resized when already that size;
3. rescale (``x * 1/255`` in float64, then float32); no normalization by default (the tower maps [0, 1] to [-1, 1]);
4. patchify: ``[h*w, P*P*C]`` in raster order, each patch's pixels row by row, channels innermost; ``(x, y)`` each
   patch's column and row; both padded to ``max_soft_tokens * k**2`` patches (zeros, positions -1).

``pixel_values`` [images, max patches, P*P*C] float32, ``image_position_ids`` [images, max patches, 2] int64 and
``num_soft_tokens_per_image`` [images]: an image's tokens, ``h*w / k**2``, so its size decides them.

The text side: the chat template writes ``<|image|>`` per image; the processor replaces the i-th by
``<|image>`` + ``<|image|>`` * (its tokens) + ``<image|>`` (:func:`expand`), and ``mm_token_type_ids`` is 1 on
``<|image|>`` (not on ``<|image>``/``<image|>``), 2 on ``<|video|>``, 3 on ``<|audio|>``, 0 elsewhere. The model
takes ``pixel_values`` and ``image_position_ids`` (the processor drops ``num_soft_tokens_per_image``).
:class:`Gemma4Images` puts the two together as a ``waypoint.vision.processors.ImageProcessor``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from waypoint.vision.image_files import MAX_PIXELS, convert_to_rgb
from waypoint.vision.pixel_transforms import rescale_and_normalize
from waypoint.vision.processor_files import (image_processor_settings, over_pixel_limit, read_json, single_id,
                                             token_names)

SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the max_soft_tokens the image processor accepts
# Gemma 4's tokens, unless tokenizer_config.json names others; the processor fixes the video token's name itself
DEFAULT_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                  "audio_token": "<|audio|>"}
VIDEO_TOKEN = "<|video|>"
TOKEN_TYPES = {"image_token": 1, "video_token": 2, "audio_token": 3}  # mm_token_type_ids


@dataclass(frozen=True)
class Gemma4ImageSettings:
    """A checkpoint's image processor settings, defaults those of ``Gemma4ImageProcessorPil``."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = False
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in SOFT_TOKENS:
            raise ValueError(f"max_soft_tokens must be one of {SOFT_TOKENS}, got {self.max_soft_tokens!r}")
        for name in ("patch_size", "pooling_kernel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        pixels = self.max_patches * self.patch_size ** 2  # pixel_values holds this many per image, whatever its size
        if pixels > MAX_PIXELS:
            raise over_pixel_limit(None, f"patch_size {self.patch_size} with pooling_kernel_size "
                                   f"{self.pooling_kernel_size} and max_soft_tokens {self.max_soft_tokens}", pixels,
                                   "set them to the vision tower's (Gemma 4's: patch_size 16, pooling_kernel_size 3)")

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2


def from_preprocessor_config(config: dict, source: str = "the image processor") -> Gemma4ImageSettings:
    """Settings from an image processor config dict; a missing or null field takes the default; a one-line
    ``ValueError`` naming ``source`` and the key for a value that cannot be used."""
    fields = {name: config[name] for name in ("patch_size", "max_soft_tokens", "pooling_kernel_size", "resample",
                                              "rescale_factor", "do_resize", "do_rescale", "do_normalize",
                                              "do_convert_rgb") if config.get(name) is not None}
    for name in ("image_mean", "image_std"):
        if (value := config.get(name)) is not None:
            fields[name] = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
    try:
        return Gemma4ImageSettings(**fields)
    except ValueError as e:  # the settings' own checks, which name the key but not the file
        raise ValueError(f"{source}: {e}") from None


def from_checkpoint(path: str | Path) -> Gemma4ImageSettings:
    """A checkpoint folder's settings, where transformers looks (``vision.processor_files.image_processor_settings``)."""
    return from_preprocessor_config(*image_processor_settings(path))


def target_size(height: int, width: int, patch_size: int, max_patches: int, kernel: int) -> tuple[int, int]:
    """The (height, width) an image is resized to (transformers' ``get_aspect_ratio_preserving_size``): scaled to
    ``max_patches`` patches' area, each side rounded down to a multiple of ``kernel * patch_size``; a side that
    rounds to 0 is one block, the other then ``floor(ratio)`` blocks (at most the budget's worth)."""
    target_px = max_patches * patch_size ** 2
    factor = math.sqrt(target_px / (height * width))
    side = kernel * patch_size
    h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise ValueError(f"a {width}x{height} image resizes to 0 x 0 (sides are multiples of {side})")
    longest = (max_patches // kernel ** 2) * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    if h * w > target_px:
        raise ValueError(f"a {width}x{height} image resizes to {w}x{h}, over {max_patches} patches of {patch_size}")
    return h, w


def image_to_patches(image: Image.Image, settings: Gemma4ImageSettings) -> tuple[np.ndarray, np.ndarray]:
    """One image -> (its patches [h*w, P*P*C] float32, their (x, y) [h*w, 2] int64), unpadded."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    s, p = settings, settings.patch_size
    pixels = np.array(convert_to_rgb(image) if s.do_convert_rgb else image)
    if pixels.dtype != np.uint8:  # transformers would rescale other depths first; not mirrored here
        raise ValueError(f"a {image.mode!r} image without do_convert_rgb: only 8-bit images are supported")
    pixels = pixels.reshape(*pixels.shape[:2], -1)
    height, width = pixels.shape[:2]
    if s.do_resize:
        size = target_size(height, width, p, s.max_patches, s.pooling_kernel_size)
        if size != (height, width):  # through an array as transformers goes
            array = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
            pixels = np.array(array.resize(size[::-1], resample=s.resample)).reshape(*size, -1)
            height, width = size
    block = p * s.pooling_kernel_size
    if height % block or width % block or height * width > s.max_patches * p * p:
        raise ValueError(f"a {width}x{height} image (do_resize is off) is not whole {block}-pixel blocks within "
                         f"{s.max_patches} patches: the tower could not pool it")
    pixels = rescale_and_normalize(pixels, s.rescale_factor if s.do_rescale else None,
                                   s.image_mean if s.do_normalize else None, s.image_std)
    rows, cols = height // p, width // p
    patches = pixels.reshape(rows, p, cols, p, -1).transpose(0, 2, 1, 3, 4).reshape(rows * cols, -1)
    x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    return patches, np.stack([x, y], axis=-1).reshape(rows * cols, 2)


def preprocess(images: Sequence[Image.Image], settings: Gemma4ImageSettings) -> dict[str, torch.Tensor]:
    """``pixel_values``, ``image_position_ids`` and ``num_soft_tokens_per_image`` (as the image processor's, with
    ``return_tensors="pt"``; see the module doc)."""
    processed = [image_to_patches(image, settings) for image in images]
    widths = {patches.shape[1] for patches, _ in processed} or {3 * settings.patch_size ** 2}
    if len(widths) > 1:  # transformers' np.stack fails too
        raise ValueError("images of different channel counts in one batch (do_convert_rgb is off)")
    pixel_values = np.zeros((len(images), settings.max_patches, widths.pop()), dtype=np.float32)
    positions = np.full((len(images), settings.max_patches, 2), -1, dtype=np.int64)
    for i, (patches, where) in enumerate(processed):
        pixel_values[i, :len(patches)], positions[i, :len(patches)] = patches, where
    counts = [len(patches) // settings.pooling_kernel_size ** 2 for patches, _ in processed]
    return {"pixel_values": torch.from_numpy(pixel_values), "image_position_ids": torch.from_numpy(positions),
            "num_soft_tokens_per_image": torch.tensor(counts, dtype=torch.int64)}


def image_token_count(image: Image.Image, settings: Gemma4ImageSettings) -> int:
    """The ``<|image|>`` tokens an image becomes (``Gemma4Processor._get_num_multimodal_tokens``, and what
    :func:`preprocess` gives it) without processing it: its resized patches over ``k**2``."""
    s, height, width = settings, image.height, image.width
    if s.do_resize:
        height, width = target_size(height, width, s.patch_size, s.max_patches, s.pooling_kernel_size)
    return (height // s.patch_size) * (width // s.patch_size) // s.pooling_kernel_size ** 2


def expand(text: str, counts: Sequence[int], tokens: dict[str, str] | None = None) -> str:
    """``text`` with its i-th image token replaced by boi + image token * ``counts[i]`` + eoi (the processor's
    expansion). For a batch, call it per text with that text's images' counts, in order."""
    t = {**DEFAULT_TOKENS, **(tokens or {})}
    parts = text.split(t["image_token"])
    if len(parts) - 1 != len(counts):
        raise ValueError(f"{len(parts) - 1} {t['image_token']} in the text for {len(counts)} images")
    out = [parts[0]]
    for count, part in zip(counts, parts[1:]):
        out += [t["boi_token"] + t["image_token"] * int(count) + t["eoi_token"], part]
    return "".join(out)


def mm_token_type_ids(input_ids: Sequence[int] | torch.Tensor, image_token_id: int, video_token_id: int | None = None,
                      audio_token_id: int | None = None) -> list[int]:
    """One sequence's ``mm_token_type_ids``: 1 at image tokens, 2 at video tokens, 3 at audio tokens, 0 elsewhere."""
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    types = {i: t for i, t in ((image_token_id, 1), (video_token_id, 2), (audio_token_id, 3)) if i is not None}
    return [types.get(i, 0) for i in ids]


class Gemma4Images:
    """The image processor of a Gemma 4 checkpoint as a ``waypoint.vision.processors.ImageProcessor``: an image's
    placeholder (``<|image|>``) becomes boi, as many ``<|image|>`` as the image has tokens (its size decides them,
    :func:`target_size`), eoi.

    Args:
        settings: the image processor's settings (:func:`from_checkpoint`).
        tokenizer: a ``waypoint.text.tokenizer.Tokenizer``; each of the tokens must be one token of it.
        tokens: ``{"image_token", "boi_token", "eoi_token", "audio_token"}`` as text, where the tokenizer names
            others than Gemma 4's.
        source: where the settings came from, named in errors.
    """

    token_type_key = "mm_token_type_ids"

    def __init__(self, settings: Gemma4ImageSettings, tokenizer, tokens: dict[str, str] | None = None,
                 source: str = "the image processor") -> None:
        self.settings, self.source = settings, source
        self.tokens = {**DEFAULT_TOKENS, **(tokens or {}), "video_token": VIDEO_TOKEN}
        ids = {key: single_id(tokenizer, text, key, source, "Gemma 4") for key, text in self.tokens.items()}
        self.placeholder = self.image_token = self.tokens["image_token"]
        self.image_token_id, self.image_end_id = ids["image_token"], ids["eoi_token"]
        self.image_only_tokens = {self.tokens[key]: ids[key] for key in self.tokens}
        self._types = {ids[key]: value for key, value in TOKEN_TYPES.items()}

    @classmethod
    def from_checkpoint(cls, directory: str | Path, tokenizer) -> "Gemma4Images":
        """The settings of the checkpoint (or processor) folder ``directory``, read as transformers reads them."""
        directory = Path(directory)
        tokens = token_names(read_json(directory / "tokenizer_config.json"), DEFAULT_TOKENS)
        return cls(from_checkpoint(directory), tokenizer, tokens, str(directory))

    def expansion(self, image: Image.Image) -> str:
        """What the image's ``<|image|>`` becomes: boi, one ``<|image|>`` per token, eoi."""
        return expand(self.placeholder, [image_token_count(image, self.settings)], self.tokens)

    def expected_counts(self, n_images: int, n_image_tokens: int) -> dict[str, int]:
        """A boi and an eoi per image, its image tokens, and no video's or audio's."""
        t = self.tokens
        return {t["boi_token"]: n_images, t["image_token"]: n_image_tokens, t["eoi_token"]: n_images,
                t["video_token"]: 0, t["audio_token"]: 0}

    def model_inputs(self, images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        """``{"pixel_values", "image_position_ids"}``: :func:`preprocess` (what the model takes of it)."""
        out = preprocess(images, self.settings)
        return {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}

    def token_types(self, ids: Sequence[int]) -> list[int]:
        """The processor's ``mm_token_type_ids``."""
        return [self._types.get(i, 0) for i in ids]
