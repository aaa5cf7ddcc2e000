"""Images and image processor settings at their bounds: a processor config whose sizes would make images past the
limit on images read (``vision.image_files.MAX_PIXELS``) is one line naming the file and the key, when the settings
are read (nothing allocated), for each family's processor; 16-bit greyscale images scaled to 8 bits as the format
means (32768 -> 128, where transformers' conversion clips them to 255), in the file reader and in each processor; and
32-bit images ("I", "F") refused in one line naming the file."""

from __future__ import annotations

import io
import json
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

from waypoint.text.tokenizer import load_tokenizer
from waypoint.vision.gemma3_images import DEFAULT_TOKENS, Gemma3Images
from waypoint.vision.gemma4_images import Gemma4ImageSettings, image_to_patches as gemma4_patches
from waypoint.vision.gemma4_images import from_checkpoint as gemma4_settings
from waypoint.vision.image_files import MAX_PIXELS, convert_to_rgb, load_image
from waypoint.vision.processors import image_processor_for
from waypoint.vision.qwen_images import QwenImageSettings, image_to_patches as qwen_patches
from waypoint.vision.qwen_images import from_checkpoint as qwen_settings

GEMMA3 = {"image_processor_type": "Gemma3ImageProcessor"}
QWEN = {"image_processor_type": "Qwen2VLImageProcessor"}
GEMMA4 = {"image_processor_type": "Gemma4ImageProcessor"}
LIMIT = f"over the {MAX_PIXELS:,}-pixel limit"


@pytest.mark.parametrize("config, expected", [
    ({**GEMMA3, "size": {"height": 100000, "width": 100000}},
     f'size {{"height": 100000, "width": 100000}} makes images of up to 10,000,000,000 pixels, {LIMIT}'),
    ({**GEMMA3, "size": 100000}, f"size 100000 makes images of up to 10,000,000,000 pixels, {LIMIT}"),
    ({**GEMMA3, "size": {"height": 8192, "width": 8193}}, f"makes images of up to 67,117,056 pixels, {LIMIT}"),
    ({**GEMMA3, "size": {"height": 0, "width": 10}}, "size must be .* .positive integers., got"),
    ({**GEMMA3, "size": {"height": "big", "width": 10}}, "size must be .* .positive integers., got"),
    ({**QWEN, "size": {"shortest_edge": 3136, "longest_edge": 10**10}},
     rf'size\["longest_edge"\] 10,000,000,000 makes images of up to 10,000,000,000 pixels, {LIMIT}'),
    ({**QWEN, "max_pixels": 10**10}, f"max_pixels 10,000,000,000 makes images of up to 10,000,000,000 pixels, {LIMIT}"),
    ({**QWEN, "min_pixels": 10**10, "max_pixels": 10**10}, f"min_pixels 10,000,000,000 makes .*, {LIMIT}"),
    ({**QWEN, "patch_size": 100000},
     f"patch_size 100000 x merge_size 2 .* makes images of up to 40,[0-9,]+ pixels, {LIMIT}"),
    ({**QWEN, "merge_size": 10000},
     f"patch_size 14 x merge_size 10000 .* makes images of up to 19,[0-9,]+ pixels, {LIMIT}"),
    ({**QWEN, "temporal_patch_size": 100000},
     f"temporal_patch_size 100000 .* with max_pixels 1,003,520 makes .*, {LIMIT}"),
    ({**QWEN, "size": {"shortest_edge": 3136, "longest_edge": 2**26}},  # 2 copies of each image of up to 2**26 pixels
     rf'temporal_patch_size 2 .* with size\["longest_edge"\] 67,108,864 makes images of up to 134,217,728 pixels, '
     f'{LIMIT}'),
    ({**QWEN, "patch_size": 0}, "patch_size must be a positive integer, got 0"),
    ({**QWEN, "patch_size": "14"}, "patch_size must be a positive integer, got '14'"),
    ({**QWEN, "size": {"longest_edge": -5}}, r'size\["longest_edge"\] must be a positive integer, got -5'),
    ({**QWEN, "max_pixels": 2.5e6}, "max_pixels must be a positive integer, got 2500000.0"),
    ({**QWEN, "size": 448}, "size must be .*shortest_edge.*longest_edge.* got 448"),
    ({**GEMMA4, "patch_size": 100000}, f"patch_size 100000 with pooling_kernel_size 3 and max_soft_tokens 280 makes "
                                       f"images of up to 25,200,000,000,000 pixels, {LIMIT}"),
    ({**GEMMA4, "pooling_kernel_size": 1000}, f"pooling_kernel_size 1000 and max_soft_tokens 280 makes .*, {LIMIT}"),
    ({**GEMMA4, "patch_size": -16}, "patch_size must be a positive integer, got -16"),
    ({**GEMMA4, "patch_size": "16"}, "patch_size must be a positive integer, got '16'"),
    ({**GEMMA4, "max_soft_tokens": 10**9}, "max_soft_tokens must be one of"),
])
def test_processor_sizes_past_the_limit_are_one_line_naming_the_file(tmp_path, config, expected):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=expected) as error:
            image_processor_for(tmp_path, tokenizer=None)  # refused before the tokenizer is asked for a token
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'preprocessor_config.json'}: ") and "\n" not in message
    assert peak < 10 * 2**20  # nothing the size of an image was allocated


@pytest.mark.parametrize("length, expected", [(10**10, "image_seq_length 10,000,000,000 is more tokens than an "
                                                         f"image may have pixels \\({MAX_PIXELS:,}\\)"),
                                              (0, "image_seq_length must be a positive integer, got 0")])
def test_gemma3_image_seq_length_is_bounded_in_its_file(tmp_path, length, expected):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**GEMMA3, "size": {"height": 8, "width": 8}}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": length}))
    with pytest.raises(ValueError, match=expected) as error:
        image_processor_for(tmp_path, tokenizer=None)
    assert str(error.value).startswith(f"{tmp_path / 'processor_config.json'}: ") and "\n" not in str(error.value)


def test_nested_settings_name_their_file(tmp_path):
    nested = {"processor_class": "Qwen3VLProcessor", "image_processor": {"max_pixels": 10**10}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    with pytest.raises(ValueError, match=f"max_pixels 10,000,000,000 makes .*, {LIMIT}") as error:
        qwen_settings(tmp_path)
    assert str(error.value).startswith(f"{tmp_path / 'processor_config.json'} (image_processor): ")


def test_the_releases_settings_are_within_the_limit(tmp_path):
    """Qwen3.5's and Gemma 4's own settings (the largest soft-token budget), and images up to the limit."""
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({**QWEN, "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                                "temporal_patch_size": 2, "merge_size": 2}))
    assert qwen_settings(tmp_path).max_pixels == 16777216
    path.write_text(json.dumps({**QWEN, "size": {"shortest_edge": 3136, "longest_edge": 2**25}}))
    assert qwen_settings(tmp_path).max_pixels == 2**25
    path.write_text(json.dumps({**GEMMA4, "patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 1120}))
    assert gemma4_settings(tmp_path).max_patches == 1120 * 9


def _png(image: Image.Image, tmp_path, name: str = "grey16.png") -> str:
    image.save(tmp_path / name)
    return str(tmp_path / name)


def test_a_16_bit_grey_png_is_grey_not_white(tmp_path):
    grey = Image.fromarray(np.full((5, 7), 32768, dtype=np.uint16))
    path = _png(grey, tmp_path)
    assert Image.open(path).mode == "I;16"
    rgb = load_image(path, "here")
    assert rgb.mode == "RGB" and rgb.size == (7, 5)
    assert np.array_equal(np.asarray(rgb), np.full((5, 7, 3), 128, dtype=np.uint8))  # round(32768 * 255 / 65535)


def test_16_bit_modes_scale_exactly(tmp_path):
    """Every 16-bit value v becomes round(v * 255 / 65535) (exact: v / 257 is never a half), in each 16-bit mode PIL
    opens files in (a big-endian TIFF's "I;16B"; a PGM's "I", PIL's scale of its maxval to 65535)."""
    values = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    expected = np.array([round(Fraction(int(v) * 255, 65535)) for v in values.ravel()], dtype=np.uint8)
    assert np.array_equal(np.asarray(load_image(_png(Image.fromarray(values), tmp_path), "here")).reshape(-1, 3),
                          np.stack([expected] * 3, axis=1))
    big_endian = Image.frombytes("I;16B", (256, 256), values.astype(">u2").tobytes())
    big_endian.save(tmp_path / "grey16.tif")
    assert Image.open(tmp_path / "grey16.tif").mode == "I;16B"
    assert np.array_equal(np.asarray(load_image(str(tmp_path / "grey16.tif"), "here"))[..., 1].ravel(), expected)
    (tmp_path / "grey16.pgm").write_bytes(b"P5\n2 1\n1023\n" + np.array([512, 1023], ">u2").tobytes())
    assert Image.open(tmp_path / "grey16.pgm").mode == "I"
    assert np.asarray(load_image(str(tmp_path / "grey16.pgm"), "here"))[0].tolist() == [[128] * 3, [255] * 3]


def test_a_16_bit_transparent_grey_is_white():
    grey = Image.fromarray(np.array([[0, 32768, 65535]], dtype=np.uint16))
    grey.info["transparency"] = 0  # a PNG's tRNS: value 0 is transparent
    assert np.asarray(convert_to_rgb(grey))[0, :, 0].tolist() == [255, 128, 255]


@pytest.mark.parametrize("mode, array", [("F", np.full((3, 4), 0.5, np.float32)),
                                         ("I", np.full((3, 4), 32768, np.int32))])
def test_32_bit_images_are_refused_naming_the_file(tmp_path, mode, array):
    path = tmp_path / f"deep_{mode}.tif"
    Image.fromarray(array).save(path)
    assert Image.open(path).mode == mode
    with pytest.raises(ValueError, match=f"is a 32-bit .* image \\(PIL mode '{mode}'\\)") as error:
        load_image(str(path), "data.jsonl: record 1: image 1")
    message = str(error.value)
    assert message.startswith(f"data.jsonl: record 1: image 1: {path} is a 32-bit") and "\n" not in message
    with pytest.raises(ValueError, match="32-bit"):
        convert_to_rgb(Image.fromarray(array))


def _gemma3_tokenizer(directory):
    """A tokenizer holding Gemma 3's three image tokens (all Gemma3Images asks of one)."""
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    backend.add_special_tokens(["<eos>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"])
    backend.save(str(directory / "tokenizer.json"))
    return load_tokenizer(directory)


def test_each_processor_sees_a_16_bit_grey_as_grey(tmp_path):
    """A 16-bit image given to a processor directly: the pixel values of the same image in 8 bits."""
    sixteen, eight = Image.fromarray(np.full((24, 24), 32768, np.uint16)), Image.new("L", (24, 24), 128)
    gemma3 = Gemma3Images({"size": {"height": 8, "width": 8}}, 4, DEFAULT_TOKENS, _gemma3_tokenizer(tmp_path))
    assert torch.equal(gemma3.pixel_values([sixteen]), gemma3.pixel_values([eight]))
    qwen = QwenImageSettings(patch_size=4, min_pixels=64, max_pixels=1024)
    assert np.array_equal(qwen_patches(sixteen, qwen)[0], qwen_patches(eight, qwen)[0])
    gemma4 = Gemma4ImageSettings(patch_size=4, max_soft_tokens=70)
    assert np.array_equal(gemma4_patches(sixteen, gemma4)[0], gemma4_patches(eight, gemma4)[0])
    assert np.allclose(gemma4_patches(sixteen, gemma4)[0], 128 / 255)
