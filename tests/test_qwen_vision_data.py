"""Qwen3.5 vision data against transformers' own processor (``Qwen3VLProcessor`` over ``Qwen2VLImageProcessorPil``
and the checkpoint's tokenizer and chat template, as TRL calls it): token ids, ``pixel_values``, ``image_grid_thw``
and ``mm_token_type_ids`` equal to the processor's, images of several sizes (so of several token counts) a
conversation; labels on exactly the assistant's replies; a batch collated as the processor batches it; a record
whose images do not fit ``max_seq_len`` a one-line error; the family chosen from the checkpoint's files; and a
3-step full fine-tune of a tiny ``Qwen3_5ForConditionalGeneration`` on that data, its tower kept byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ROOT
from tests.test_vision_data import _as_trl_gives_them, _write_jsonl
from waypoint.text.tokenizer import load_tokenizer
from waypoint.data.collate import vision_collate
from waypoint.data.vision_chat_dataset import VisionChatDataset
from waypoint.vision.processors import ImageProcessor, image_processor_for
from waypoint.vision.qwen_images import QwenImages

pytest.importorskip("transformers")
TEMPLATE = (ROOT / "assets/chat_templates/qwen3_5_small.jinja").read_text(encoding="utf-8")  # Qwen3.5-0.8B's
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>", "<think>", "</think>"]
# patch 4, merge 2 (8-pixel blocks), 2 frames a patch, 128 to 2048 pixels: images from 4 to 32 tokens
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
                "size": {"shortest_edge": 128, "longest_edge": 2048}, "patch_size": 4, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
TRAINING_TEXT = ["What colour is this picture?\nRed. Blue and green.\nDescribe both images, then compare them.",
                 "A gradient; some noise.\nThe first is brighter than the second one.\nCompare them. And this?"]


def write_checkpoint_files(directory: Path) -> Path:
    """A tiny Qwen3.5 tokenizer (byte-level BPE with Qwen's control tokens), Qwen3.5-0.8B's chat template and a small
    image processor's settings, as a Qwen3.5 checkpoint holds them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TRAINING_TEXT * 4, trainer)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 4096}))
    (directory / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return directory


def hf_processor(directory: Path, monkeypatch):
    """transformers' processor of the folder. Its video processor needs torchvision, absent here: the constructor's
    class check is skipped for it (no videos are processed), as tests/test_qwen3_5_vision.py does."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg))
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(directory),
                            tokenizer=AutoTokenizer.from_pretrained(directory), video_processor=None,
                            chat_template=TEMPLATE)


def write_images(folder: Path) -> dict[str, Path]:
    """Images of several sizes (up- and downscaled, non-square, 1 x 1) and modes (RGBA, L, a palette)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (21, 33, 4), dtype=np.uint8)
    rgba[..., 3] = np.linspace(0, 255, 33, dtype=np.uint8)[None, :]
    images = {"red.png": Image.new("RGB", (40, 30), (220, 20, 30)),  # 32 x 40: 20 tokens
              "noise.png": Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)),  # down to 40 x 40
              "wide.png": Image.fromarray(rng.integers(0, 256, (12, 70, 3), dtype=np.uint8)),
              "alpha.png": Image.fromarray(rgba, "RGBA"),
              "grey.png": Image.fromarray(np.tile(np.linspace(0, 255, 50, dtype=np.uint8), (12, 1)), "L"),
              "palette.png": Image.fromarray(rng.integers(0, 256, (19, 23, 3), dtype=np.uint8)).quantize(8),
              "dot.png": Image.new("RGB", (1, 1), (5, 200, 90))}  # up to 16 x 16: 4 tokens
    for name, image in images.items():
        image.save(folder / name)
    return {name: folder / name for name in images}


def records() -> list[dict]:
    image = {"type": "image"}

    def text(t):
        return {"type": "text", "text": t}
    return [
        {"messages": [{"role": "user", "content": [image, text("What colour is this picture?")]},
                      {"role": "assistant", "content": [text("Red.")]}], "images": ["img/red.png"]},
        {"messages": [{"role": "system", "content": "Describe images."},
                      {"role": "user", "content": [image, text("Describe both images,"), image,
                                                   text(" then compare them.")]},
                      {"role": "assistant", "content": [text("A gradient;"), text(" some noise.")]},
                      {"role": "user", "content": [text("And this?"), image]},
                      {"role": "assistant", "content": [text("The first is brighter than the second one.")]}],
         "images": ["img/noise.png", "img/wide.png", "img/alpha.png"]},
        {"messages": [{"role": "user", "content": "Compare them."},  # string contents: TRL places the images
                      {"role": "assistant", "content": "Blue and green."}],
         "images": ["img/grey.png", "img/palette.png", "img/dot.png"]},
        {"messages": [{"role": "user", "content": [text("No picture here.")]},
                      {"role": "assistant", "content": [text("Red.")]}], "images": []},
    ]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    directory = write_checkpoint_files(tmp_path_factory.mktemp("qwen3_5"))
    paths = write_images(directory / "data" / "img")
    data = _write_jsonl(directory / "data" / "train.jsonl", records())
    return directory, paths, data


def assistant_runs(item: dict) -> list[list[int]]:
    """The labelled tokens, run by run (each label is its token or -100)."""
    runs, run = [], []
    for token, label in zip(item["tokens"], item["labels"]):
        assert label in (-100, token)
        if label == -100 and run:
            runs, run = runs + [run], []
        elif label != -100:
            run.append(token)
    return runs + [run] if run else runs


def test_items_equal_the_processors(qwen, monkeypatch):
    directory, paths, data = qwen
    processor = hf_processor(directory, monkeypatch)
    dataset = VisionChatDataset(data, load_tokenizer(directory), max_seq_len=512)
    assert isinstance(dataset.images, QwenImages) and isinstance(dataset.images, ImageProcessor)
    tokens_per_image = []
    for index, record in enumerate(records()):
        expected = processor.apply_chat_template(_as_trl_gives_them(record, paths), tokenize=True, return_dict=True,
                                                 return_tensors="pt")
        item = dataset[index]
        assert set(item) == {"tokens", "labels", "pixel_values", "image_grid_thw", "mm_token_type_ids"}
        assert item["tokens"] == expected["input_ids"][0].tolist()
        assert item["mm_token_type_ids"] == expected["mm_token_type_ids"][0].tolist()
        if record["images"]:
            assert torch.equal(item["pixel_values"], expected["pixel_values"])
            assert torch.equal(item["image_grid_thw"], expected["image_grid_thw"])
            tokens_per_image += (expected["image_grid_thw"].prod(-1) // 4).tolist()
        else:
            assert item["pixel_values"].shape == (0, 3 * 2 * 4 * 4) and item["image_grid_thw"].shape == (0, 3)
        assert sum(item["mm_token_type_ids"]) == int(item["image_grid_thw"].prod(-1).sum()) // 4
        replies = ["".join(p["text"] for p in m["content"]) if isinstance(m["content"], list) else m["content"]
                   for m in record["messages"] if m["role"] == "assistant"]
        decoded = [processor.tokenizer.decode(r, skip_special_tokens=False) for r in assistant_runs(item)]
        assert decoded == [reply + "<|im_end|>" for reply in replies]
    assert len(set(tokens_per_image)) >= 5 and min(tokens_per_image) == 4, tokens_per_image  # sizes differ
    everything = VisionChatDataset(data, load_tokenizer(directory), max_seq_len=512, train_on_input=True)
    assert all(everything[i]["labels"] == everything[i]["tokens"] for i in range(len(everything)))


def test_a_batch_equals_the_processors(qwen, monkeypatch):
    directory, paths, data = qwen
    processor = hf_processor(directory, monkeypatch)
    dataset = VisionChatDataset(data, load_tokenizer(directory), max_seq_len=512)
    pad = processor.tokenizer.pad_token_id
    batch = vision_collate([dataset[i] for i in range(len(dataset))], pad_id=pad)
    conversations = [_as_trl_gives_them(r, paths) for r in records()]
    expected = processor.apply_chat_template(conversations, tokenize=True, return_dict=True, return_tensors="pt",
                                             padding=True)
    assert processor.tokenizer.padding_side == "right"
    assert torch.equal(batch["tokens"], expected["input_ids"])
    assert torch.equal(batch["mask"], expected["attention_mask"].bool())
    for key in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert batch[key].dtype == expected[key].dtype and torch.equal(batch[key], expected[key]), key
    assert "token_type_ids" not in batch


def test_images_that_do_not_fit_are_refused_in_one_line(qwen):
    directory, _, data = qwen
    tokenizer = load_tokenizer(directory)
    full = VisionChatDataset(data, tokenizer, max_seq_len=512)[1]  # three images, the last in the second user turn
    end = tokenizer.encode("<|vision_end|>", add_bos=False)[0]
    last_end = max(p for p, t in enumerate(full["tokens"]) if t == end)
    kept = VisionChatDataset(data, tokenizer, max_seq_len=last_end + 1, skip_bad_records=True)
    assert kept.skipped == 0 and kept[1]["tokens"] == full["tokens"][: last_end + 1]
    assert kept[1]["image_grid_thw"].shape == (3, 3)
    with pytest.raises(ValueError, match=r"train\.jsonl: record 2 \(line 2\): image 3 of 3 does not fit in "
                                         rf"max_seq_len={last_end}") as error:
        VisionChatDataset(data, tokenizer, max_seq_len=last_end)
    assert "\n" not in str(error.value)
    skipping = VisionChatDataset(data, tokenizer, max_seq_len=last_end, skip_bad_records=True)
    assert skipping.skipped >= 1 and len(skipping) == len(records()) - skipping.skipped


@pytest.mark.parametrize("text, expected", [
    ("What is <|vision_start|> here?", "outside the images' own"),
    ("What is <|image_pad|> here?", r"2 image placeholder\(s\) \(<\|image_pad\|>\) for 1 image"),
    ("What is <|video_pad|> here?", "outside the images' own"),
])
def test_image_tokens_in_the_text_are_refused(qwen, tmp_path, text, expected):
    directory, paths, _ = qwen
    record = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
                           {"role": "assistant", "content": "Red."}], "images": [str(paths["red.png"])]}
    with pytest.raises(ValueError, match=expected) as error:
        VisionChatDataset(_write_jsonl(tmp_path / "d.jsonl", [record]), load_tokenizer(directory), max_seq_len=512)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"{tmp_path / 'd.jsonl'}: record 1 (line 1): ")


def test_the_family_comes_from_the_checkpoints_files(qwen, tmp_path):
    directory, _, _ = qwen
    tokenizer = load_tokenizer(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    settings = {k: v for k, v in PREPROCESSOR.items() if k not in ("processor_class", "image_processor_type")}
    gemma = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 8, "width": 8}}
    for files, family in [
        ({"preprocessor_config.json": PREPROCESSOR}, QwenImages),
        ({"processor_config.json": {"processor_class": "Qwen3VLProcessor", "image_processor": settings}}, QwenImages),
        ({"preprocessor_config.json": dict(settings, image_processor_type="Qwen2VLImageProcessorFast")}, QwenImages),
        ({"preprocessor_config.json": settings, "config.json": {"model_type": "qwen3_5_moe"}}, QwenImages),
        ({"preprocessor_config.json": gemma, "config.json": {"model_type": "gemma3"}},
         None),  # Gemma 3's, chosen: this tokenizer has no Gemma 3 image tokens
        ({"preprocessor_config.json": {"processor_class": "LlavaProcessor"}}, "processor_class is 'LlavaProcessor'"),
        ({"config.json": {"model_type": "llama"}}, "config.json's model_type is 'llama'"),
        ({}, "is this a vision-language checkpoint"),
    ]:
        for name in ("processor_config.json", "preprocessor_config.json", "config.json"):
            (tmp_path / name).unlink(missing_ok=True)
        for name, content in files.items():
            (tmp_path / name).write_text(json.dumps(content))
        if isinstance(family, type):
            got = image_processor_for(tmp_path, tokenizer)
            assert type(got) is family and got.settings.patch_size == 4 and got.token_type_key == "mm_token_type_ids"
        else:
            with pytest.raises(ValueError, match=family or "not a Gemma 3 vision tokenizer") as error:
                image_processor_for(tmp_path, tokenizer)
            assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def qwen_vlm(qwen, tmp_path_factory):
    """A tiny random Qwen3_5ForConditionalGeneration (its tower's patch, frames and merge those of the image
    processor, its image token ids the tokenizer's) with the tokenizer and processor files: (folder, the model)."""
    import transformers

    from tests.test_qwen3_5_vlm import TEXT, VISION

    directory, _, _ = qwen
    _write_jsonl(directory / "data" / "twice.jsonl", records() * 2)  # 4 batches of 2
    base = write_checkpoint_files(tmp_path_factory.mktemp("qwen_vlm") / "base")
    tokenizer = load_tokenizer(base)
    ids = {name: tokenizer.encode(name, add_bos=False)[0] for name in SPECIAL}
    config = transformers.Qwen3_5Config(
        vision_config=VISION, text_config=dict(TEXT, vocab_size=tokenizer.vocab_size, eos_token_id=ids["<|im_end|>"]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    hf.save_pretrained(base, max_shard_size="100KB")
    return base, hf


def test_three_steps_of_full_finetune_keep_the_tower(qwen, qwen_vlm, tmp_path):
    """A tiny random Qwen3_5ForConditionalGeneration (its tower's patch, frames and merge those of the image
    processor, its image token ids the tokenizer's), trained 3 steps on the data: the losses finite, the first
    transformers' loss on the first batch (so the images, their grids and token types reached the model), the output
    the input's files and keys, its tower (frozen) byte for byte the input's. A batch without images has no image
    inputs (Qwen's processor gives none) and the model takes it."""
    from recipes import full_finetune
    from waypoint.checkpointers import load_model
    from waypoint.checkpointers.file_formats import read_tensors
    from waypoint.data.data_order import iterate_batches
    from waypoint.training.loss import model_inputs

    directory, _, _ = qwen
    data = directory / "data" / "twice.jsonl"
    base, hf = qwen_vlm
    tokenizer = load_tokenizer(base)
    out = tmp_path / "out"
    code = full_finetune.main(["--config", str(ROOT / "configs/tiny_vlm.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"dataset.source={data}", f"output_dir={out}", "epochs=1", "max_steps_per_epoch=3",
                               "batch_size=2", "progress=off", "dataset.max_seq_len=512"])
    assert code == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
    dataset = VisionChatDataset(data, tokenizer, max_seq_len=512)
    _, first = next(iterate_batches(dataset, 2, seed=1234, epoch=0,  # the config's seed: the run's first batch
                                    collate_fn=lambda items: vision_collate(items, tokenizer.pad_id)))
    assert first["image_grid_thw"].shape[0] >= 1 and first["mask"].sum(1).unique().numel() == 2  # images; 2 lengths
    with torch.no_grad():
        expected = hf(input_ids=first["tokens"], attention_mask=first["mask"].long(), labels=first["labels"],
                      **{k: first[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}).loss.item()
        text_only = vision_collate([dataset[3]], tokenizer.pad_id)  # the record without images
        assert set(text_only) == {"tokens", "labels", "mask", "mm_token_type_ids"}
        logits = load_model(base).eval()(text_only["tokens"], **model_inputs(text_only, torch.device("cpu")))
        assert (logits - hf(input_ids=text_only["tokens"]).logits).abs().max().item() <= 1e-5
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses[0], expected)
    files = sorted(p.name for p in base.glob("*.safetensors"))
    assert len(files) > 1 and files == sorted(p.name for p in (out / "step_3").glob("*.safetensors"))
    visual = merger = changed = 0
    for name in files:
        before, after = read_tensors(base / name), read_tensors(out / "step_3" / name)
        assert before.keys() == after.keys(), name
        for key, tensor in before.items():
            same = tensor.dtype == after[key].dtype and tensor.view(torch.uint8).numpy().tobytes() == \
                after[key].view(torch.uint8).numpy().tobytes()
            if key.startswith("model.visual.merger."):  # the projector into the text's width: it trains
                merger += not same
            elif key.startswith("model.visual."):
                visual += 1
                assert same, key
            changed += not same
    print(f"\nqwen3.5 VLM, 3 steps: losses {[round(x, 4) for x in losses]} (first - transformers' "
          f"{losses[0] - expected:.2g}); {visual} tower tensors unchanged, {merger} of the merger's and {changed} in all trained")
    assert visual == 27 and merger == 6 and changed > merger
    # generate.py image= on the Qwen checkpoint: its processor found from the files, greedy ids transformers' own
    import contextlib
    import io

    from recipes import generate
    from waypoint.models.generate import Sampling, generate as generate_ids
    from waypoint.text.chat_template import load_chat_template
    from waypoint.vision.image_files import load_image
    from waypoint.vision.processors import image_processor_for

    image = directory / "data" / "img" / "red.png"
    printed = io.StringIO()
    errors = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        assert generate.main(["--config", str(ROOT / "configs/generate.yaml"), f"checkpoint_dir={base}", f"image={image}",
                              "prompt=What colour is this?", "max_new_tokens=4"]) == 0, errors.getvalue()[-2000:]
    processor = image_processor_for(base, tokenizer)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    rendered = load_chat_template(tokenizer).render(messages, add_generation_prompt=True)
    picture = load_image(str(image), "test")
    prompt = tokenizer.encode_with_offsets(rendered.replace(processor.placeholder, processor.expansion(picture), 1))[0]
    inputs = {**processor.model_inputs([picture]), processor.token_type_key: torch.tensor([processor.token_types(prompt)])}
    ours = generate_ids(load_model(base), prompt, 4, Sampling(temperature=0.0), images=inputs)
    theirs = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=4, do_sample=False, eos_token_id=None, **inputs)[0, len(prompt):].tolist()
    assert ours == theirs and printed.getvalue().strip() == tokenizer.decode(ours).strip()


@pytest.mark.parametrize("tower", [(), ("vision.qkv", "vision.linear_fc1")], ids=["language-model", "and-tower"])
def test_lora_adapter_loads_in_peft_with_our_logits_on_images(qwen, qwen_vlm, tmp_path, tower):
    """LoRA on the language model of the Qwen3.5 VLM, and on its tower by transformers' names (the blocks' qkv, the
    blocks' and the merger's linear_fc1): PEFT puts the adapter on transformers' model, on the tower only where asked
    (target_modules a regex per part), and its logits with images equal our merged model's."""
    from peft import PeftModel

    from recipes import lora_finetune
    from waypoint.checkpointers import load_model
    from waypoint.data.collate import vision_collate

    directory, _, _ = qwen
    base, hf = qwen_vlm
    out = tmp_path / "out"
    assert lora_finetune.main(["--config", str(ROOT / "configs/tiny_vlm_lora.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"dataset.source={directory / 'data' / 'twice.jsonl'}", f"output_dir={out}", "epochs=1",
                               "max_steps_per_epoch=2", "batch_size=2", "progress=off", "dataset.max_seq_len=512",
                               "optimizer.lr=2e-2", f"lora.targets=[q_proj,v_proj,w1,{','.join(tower)}]".replace(",]", "]")]) == 0
    config = json.loads((out / "step_2/adapter_config.json").read_text())
    assert r"model\.language_model\." in config["target_modules"]
    tokenizer = load_tokenizer(base)
    batch = vision_collate([VisionChatDataset(directory / "data" / "train.jsonl", tokenizer, max_seq_len=512)[1]],
                           tokenizer.pad_id)
    inputs = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    peft = PeftModel.from_pretrained(transformers_copy(base), out / "step_2").eval()
    adapted = {name.split(".lora_")[0] for name, _ in peft.named_parameters() if ".lora_" in name}
    in_tower = {name.split("visual.", 1)[1] for name in adapted if "visual." in name}
    if tower:
        assert any(n.endswith("attn.qkv") for n in in_tower) and any(n.startswith("merger.linear_fc1") for n in in_tower)
        assert not any(n.endswith(("attn.proj", "linear_fc2")) for n in in_tower), sorted(in_tower)
    else:
        assert not in_tower
    with torch.no_grad():
        theirs = peft(input_ids=batch["tokens"], **inputs).logits
        ours = load_model(out / "step_2/merged").eval()(batch["tokens"], **inputs)
        base_logits = hf(input_ids=batch["tokens"], **inputs).logits
    assert (ours - theirs).abs().max().item() <= 1e-4 < (base_logits - theirs).abs().max().item()


def transformers_copy(base):
    import transformers

    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(base)
