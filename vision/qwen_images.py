"""Images for Qwen3.5 (and Qwen2-VL, Qwen3-VL: the same image processor) as its Hugging Face processor makes them.

transformers 5.x gives ``qwen3_5`` checkpoints ``Qwen2VLImageProcessor``; its PIL backend (``Qwen2VLImageProcessorPil``)
is the reference here, and :func:`preprocess` gives bitwise its ``pixel_values`` and ``image_grid_thw``:

1. RGB: transparency composited onto white (so a transparent pixel is white, not black);
2. :func:`smart_resize`: both sides rounded to a multiple of ``patch_size * merge_size`` (so the patches merge into
   whole tokens), then scaled as a whole into ``[min_pixels, max_pixels]``, by PIL with ``resample`` (bicubic);
3. rescale (``x * 1/255`` in float64, then float32, as transformers), normalize (``(x - mean) / std`` in float32);
4. patchify: ``[patches, C*T*P*P]``, the single image repeated over the ``temporal_patch_size`` frames of a patch,
   patches ordered by ``merge x merge`` block (raster within a block), so the tower's merger takes consecutive ones.

The text side (``Qwen3VLProcessor``): the chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` per
image; the processor repeats each ``<|image_pad|>`` as many times as that image has tokens (:func:`expand`), and
``mm_token_type_ids`` marks those tokens 1 (video 2, text 0; :func:`mm_token_type_ids`). :class:`QwenImages` puts
the two together as a ``waypoint.vision.processors.ImageProcessor``, for the vision datasets.
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

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # what Qwen3.5's chat template writes per image
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2VLImageProcessor's defaults
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Qwen3VLProcessor's tokens, unless the tokenizer names others (tokenizer_config.json, as transformers reads it)
DEFAULT_TOKENS = {"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN, "vision_start_token": "<|vision_start|>",
                  "vision_end_token": "<|vision_end|>"}


@dataclass(frozen=True)
class QwenImageSettings:
    """A checkpoint's ``preprocessor_config.json``, defaults those of ``Qwen2VLImageProcessor`` (Qwen3.5's own
    files set ``patch_size`` 16, mean and std 0.5 and their pixel bounds)."""

    min_pixels: int = 56 * 56  # size.shortest_edge: a bound on the pixel count, not an edge
    max_pixels: int = 28 * 28 * 1280  # size.longest_edge, the same
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: a whole number of merged tokens."""
        return self.patch_size * self.merge_size


def from_preprocessor_config(config: dict, source: str = "the image processor") -> QwenImageSettings:
    """Settings from a ``preprocessor_config.json`` dict: ``min_pixels``/``max_pixels`` override ``size``'s
    ``shortest_edge``/``longest_edge``, as in transformers' ``__init__``; checked (:func:`check_settings`), each
    problem a one-line ``ValueError`` naming ``source`` and the key as the file has it."""
    size = config.get("size") or {}
    if not isinstance(size, dict):
        raise ValueError(f"{source}: size must be {{\"shortest_edge\": MIN, \"longest_edge\": MAX}} (pixel counts, "
                         f"not edges), got {size!r}")
    bounds, keys = {}, {}
    for name, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if config.get(name) is not None:
            bounds[name] = config[name]
        elif size.get(edge) is not None:
            bounds[name], keys[name] = size[edge], f'size["{edge}"]'
    fields = {name: config[name] for name in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor",
                                              "resample", "do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
              if config.get(name) is not None}
    for name in ("image_mean", "image_std"):
        if (value := config.get(name)) is not None:
            fields[name] = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
    return check_settings(QwenImageSettings(**bounds, **fields), source, keys)


def from_checkpoint(path: str | Path) -> QwenImageSettings:
    """A checkpoint folder's settings, where transformers looks (``vision.processor_files.image_processor_settings``)."""
    return from_preprocessor_config(*image_processor_settings(path))


def check_settings(settings: QwenImageSettings, source: str, keys: dict[str, str] | None = None) -> QwenImageSettings:
    """``settings``, or a one-line ``ValueError`` naming ``source`` and the key (``keys``: a field's key in the file
    where it is not the field's name) when a size is not a positive integer or makes images past the limit on
    images read (``vision.image_files.MAX_PIXELS``): the pixel values hold ``temporal_patch_size`` copies of each
    image, resized to at most :func:`largest_resize` pixels. Checked before any image is, so that none is resized
    to a size that cannot be held."""
    s, key = settings, {name: (keys or {}).get(name, name) for name in ("min_pixels", "max_pixels")}
    for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
        value = getattr(s, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{source}: {key.get(name, name)} must be a positive integer, got {value!r}")
    for name in ("min_pixels", "max_pixels"):
        if getattr(s, name) > MAX_PIXELS:
            raise over_pixel_limit(source, f"{key[name]} {getattr(s, name):,}", getattr(s, name),
                                   f"set it to at most {MAX_PIXELS:,} (Qwen3.5's: 65,536 to 16,777,216)")
    if s.min_pixels > s.max_pixels:
        raise ValueError(f"{source}: {key['min_pixels']} {s.min_pixels} is over {key['max_pixels']} {s.max_pixels}")
    largest = largest_resize(s.factor, s.min_pixels, s.max_pixels)
    if largest > MAX_PIXELS:
        raise over_pixel_limit(source, f"patch_size {s.patch_size} x merge_size {s.merge_size} (sides in multiples of "
                               f"{s.factor}) with {key['max_pixels']} {s.max_pixels:,}", largest,
                               "set them to the vision tower's (Qwen3.5's: 16 and 2)")
    if s.temporal_patch_size * largest > MAX_PIXELS:
        raise over_pixel_limit(source, f"temporal_patch_size {s.temporal_patch_size} (copies of each image in its "
                               f"pixel values) with {key['max_pixels']} {s.max_pixels:,}",
                               s.temporal_patch_size * largest, "set temporal_patch_size to the vision tower's "
                               f"(Qwen3.5's: 2) and {key['max_pixels']} to at most "
                               f"{MAX_PIXELS // s.temporal_patch_size:,}")
    return settings


def largest_resize(factor: int, min_pixels: int, max_pixels: int) -> int:
    """A bound on the pixels of any image :func:`smart_resize` gives (its aspect ratio at most 200): ``max_pixels``,
    unless a long thin image's short side rounds up to one ``factor`` (at most ``factor`` x its long side, sqrt(200
    max_pixels)), or an upscale to ``min_pixels`` rounds both sides up by under ``factor`` each."""
    long_side, short_side = math.isqrt(200 * min_pixels) + 1, math.isqrt(min_pixels // 200) + 1
    upscaled = min_pixels + factor * (long_side + short_side) + factor ** 2
    return max(max_pixels, factor * max(factor, math.isqrt(200 * max_pixels) + 1), upscaled)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: each side the nearest multiple of ``factor``; if that is over
    ``max_pixels`` (or under ``min_pixels``) both sides scaled down (up) by one ratio, rounded down (up) to multiples
    of ``factor``, so the aspect ratio is kept as nearly as multiples allow (transformers' ``smart_resize``)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_to_patches(image: Image.Image, settings: QwenImageSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image -> (its patches [t*h*w, C*T*P*P] float32, its grid (t, h, w) in patches; t is 1)."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    s = settings
    pixels = np.array(convert_to_rgb(image) if s.do_convert_rgb else image)
    if pixels.dtype != np.uint8:  # transformers would rescale other depths first; not mirrored here
        raise ValueError(f"a {image.mode!r} image without do_convert_rgb: only 8-bit images are supported")
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if s.do_resize:
        height, width = smart_resize(pixels.shape[0], pixels.shape[1], s.factor, s.min_pixels, s.max_pixels)
        # through an array as transformers goes (so a palette image without do_convert_rgb resizes its indices, as there)
        resized = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels).resize((width, height), resample=s.resample)
        pixels = np.array(resized).reshape(height, width, -1)
    pixels = rescale_and_normalize(pixels, s.rescale_factor if s.do_rescale else None,
                                   s.image_mean if s.do_normalize else None, s.image_std)
    height, width, channels = pixels.shape
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    if height % s.factor or width % s.factor:
        raise ValueError(f"a {width}x{height} image does not split into whole {s.factor}-pixel blocks (do_resize is off)")
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))  # [.., C, T, P, P]
    return frames.reshape(grid_h * grid_w, channels * t * p * p), (1, grid_h, grid_w)


def preprocess(images: Sequence[Image.Image], settings: QwenImageSettings) -> dict[str, torch.Tensor]:
    """``pixel_values`` [all patches, C*T*P*P] float32 and ``image_grid_thw`` [images, 3] int64, the images' patches
    one after another (as the processor's, with ``return_tensors="pt"``)."""
    patches, grids = zip(*(image_to_patches(image, settings) for image in images))
    return {"pixel_values": torch.from_numpy(np.concatenate(patches, axis=0)),
            "image_grid_thw": torch.tensor(grids, dtype=torch.int64)}


def image_token_count(grid_thw: Sequence[int] | torch.Tensor, merge_size: int) -> int:
    """The ``<|image_pad|>`` tokens an image becomes: its patches over the ``merge x merge`` merged into one."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // merge_size ** 2


def expand(text: str, grids: Sequence[Sequence[int]] | torch.Tensor, merge_size: int, image_token: str = IMAGE_TOKEN) -> str:
    """``text`` with its i-th ``image_token`` repeated :func:`image_token_count` times for the i-th grid (the
    processor's expansion; ``<|vision_start|>``/``<|vision_end|>`` are the chat template's and stay as they are).
    For a batch, call it per text with that text's images' grids, in order."""
    parts = text.split(image_token)
    if len(parts) - 1 != len(grids):
        raise ValueError(f"{len(parts) - 1} {image_token} in the text for {len(grids)} images")
    out = [parts[0]]
    for grid, part in zip(grids, parts[1:]):
        out += [image_token * image_token_count(grid, merge_size), part]
    return "".join(out)


def mm_token_type_ids(input_ids: Sequence[int] | torch.Tensor, image_token_id: int, video_token_id: int | None = None) -> list[int]:
    """One sequence's ``mm_token_type_ids``: 1 at image tokens, 2 at video tokens, 0 elsewhere (the processor's)."""
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    return [1 if i == image_token_id else 2 if video_token_id is not None and i == video_token_id else 0 for i in ids]


class QwenImages:
    """The image processor of a Qwen3.5 / Qwen3.6 checkpoint as a ``waypoint.vision.processors.ImageProcessor``:
    an image's placeholder (``<|image_pad|>``, between the template's ``<|vision_start|>`` and ``<|vision_end|>``)
    becomes as many of it as the image has merged patches, which its size decides (:func:`smart_resize`).

    Args:
        settings: the image processor's settings (:func:`from_checkpoint`).
        tokenizer: a ``waypoint.text.tokenizer.Tokenizer``; each of the tokens must be one token of it.
        tokens: ``{"image_token", "video_token", "vision_start_token", "vision_end_token"}`` as text, where the
            tokenizer names others than Qwen's.
        source: where the settings came from, named in errors.
    """

    token_type_key = "mm_token_type_ids"

    def __init__(self, settings: QwenImageSettings, tokenizer, tokens: dict[str, str] | None = None,
                 source: str = "the image processor") -> None:
        self.settings, self.source = check_settings(settings, source), source
        tokens = {**DEFAULT_TOKENS, **(tokens or {})}
        ids = {key: single_id(tokenizer, tokens[key], key, source, "Qwen") for key in DEFAULT_TOKENS}
        self.placeholder = self.image_token = tokens["image_token"]
        self.image_token_id, self.video_token_id = ids["image_token"], ids["video_token"]
        self.image_end_id = ids["vision_end_token"]
        self.image_only_tokens = {tokens[key]: ids[key] for key in DEFAULT_TOKENS}
        self._frame = (tokens["vision_start_token"], tokens["vision_end_token"], tokens["video_token"])

    @classmethod
    def from_checkpoint(cls, directory: str | Path, tokenizer) -> "QwenImages":
        """The settings of the checkpoint (or processor) folder ``directory``, read as transformers reads them."""
        directory = Path(directory)
        tokens = token_names(read_json(directory / "tokenizer_config.json"), DEFAULT_TOKENS)
        return cls(from_checkpoint(directory), tokenizer, tokens, str(directory))

    def grid(self, image: Image.Image) -> tuple[int, int, int]:
        """The image's patch grid (1, h, w): of its size after :func:`smart_resize` (its own size without do_resize)."""
        s = self.settings
        height, width = image.height, image.width
        if s.do_resize:
            height, width = smart_resize(height, width, s.factor, s.min_pixels, s.max_pixels)
        elif height % s.factor or width % s.factor:
            raise ValueError(f"a {width}x{height} image does not split into whole {s.factor}-pixel blocks (do_resize "
                             "is off)")
        return 1, height // s.patch_size, width // s.patch_size

    def expansion(self, image: Image.Image) -> str:
        """What the image's ``<|image_pad|>`` becomes: one per merged patch."""
        return self.image_token * image_token_count(self.grid(image), self.settings.merge_size)

    def expected_counts(self, n_images: int, n_image_tokens: int) -> dict[str, int]:
        """A ``<|vision_start|>`` and a ``<|vision_end|>`` per image, its image tokens, and no video's."""
        start, end, video = self._frame
        return {start: n_images, self.image_token: n_image_tokens, end: n_images, video: 0}

    def model_inputs(self, images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        """``{"pixel_values", "image_grid_thw"}``: :func:`preprocess`."""
        if images:
            return preprocess(images, self.settings)
        s = self.settings
        width = (3 if s.do_convert_rgb else 1) * s.temporal_patch_size * s.patch_size ** 2
        return {"pixel_values": torch.zeros((0, width), dtype=torch.float32),
                "image_grid_thw": torch.zeros((0, 3), dtype=torch.int64)}

    def token_types(self, ids: Sequence[int]) -> list[int]:
        """The processor's ``mm_token_type_ids``."""
        return mm_token_type_ids(ids, self.image_token_id, self.video_token_id)
