"""Gemma 3 vision data against transformers' own processor: pixel values equal to ``Gemma3ImageProcessorPil``'s
to the bit, token ids and token_type_ids equal to ``Gemma3Processor.apply_chat_template``'s (as TRL calls it),
labels on exactly the assistant's replies, and every bad image a one-line error naming its record."""

from __future__ import annotations

import io
import json
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tests.conftest import ROOT
from waypoint.text.tokenizer import load_tokenizer
from waypoint.data.collate import vision_collate
from waypoint.data.vision_chat_dataset import VisionChatDataset
from waypoint.vision.gemma3_images import Gemma3Images
from waypoint.vision.image_files import load_image

# google/gemma-3-4b-it's chat template (its tokenizer_config.json "chat_template"), as two independent public copies
# hold it, identical (the one in transformers' own tests is an older, shorter draft).
GEMMA3_TEMPLATE = (ROOT / "assets/tiny_vlm/chat_template.jinja").read_text()  # google/gemma-3-4b-it's
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
           "<image_soft_token>", "<end_of_image>"]
# Blank lines next to text, so that the tokenizer merges them (the image sequence's "\n\n" must tokenize with the text).
TRAINING_TEXT = ["What colour is this picture?\n\nRed. Blue and green.\n\nDescribe both images,\n\nthen compare them.",
                 "A gradient, some noise and a grey square.\n\nThe first is brighter than the second one?\n\n"]


def _processor(directory: Path, image_processor_kwargs: dict, image_seq_length: int = 4):
    """A tiny Gemma 3 processor saved into ``directory``: a byte-level BPE tokenizer with Gemma's special tokens
    that, like Gemma's, does not split the text at whitespace first, so "?\n\n" can be one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TRAINING_TEXT * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                              "eoi_token": "<end_of_image>"})
    processor = Gemma3Processor(Gemma3ImageProcessorPil(**image_processor_kwargs), tokenizer,
                                image_seq_length=image_seq_length, chat_template=GEMMA3_TEMPLATE)
    processor.save_pretrained(directory)
    return processor


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` RGB pixels, with no pixel data (a few dozen bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def _write_images(folder: Path) -> dict[str, Path]:
    """Images of every kind the processor must handle: sizes up and down, non-square, RGBA, L, LA, P and RGB with
    a transparent colour (composited onto white, as transparency is), noise, a JPEG turned by its EXIF orientation,
    a 1 x 1 and a GIF."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 17, dtype=np.uint8)
    gradient = np.stack([np.tile(ramp, (10, 1)), np.tile(ramp[::-1], (10, 1)), np.full((10, 17), 77, np.uint8)], -1)
    rgba = rng.integers(0, 256, (21, 33, 4), dtype=np.uint8)
    rgba[..., 3] = np.linspace(0, 255, 33, dtype=np.uint8)[None, :]
    palette = Image.fromarray(rng.integers(0, 256, (19, 23, 3), dtype=np.uint8)).quantize(8)
    images = {
        "red.png": Image.new("RGB", (40, 30), (220, 20, 30)),  # down, non-square
        "gradient.png": Image.fromarray(gradient),  # up, non-square
        "noise.png": Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)),
        "alpha.png": Image.fromarray(rgba, "RGBA"),
        "grey.png": Image.fromarray(np.tile(np.linspace(0, 255, 50, dtype=np.uint8), (12, 1)), "L"),
        "grey_alpha.png": Image.fromarray(rng.integers(0, 256, (29, 31, 2), dtype=np.uint8), "LA"),
        "dot.png": Image.new("RGB", (1, 1), (5, 200, 90)),
        "anim.gif": Image.fromarray(rng.integers(0, 256, (26, 18, 3), dtype=np.uint8)).quantize(16),
    }
    paths = {}
    for name, image in images.items():
        image.save(folder / name)
        paths[name] = folder / name
    palette.save(folder / "palette.png", transparency=3)
    paths["palette.png"] = folder / "palette.png"
    keyed = rng.integers(0, 4, (14, 15, 3), dtype=np.uint8) * 60  # RGB with a transparent colour (tRNS)
    Image.fromarray(keyed).save(folder / "keyed.png", transparency=(60, 0, 120))
    paths["keyed.png"] = folder / "keyed.png"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to show upright
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(folder / "turned.jpg", exif=exif)
    paths["turned.jpg"] = folder / "turned.jpg"
    return paths


def _as_datasets_decodes(path: Path) -> Image.Image:
    """The image as the ``datasets`` Image feature hands it to TRL: decoded, EXIF orientation applied, mode kept."""
    image = Image.open(path)
    image.load()
    if image.getexif().get(0x0112) is not None:
        image = ImageOps.exif_transpose(image)
    return image


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3")
    processor = _processor(directory, {"size": {"height": 28, "width": 28}})
    images = _write_images(directory / "data" / "img")
    return directory, processor, images


def test_pixel_values_equal_the_processors(gemma, tmp_path):
    directory, processor, paths = gemma
    ours = Gemma3Images.from_checkpoint(directory, load_tokenizer(directory))
    assert (ours.height, ours.width, ours.image_seq_length) == (28, 28, 4)
    files = list(paths.values())
    expected = processor.image_processor([_as_datasets_decodes(p) for p in files], return_tensors="pt")["pixel_values"]
    got = ours.pixel_values([load_image(str(p), f"image {p.name}") for p in files])
    assert got.dtype == torch.float32 and got.shape == (len(files), 3, 28, 28)
    assert torch.equal(got, expected)  # exactly: same operations, same order, same precision
    # Other settings, in the older layout (preprocessor_config.json): non-square size, bicubic, CLIP's mean and std.
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    clip = Gemma3ImageProcessorPil(size={"height": 20, "width": 36}, resample=3,
                                   image_mean=[0.48145466, 0.4578275, 0.40821073],
                                   image_std=[0.26862954, 0.26130258, 0.27577711])
    clip.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    assert (tmp_path / "preprocessor_config.json").is_file()
    other = Gemma3Images.from_checkpoint(tmp_path, load_tokenizer(directory))
    expected = clip([_as_datasets_decodes(p) for p in files], return_tensors="pt")["pixel_values"]
    assert torch.equal(other.pixel_values([load_image(str(p), "x") for p in files]), expected)


def test_settings_refused_in_one_line(gemma, tmp_path):
    directory, _, _ = gemma
    tokenizer = load_tokenizer(directory)
    config = json.loads((directory / "processor_config.json").read_text())
    config["image_processor"]["do_pan_and_scan"] = True
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    (tmp_path / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do_pan_and_scan") as error:
        Gemma3Images.from_checkpoint(tmp_path, tokenizer)
    assert "\n" not in str(error.value)
    # google/gemma-3-4b-it's layout: preprocessor_config.json with nulls (the defaults), processor_config.json
    # holding only image_seq_length.
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 7, "processor_class": "Gemma3Processor"}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 7,
        "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
        "rescale_factor": 0.00392156862745098, "size": {"height": 32, "width": 32}}))
    legacy = Gemma3Images.from_checkpoint(tmp_path, tokenizer)
    assert (legacy.height, legacy.width, legacy.image_seq_length, legacy.resample) == (32, 32, 7, 2)
    assert legacy.full_image_sequence == "\n\n<start_of_image>" + "<image_soft_token>" * 7 + "<end_of_image>\n\n"
    images = Gemma3Images.from_checkpoint(directory, tokenizer)
    with pytest.raises(ValueError, match="2 image placeholder.*for 1 image") as error:
        images.expand("<start_of_image><start_of_image>", 1, "here")
    assert "\n" not in str(error.value)


def _records(paths: dict[str, Path]) -> list[dict]:
    """Conversations in TRL's vision format, images named relative to the data file."""
    image = {"type": "image"}

    def text(t):
        return {"type": "text", "text": t}
    rel = {name: f"img/{name}" for name in paths}
    return [
        {"messages": [{"role": "user", "content": [image, text("What colour is this picture?")]},
                      {"role": "assistant", "content": [text("Red.")]}], "images": [rel["red.png"]]},
        {"messages": [{"role": "user", "content": [image, text("Describe both images,"), image, text("then compare them.")]},
                      {"role": "assistant", "content": [text("A gradient;"), text("some noise.")]},
                      {"role": "user", "content": [text("And this?"), image]},
                      {"role": "assistant", "content": [text("The first is brighter than the second one.")]}],
         "images": [rel["gradient.png"], rel["noise.png"], rel["alpha.png"]]},
        {"messages": [{"role": "system", "content": "Describe images."},  # string contents: TRL places the images
                      {"role": "user", "content": "Compare them."},
                      {"role": "assistant", "content": "Blue and green."}],
         "images": [rel["grey.png"], rel["palette.png"], rel["turned.jpg"], rel["grey_alpha.png"], rel["keyed.png"]]},
        {"messages": [{"role": "user", "content": [text("No picture here.")]},
                      {"role": "assistant", "content": [text("Red.")]}], "images": []},
        {"messages": [{"role": "user", "content": [image, image]}, {"role": "assistant", "content": "Green."}],
         "images": [rel["dot.png"], {"bytes": paths["anim.gif"].read_bytes(), "path": None}]},
    ]


def _as_trl_gives_them(record: dict, paths: dict[str, Path]) -> list[dict]:
    """The record's messages as TRL's prepare_multimodal_messages hands them to the processor: every content a list
    of parts, image parts holding the decoded images."""
    decoded = [_as_datasets_decodes(paths[s.split("/")[-1]]) if isinstance(s, str)
               else _as_datasets_decodes(io.BytesIO(s["bytes"])) for s in record["images"]]
    messages, placed = [], False
    has_parts = any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
                    for m in record["messages"])
    for message in record["messages"]:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
            if message["role"] == "user" and not placed and not has_parts:
                content = [{"type": "image"} for _ in decoded] + content
                placed = True
        messages.append({"role": message["role"], "content": [dict(p) for p in content]})
    pending = iter(decoded)
    for message in messages:
        for part in message["content"]:
            if part["type"] == "image":
                part["image"] = next(pending)
    return messages


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_items_equal_the_processors(gemma):
    directory, processor, paths = gemma
    records = _records(paths)
    jsonl = [r for r in records if all(isinstance(s, str) for s in r["images"])]
    data = _write_jsonl(directory / "data" / "train.jsonl", jsonl)
    tokenizer = load_tokenizer(directory)
    dataset = VisionChatDataset(data, tokenizer, max_seq_len=512)
    assert len(dataset) == len(jsonl)
    for index, record in enumerate(jsonl):
        expected = processor.apply_chat_template(_as_trl_gives_them(record, paths), tokenize=True, return_dict=True,
                                                 return_tensors="pt", processor_kwargs={"add_special_tokens": False})
        item = dataset[index]
        assert item["tokens"] == expected["input_ids"][0].tolist()
        assert item["token_type_ids"] == expected["token_type_ids"][0].tolist()
        assert sum(item["token_type_ids"]) == 4 * len(record["images"])
        if record["images"]:
            assert torch.equal(item["pixel_values"], expected["pixel_values"])
        else:
            assert item["pixel_values"].shape == (0, 3, 28, 28)
        # Labels: exactly the assistant's replies, each with its end-of-turn token.
        runs, run = [], []
        for token, label in zip(item["tokens"], item["labels"]):
            assert label in (-100, token)
            if label == -100 and run:
                runs.append(run)
                run = []
            elif label != -100:
                run.append(token)
        runs += [run] if run else []
        replies = ["".join(p["text"] for p in m["content"]) if isinstance(m["content"], list) else m["content"]
                   for m in record["messages"] if m["role"] == "assistant"]
        decoded = [processor.tokenizer.decode(r, skip_special_tokens=False) for r in runs]
        assert decoded == [reply + "<end_of_turn>" for reply in replies]
    everything = VisionChatDataset(data, tokenizer, max_seq_len=512, train_on_input=True)
    assert all(everything[i]["labels"] == everything[i]["tokens"] for i in range(len(everything)))
    # Text parts the template trims one by one ("A gradient" + "and noise.") render unlike their joined text: refused.
    spaced = dict(jsonl[0], messages=[jsonl[0]["messages"][0], {"role": "assistant", "content": [
        {"type": "text", "text": "A gradient "}, {"type": "text", "text": "and noise."}]}])
    with pytest.raises(ValueError, match="record 1 .line 1.: the chat template renders an assistant") as error:
        VisionChatDataset(_write_jsonl(directory / "data" / "spaced.jsonl", [spaced]), tokenizer, max_seq_len=512)
    assert "\n" not in str(error.value)


def test_parquet_bytes_and_collate(gemma, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory, processor, paths = gemma
    records = _records(paths)
    as_bytes = [dict(r, images=[{"bytes": (paths[s.split("/")[-1]].read_bytes() if isinstance(s, str) else s["bytes"]),
                                 "path": None} for s in r["images"]]) for r in records]
    for record in as_bytes:  # parquet holds one type per column: every content a list of parts
        for message in record["messages"]:
            if isinstance(message["content"], str):
                message["content"] = [{"type": "text", "text": message["content"]}]
    as_bytes = [r for r in as_bytes if any(p["type"] == "image" for m in r["messages"] for p in m["content"])
                or not r["images"]]
    pq.write_table(pa.Table.from_pylist(as_bytes), tmp_path / "train.parquet")
    dataset = VisionChatDataset(tmp_path / "train.parquet", load_tokenizer(directory), max_seq_len=512)
    assert len(dataset) == len(as_bytes)
    for index, record in enumerate(as_bytes):
        messages = _as_trl_gives_them(record, paths)
        expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                                 processor_kwargs={"add_special_tokens": False})
        item = dataset[index]
        assert item["tokens"] == expected["input_ids"][0].tolist()
        if record["images"]:
            assert torch.equal(item["pixel_values"], expected["pixel_values"])
    items = [dataset[i] for i in range(len(dataset))]
    batch = vision_collate(items, pad_id=0)
    longest = max(len(i["tokens"]) for i in items)
    assert batch["tokens"].shape == batch["token_type_ids"].shape == (len(items), longest)
    assert torch.equal(batch["pixel_values"], torch.cat([i["pixel_values"] for i in items]))
    assert batch["pixel_values"].dtype == torch.float32
    for row, item in enumerate(items):
        n = len(item["tokens"])
        assert batch["token_type_ids"][row, :n].tolist() == item["token_type_ids"]
        assert not batch["token_type_ids"][row, n:].any()
    assert int(batch["token_type_ids"].sum()) == 4 * batch["pixel_values"].shape[0]


def test_other_column_names(gemma):
    directory, _, paths = gemma
    record = _records(paths)[0]
    renamed = {"dialog": [{"speaker": m["role"], "text": m["content"]} for m in record["messages"]],
               "pictures": record["images"]}
    data = _write_jsonl(directory / "data" / "renamed.jsonl", [renamed])
    columns = {"messages": "dialog", "role": "speaker", "content": "text", "images": "pictures"}
    dataset = VisionChatDataset(data, load_tokenizer(directory), max_seq_len=512, columns=columns)
    plain = VisionChatDataset(_write_jsonl(directory / "data" / "plain.jsonl", [record]), load_tokenizer(directory), 512)
    assert dataset[0]["tokens"] == plain[0]["tokens"] and torch.equal(dataset[0]["pixel_values"], plain[0]["pixel_values"])


def test_max_seq_len_never_cuts_an_image(gemma):
    directory, _, paths = gemma
    record = _records(paths)[1]  # three images, the last in the second user turn
    data = _write_jsonl(directory / "data" / "cut.jsonl", [record])
    tokenizer = load_tokenizer(directory)
    full = VisionChatDataset(data, tokenizer, max_seq_len=512)[0]
    last_image_end = max(p for p, t in enumerate(full["token_type_ids"]) if t) + 1  # the eoi token after it
    kept = VisionChatDataset(data, tokenizer, max_seq_len=last_image_end + 1)[0]
    assert kept["tokens"] == full["tokens"][: last_image_end + 1] and kept["pixel_values"].shape[0] == 3
    with pytest.raises(ValueError, match=r"cut\.jsonl: record 1 \(line 1\): image 3 of 3 does not fit") as error:
        VisionChatDataset(data, tokenizer, max_seq_len=last_image_end)
    assert "\n" not in str(error.value)
    two = _write_jsonl(directory / "data" / "cut2.jsonl", [record, _records(paths)[0]])
    skipping = VisionChatDataset(two, tokenizer, max_seq_len=last_image_end, skip_bad_records=True)
    assert len(skipping) == 1 and skipping.skipped == 1


@pytest.mark.parametrize("case, expected", [
    ("missing", "image file not found"),
    ("random", "not an image PIL can read"),
    ("empty", r"is empty \(0 bytes\)"),
    ("zero_width", "0 x 12 pixels"),
    ("huge", "too large to decode .20000 x 20000 pixels"),
    ("past_limit", "too large to decode .9000 x 9000 pixels"),
    ("pil_warning", "too large to decode .10000 x 10000 pixels"),
    ("truncated", "not a readable image"),
    ("eps", "not an image PIL can read"),
    ("url", "is a URL"),
    ("count", r"2 image\(s\) in 'images' for 1 image part"),
    ("in_text", "outside the images' own"),
])
def test_bad_images_stop_in_one_line(gemma, tmp_path, case, expected):
    directory, _, paths = gemma
    image_file = tmp_path / "bad.png"
    noise = np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8).tobytes()
    good = io.BytesIO()
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(good, "PNG")
    contents = {"random": noise, "empty": b"", "zero_width": _png_claiming(0, 12), "huge": _png_claiming(20000, 20000),
                "past_limit": _png_claiming(9000, 9000), "pil_warning": _png_claiming(10000, 10000),
                "truncated": good.getvalue()[:-200],
                "eps": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"}
    if case in contents:
        image_file.write_bytes(contents[case])
    images = ["https://example.com/a.png"] if case == "url" else ["bad.png"]
    text = "What colour?"
    if case == "count":
        images = ["bad.png", "bad.png"]
        Image.new("RGB", (8, 8)).save(image_file)
    if case == "in_text":
        Image.new("RGB", (8, 8)).save(image_file)
        text = "What is <image_soft_token>?"
    record = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
                           {"role": "assistant", "content": "Red."}], "images": images}
    data = _write_jsonl(tmp_path / "data.jsonl", [record])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # never a warning: PIL's DecompressionBombWarning is the error
        with pytest.raises(ValueError, match=expected) as error:
            VisionChatDataset(data, load_tokenizer(directory), max_seq_len=512)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{data}: record 1 (line 1): ")
    if case not in ("count", "in_text"):
        assert ": image 1: " in message


def test_load_image_sources(gemma, tmp_path):
    _, _, paths = gemma
    red = paths["red.png"]
    from_path = load_image("red.png", "here", root=red.parent)
    from_bytes = load_image(red.read_bytes(), "here")
    from_dict = load_image({"bytes": None, "path": str(red)}, "here")
    assert from_path.mode == "RGB" and from_path.tobytes() == from_bytes.tobytes() == from_dict.tobytes()
    for source, expected in ((b"", "empty"), (b"not an image", "not an image"), (3, "expected an image path"),
                             ({"path": None}, "needs 'bytes' or 'path'"), ("s3://bucket/x.png", "is a URL")):
        with pytest.raises(ValueError, match=expected) as error:
            load_image(source, "data.jsonl: record 3: image 1")
        assert str(error.value).startswith("data.jsonl: record 3: image 1: ") and "\n" not in str(error.value)
