"""Gemma 4's vision tower with its embedder (models.gemma4_vision) and image preprocessing (vision.gemma4_images)
against transformers: the image tokens' embeddings against ``get_image_features`` of a tiny random
``Gemma4ForConditionalGeneration`` (clipped linears, standardization, grouped k/v heads; images of several sizes in one
call) in fp32 and fp64, its weights through our names and back bitwise; the processor's outputs bitwise against the
PIL image processor, the text expansion and token types against ``Gemma4Processor``, and the language model's masks
over image tokens (``image_attention``) against transformers'."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from waypoint.converters.table import Converter
from waypoint.families.gemma4_vision_rules import BUFFERS, PREFIXES, gemma4_vision, gemma4_vision_rules
from waypoint.models.gemma4_vision import Gemma4VisionTower
from waypoint.vision.gemma4_images import (Gemma4Images, expand, from_checkpoint, from_preprocessor_config, image_token_count,
                                           mm_token_type_ids, preprocess, target_size)

# 4-pixel patches pooled 3x3: 12-pixel blocks, at most 70 tokens (630 patches) an image; sides up to 210 patches
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, patch_size=4, position_embedding_size=256, pooling_kernel_size=3, use_clipped_linears=True,
              standardize=True)
TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=16, hidden_size_per_layer_input=0, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention="vision")
AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
             output_proj_dims=32, conv_kernel_size=3)
PREPROCESSOR = dict(patch_size=4, pooling_kernel_size=3, max_soft_tokens=70)
TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>", "audio_token": "<|audio|>",
          "boa_token": "<|audio>", "eoa_token": "<audio|>"}


def make_model(vision: dict, seed: int = 0, audio: dict | None = None):
    """A tiny random Gemma4ForConditionalGeneration, every parameter moved off its init (norms and the position
    table too); the clip bounds made finite (so that they clip) and the standardization's moved off 0 and 1."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    config = Gemma4Config(text_config=TEXT, vision_config=vision, audio_config=audio, image_token_id=260)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.startswith("model.vision_tower.") and name.endswith(("_min", "_max")):
                sign, scale = (-1 if name.endswith("_min") else 1), (1.0 if "input" in name else 0.5)
                b.fill_(sign * scale * (1 + torch.rand(()).item()))
            elif name.startswith("model.vision_tower.std_"):
                b.add_(torch.randn_like(b) * 0.1)
    return model


def _saved(tmp_path_factory, vision: dict, seed: int, audio: dict | None = None):
    model = make_model(vision, seed, audio)
    path = tmp_path_factory.mktemp("gemma4_vl")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the model, its save_pretrained folder), the audio tower beside the vision tower."""
    return _saved(tmp_path_factory, VISION, 0, AUDIO)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The other kind: no clip bounds, no standardization, 2x2 pooling, as many k/v heads as heads."""
    return _saved(tmp_path_factory, {**VISION, "use_clipped_linears": False, "standardize": False,
                                     "pooling_kernel_size": 2, "num_key_value_heads": 2}, 1)


def vision_state(path) -> dict[str, torch.Tensor]:
    """The saved tensors of the tower and its embedder, by the converter's keys (``PREFIXES``)."""
    from safetensors.torch import load_file

    return {PREFIXES[p] + k[len(p):]: v for k, v in load_file(path / "model.safetensors").items()
            for p in PREFIXES if k.startswith(p)}


def native_tower(path) -> Gemma4VisionTower:
    args = gemma4_vision(json.loads((path / "config.json").read_text()))
    native = Converter(rules=gemma4_vision_rules(args)).to_native(vision_state(path))
    tower = Gemma4VisionTower(args).eval()
    tower.load_state_dict({k.removeprefix("vision."): native[k] for k in native})  # strict: every tensor, no other
    return tower


def _images():
    gen = np.random.default_rng(0)
    rgba = np.concatenate([gen.integers(0, 256, (90, 70, 3)), np.tile(np.linspace(0, 255, 70), (90, 1))[..., None]], -1)
    gradient = np.broadcast_to(np.linspace(0, 255, 120, dtype=np.uint8), (64, 120))
    return [Image.new("RGB", (30, 20), (255, 0, 0)),  # solid, upscaled
            Image.fromarray(gen.integers(0, 256, (37, 53, 3), dtype=np.uint8)),  # noise, odd sides
            Image.fromarray(gen.integers(0, 256, (300, 200, 3), dtype=np.uint8)),  # downscaled
            Image.fromarray(np.stack([gradient, gradient[:, ::-1], gradient // 2], -1)),  # gradients, wide
            Image.fromarray(rgba.astype(np.uint8), mode="RGBA"),  # transparency composited onto white
            Image.fromarray(gen.integers(0, 256, (9, 150), dtype=np.uint8), mode="L"),  # grey, 1:16: one block high
            Image.fromarray(gen.integers(0, 256, (40, 24, 2), dtype=np.uint8), mode="LA"),
            Image.new("RGB", (96, 60), (10, 200, 30))]  # already whole blocks (8 x 5)


IMAGES = _images()


def fp64_throughout(monkeypatch):
    """Both sides' RMSNorms, and transformers' pooler, in the input's dtype (fp32 otherwise, whatever the model's)."""
    from transformers.models.gemma4 import modeling_gemma4

    from waypoint.models import attention

    def their_norm(self, x):
        normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return normed * self.weight if self.with_scale else normed

    def our_norm(self, x):
        normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return normed if self.weight is None else normed * self.weight

    def their_pool(self, hidden_states, pixel_position_ids, padding_positions, output_length=None):
        hidden = hidden_states.masked_fill(padding_positions.unsqueeze(-1), 0.0)
        k = int((hidden.shape[1] // output_length) ** 0.5)
        positions = pixel_position_ids.clamp(min=0)
        blocks = torch.div(positions, k, rounding_mode="floor")
        blocks = blocks[..., 0] + ((positions[..., 0].max(-1, keepdim=True)[0] + 1) // k) * blocks[..., 1]
        weights = F.one_hot(blocks.long(), output_length).to(hidden.dtype) / k ** 2
        return (weights.transpose(1, 2) @ hidden) * self.root_hidden_size, ~(weights == 0).all(dim=1)

    monkeypatch.setattr(modeling_gemma4.Gemma4RMSNorm, "forward", their_norm)
    monkeypatch.setattr(modeling_gemma4.Gemma4VisionPooler, "forward", their_pool)
    monkeypatch.setattr(attention.RMSNorm, "forward", our_norm)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("variant", ["checkpoint", "plain"])
def test_tower_matches_transformers(variant, dtype, tol, request, monkeypatch):
    model, path = request.getfixturevalue(variant)
    kernel = json.loads((path / "config.json").read_text())["vision_config"]["pooling_kernel_size"]
    batch = preprocess(IMAGES, from_preprocessor_config({**PREPROCESSOR, "pooling_kernel_size": kernel}))
    tower = native_tower(path).to(dtype)
    if dtype == torch.float64:
        fp64_throughout(monkeypatch)
    try:
        with torch.no_grad():
            hf = model.to(dtype).model
            ref = torch.cat(hf.get_image_features(batch["pixel_values"], batch["image_position_ids"]).pooler_output)
            ours = tower(batch["pixel_values"], batch["image_position_ids"])
            alone = tower(batch["pixel_values"][2:3], batch["image_position_ids"][2:3])  # one image, its own call
    finally:
        model.float()
    counts = batch["num_soft_tokens_per_image"].tolist()
    assert ours.shape == ref.shape == (sum(counts), 48) and ours.dtype == dtype
    diff = (ours - ref).abs().max().item()
    print(f"\n{variant} {dtype}: {len(IMAGES)} images ({sum(counts)} tokens), max |native - transformers| = "
          f"{diff:.3g} (outputs ~{ref.abs().max():.2g})")
    assert diff <= tol
    assert (alone - ours[sum(counts[:2]):sum(counts[:3])]).abs().max() <= tol


def test_the_clip_bounds_clip(checkpoint):
    """Without the checkpoint's bounds the output moves: they are in use where transformers agrees with us."""
    batch = preprocess(IMAGES[:3], from_preprocessor_config(PREPROCESSOR))
    tower = native_tower(checkpoint[1])
    with torch.no_grad():
        clipped = tower(batch["pixel_values"], batch["image_position_ids"])
        for name, b in tower.named_buffers():
            if name.endswith(("_min", "_max")):
                b.fill_(float("inf") if name.endswith("_max") else -float("inf"))
        unclipped = tower(batch["pixel_values"], batch["image_position_ids"])
    assert (clipped - unclipped).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["checkpoint", "plain"])
def test_state_dict_round_trip_is_bitwise(variant, request):
    path = request.getfixturevalue(variant)[1]
    hf_state = vision_state(path)
    assert len(hf_state) == (3 + 2 * (6 + 7 * 5) + 2 if variant == "checkpoint" else 3 + 2 * (6 + 7))
    args = gemma4_vision(json.loads((path / "config.json").read_text()))
    converter = Converter(rules=gemma4_vision_rules(args), buffers=BUFFERS)
    native = converter.to_native(hf_state)
    assert set(native) == {"vision." + k for k in Gemma4VisionTower(args).state_dict()}
    back = converter.from_native({k: native[k] for k in native})
    assert sorted(back) == sorted(hf_state)
    for key, tensor in hf_state.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    assert sum(not converter.is_parameter(k) for k in hf_state) == (2 * 7 * 4 + 2 if variant == "checkpoint" else 0)
    if variant == "checkpoint":  # the audio tower is no key of ours: it stays carried
        from safetensors.torch import load_file
        audio = [k.removeprefix("model.") for k in load_file(path / "model.safetensors")
                 if k.startswith(("model.audio_tower.", "model.embed_audio."))]
        assert audio and not any(converter.matches(k, "hf") for k in audio)


def test_config_fields(checkpoint):
    from transformers import Gemma4TextConfig, Gemma4VisionConfig

    args = gemma4_vision(json.loads((checkpoint[1] / "config.json").read_text()))
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim, args.hidden_dim, args.out_dim,
            args.n_positions, args.patch_size, args.pooling_kernel_size, args.rope_theta, args.clipped_linears,
            args.standardize, args.image_token_id, args.image_attention) == (
        32, 2, 2, 1, 16, 48, 48, 256, 4, 3, 100.0, True, True, 260, "sliding_bidirectional")
    # an empty vision_config and text_config take the config classes' defaults
    full = {"vision_config": Gemma4VisionConfig().to_dict(), "text_config": Gemma4TextConfig().to_dict()}
    assert gemma4_vision({"vision_config": {}}) == gemma4_vision(full)
    assert gemma4_vision(full).image_attention == "causal" and gemma4_vision(full).image_token_id == 258880
    assert gemma4_vision({"text_config": {}}) is None
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        gemma4_vision({"vision_config": {}, "text_config": {"use_bidirectional_attention": "all"}})
    with pytest.raises(ValueError, match="axial"):
        gemma4_vision({"vision_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}})


def test_bad_inputs_are_refused(checkpoint):
    tower = native_tower(checkpoint[1])
    batch = preprocess(IMAGES[:1], from_preprocessor_config(PREPROCESSOR))
    with pytest.raises(ValueError, match="takes"):
        tower(batch["pixel_values"][0], batch["image_position_ids"][0])
    with pytest.raises(ValueError, match="one \\(x, y\\) per patch"):
        tower(batch["pixel_values"], batch["image_position_ids"][:, :10])
    positions = batch["image_position_ids"].clone()
    positions[0, 3] = -1  # a patch short of whole blocks
    with pytest.raises(ValueError, match="whole 3x3 blocks"):
        tower(batch["pixel_values"], positions)


def test_language_model_masks_over_image_tokens():
    """use_bidirectional_attention="vision" ("sliding_bidirectional"): the full layers causal, the sliding ones
    models.image_tokens.image_mask's (an image's tokens both ways, within the window); image runs are ``<|image|>``
    tokens only (``mm_token_type_ids`` 1), boi and eoi outside them."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4 import modeling_gemma4

    from waypoint.models.image_tokens import image_mask

    config = Gemma4TextConfig(**TEXT)
    config._attn_implementation = "eager"
    types = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    embeds = torch.zeros(2, 14, 48)
    masks = modeling_gemma4.create_masks_for_vision_model(
        config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=torch.arange(14)[None],
        block_sequence_ids=modeling_gemma4.get_block_sequence_ids_for_mask(types, embeds.device))
    assert torch.equal(masks["full_attention"] == 0, torch.ones(14, 14).tril().bool().expand(2, 1, 14, 14))
    assert torch.equal(masks["sliding_attention"] == 0, image_mask(types, config.sliding_window))


# Image preprocessing ----------------------------------------------------------------------------------------------

PREPROCESSOR_CONFIGS = [
    PREPROCESSOR,
    # 2x2 pooling, bilinear, normalized to [-1, 1] (not Gemma 4's own: it leaves that to the tower), nested in
    # processor_config.json as transformers 5 writes it
    dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=140, resample=2, do_normalize=True,
         image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], image_processor_type="Gemma4ImageProcessor"),
    dict(patch_size=16, max_soft_tokens=280),  # Gemma 4's own sizes
]


@pytest.mark.parametrize("config", PREPROCESSOR_CONFIGS)
def test_pixel_values_are_transformers_bitwise(config, tmp_path):
    from transformers import Gemma4ImageProcessorPil

    if config is PREPROCESSOR_CONFIGS[1]:
        (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": config}))
        reference = Gemma4ImageProcessorPil(**{k: v for k, v in config.items() if k != "image_processor_type"})
    else:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
        reference = Gemma4ImageProcessorPil.from_pretrained(tmp_path)
    settings = from_checkpoint(tmp_path)
    for batch in [[image] for image in IMAGES] + [IMAGES]:
        ref, ours = reference(batch, return_tensors="pt"), preprocess(batch, settings)
        assert set(ours) == set(ref)
        for key in ours:
            assert ours[key].dtype == ref[key].dtype and torch.equal(ours[key], ref[key]), (key, [i.size for i in batch])
        assert ours["num_soft_tokens_per_image"].tolist() == [image_token_count(i, settings) for i in batch]


def test_without_resizing():
    """do_resize off: an image of whole blocks as transformers gives it; others refused (the tower could not pool them)."""
    from transformers import Gemma4ImageProcessorPil

    config = dict(PREPROCESSOR, do_resize=False)
    settings = from_preprocessor_config(config)
    ref, ours = Gemma4ImageProcessorPil(**config)(IMAGES[-1:], return_tensors="pt"), preprocess(IMAGES[-1:], settings)
    assert set(ours) == set(ref) and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert ours["num_soft_tokens_per_image"].tolist() == [40] == [image_token_count(IMAGES[-1], settings)]
    with pytest.raises(ValueError, match="do_resize is off"):
        preprocess(IMAGES[1:2], settings)


def test_target_size_is_transformers():
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size as reference

    for height in [*range(1, 300, 7), 1000, 4000]:
        for width in [*range(1, 300, 11), 1500, 5000]:
            for patch, budget, kernel in [(4, 630, 3), (16, 2520, 3), (4, 560, 2), (14, 9 * 1120, 3)]:
                try:
                    expected = reference(height, width, patch, budget, kernel)
                except ValueError:
                    with pytest.raises(ValueError):
                        target_size(height, width, patch, budget, kernel)
                    continue
                assert target_size(height, width, patch, budget, kernel) == expected


def write_processor_files(directory):
    """A byte-level tokenizer holding Gemma 4's image and audio tokens (named in tokenizer_config.json's
    ``extra_special_tokens``, as Gemma 4's own) and the image processor's settings."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>", *TOKENS.values(), "<|video|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "extra_special_tokens": TOKENS}))
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))


def test_text_expansion_is_the_processors(tmp_path, monkeypatch):
    """``Gemma4Processor`` (its video processor needs torchvision, absent here: the constructor's class check is
    skipped for it, no videos are processed) against :func:`expand`, :func:`mm_token_type_ids` and Gemma4Images."""
    from transformers import AutoTokenizer, Gemma4ImageProcessorPil, Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.processing_utils import ProcessorMixin

    from waypoint.text.tokenizer import load_tokenizer

    write_processor_files(tmp_path)
    check = ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg))
    processor = Gemma4Processor(Gemma4AudioFeatureExtractor(), Gemma4ImageProcessorPil.from_pretrained(tmp_path),
                                AutoTokenizer.from_pretrained(tmp_path), video_processor=None)
    texts = ["Look: <|image|> and <|image|>, which is red?", "<|image|>\nDescribe."]
    images = [[IMAGES[0], IMAGES[2]], [IMAGES[5]]]
    out = processor(images=images, text=texts, padding=False)
    settings = from_checkpoint(tmp_path)
    ours = Gemma4Images.from_checkpoint(tmp_path, load_tokenizer(tmp_path))
    ids = {key: processor.tokenizer.convert_tokens_to_ids(TOKENS.get(key, "<|video|>"))
           for key in ("image_token", "video_token", "audio_token")}
    for text, group, input_ids, types in zip(texts, images, out["input_ids"], out["mm_token_type_ids"]):
        expected = expand(text, [image_token_count(image, settings) for image in group])
        assert processor.tokenizer.decode(input_ids) == expected
        assert input_ids == processor.tokenizer(expected)["input_ids"]
        parts = text.split("<|image|>")
        assert expected == parts[0] + "".join(ours.expansion(image) + part for image, part in zip(group, parts[1:]))
        assert types == mm_token_type_ids(input_ids, ids["image_token"], ids["video_token"], ids["audio_token"])
        assert types == ours.token_types(input_ids)
        assert sum(types) == sum(image_token_count(image, settings) for image in group)
    flat = [image for group in images for image in group]
    reference = processor.image_processor(flat, return_tensors="pt")
    inputs = ours.model_inputs(flat)
    assert set(inputs) == {"pixel_values", "image_position_ids"}
    assert all(torch.equal(inputs[k], reference[k]) for k in inputs)
    counts = processor._get_num_multimodal_tokens(image_sizes=[image.size[::-1] for image in flat])["num_image_tokens"]
    assert counts == [image_token_count(image, settings) for image in flat]
    assert ours.image_end_id == processor.tokenizer.convert_tokens_to_ids("<image|>")
    assert ours.expected_counts(3, sum(counts)) == {"<|image>": 3, "<|image|>": sum(counts), "<image|>": 3,
                                                     "<|video|>": 0, "<|audio|>": 0}
    with pytest.raises(ValueError, match="2 <\\|image\\|> in the text for 1 images"):
        expand(texts[0], [4])


@pytest.mark.parametrize("per_layer", [0, 8], ids=["no-ple", "ple"])
@pytest.mark.parametrize("bidirectional", [None, "vision"], ids=["causal", "vision-bidirectional"])
def test_the_whole_model_with_images_equals_transformers(tmp_path, per_layer, bidirectional):
    """``load_model`` of a Gemma4ForConditionalGeneration repo reads its vision tower; the forward takes the
    processor's ``pixel_values``, ``image_position_ids`` and ``mm_token_type_ids``: fp32 logits within 1e-5 of
    transformers' (two images in a row, one in the other; per-layer embeddings looking image tokens up as the pad;
    the sliding layers' bidirectional image attention), the audio tower carried untouched, the round trip bitwise."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from waypoint.checkpointers import HFCheckpointer, load_model
    from waypoint.checkpointers.file_formats import read_tensors

    text = dict(TEXT, hidden_size_per_layer_input=per_layer, vocab_size_per_layer_input=300,
                use_bidirectional_attention=bidirectional, sliding_window=6)
    config = Gemma4Config(text_config=text, vision_config=VISION, audio_config=AUDIO, image_token_id=260)
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "in")
    settings = from_preprocessor_config(PREPROCESSOR)
    inputs = preprocess([IMAGES[0], IMAGES[1], IMAGES[7]], settings)
    n = inputs["num_soft_tokens_per_image"].tolist()
    rows = [[5, 9, *[260] * n[0], 17, 3, *[260] * n[1], 8, 40], [7, *[260] * n[2], 33, 60, 61, 62]]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    types = (tokens == 260).long()
    image = {"pixel_values": inputs["pixel_values"], "image_position_ids": inputs["image_position_ids"]}
    model = load_model(tmp_path / "in").eval()
    assert model.args.vision.tower == "gemma4"
    with torch.no_grad():
        expected = hf(input_ids=tokens, mm_token_type_ids=types, **image).logits
        got = model(tokens, mm_token_type_ids=types, **image)
    diff = (got - expected).abs().max().item()
    print(f"\ngemma4 ({bidirectional or 'causal'}, per-layer {per_layer}) with images: max |native - transformers| "
          f"logit = {diff:.3g} (scale {expected.abs().max():.3g})")
    assert diff <= 1e-5
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    out = ckpt.save_checkpoint({"model": ckpt.load_checkpoint()["model"]}, step=1)
    before, after = read_tensors(tmp_path / "in/model.safetensors"), read_tensors(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert any(k.startswith("model.audio_tower.") for k in before)


def write_vlm(base, clip: float | None = None):
    """A tiny random Gemma4ForConditionalGeneration in ``base`` with the processor's files and Gemma 4's chat template:
    (the model, our tokenizer of it). ``clip``: the tower's clamping linears clamp their inputs to +-clip and their
    outputs to +-clip/10 (as saved by transformers, +-inf: no clamp)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tests.conftest import ROOT
    from waypoint.text.tokenizer import load_tokenizer

    base.mkdir()
    write_processor_files(base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = (ROOT / "assets/chat_templates/gemma4_small.jinja").read_text()
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(base)
    ids = {t: tokenizer.encode(t, add_bos=False)[0] for t in ("<|image|>", "<pad>", "<eos>", "<bos>")}
    text = dict(TEXT, vocab_size=tokenizer.vocab_size, pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"],
                bos_token_id=ids["<bos>"], sliding_window=512)
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=VISION,
                                                     image_token_id=ids["<|image|>"])).eval()
    if clip is not None:
        with torch.no_grad():
            for name, bound in hf.named_buffers():
                if name.startswith("model.vision_tower.") and name.endswith(("_min", "_max")):
                    bound.fill_((-1 if name.endswith("_min") else 1) * clip / (1 if "input" in name else 10))
    hf.save_pretrained(base)
    return hf, tokenizer


def write_colours(path):
    """Four records in TRL's format: an image of assets/tiny_vlm, its colour the answer."""
    from tests.conftest import ROOT

    colours = ROOT / "assets/tiny_vlm/images"
    record = lambda colour, k: {"messages": [  # noqa: E731
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": colour}]}], "images": [str(colours / f"{colour}_{k}.png")]}
    path.write_text("".join(json.dumps(record(c, k)) + "\n" for c in ("red", "blue") for k in range(2)))
    return path


def test_a_gemma4_vlm_trains_on_images_and_answers_about_one(tmp_path):
    """The data path end to end: TRL-format records with images, the checkpoint's Gemma 4 processor found from its
    files, two steps of the full fine-tune (the first batch's loss transformers' own), the tower byte for byte as it
    came; then generate.py image= on the result."""
    import contextlib
    import io

    from recipes import full_finetune, generate
    from tests.conftest import ROOT
    from waypoint.checkpointers.file_formats import read_tensors
    from waypoint.data.collate import vision_collate
    from waypoint.data.data_order import iterate_batches
    from waypoint.data.vision_chat_dataset import VisionChatDataset

    hf, tokenizer = write_vlm(tmp_path / "base")
    base, colours, data = tmp_path / "base", ROOT / "assets/tiny_vlm/images", write_colours(tmp_path / "data.jsonl")
    out = tmp_path / "out"
    assert full_finetune.main(["--config", str(ROOT / "configs/tiny_vlm.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"dataset.source={data}", f"output_dir={out}", "epochs=1", "max_steps_per_epoch=2",
                               "batch_size=2", "progress=off", "dataset.max_seq_len=256"]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    dataset = VisionChatDataset(data, tokenizer, max_seq_len=256)
    _, first = next(iterate_batches(dataset, 2, seed=1234, epoch=0,
                                    collate_fn=lambda items: vision_collate(items, tokenizer.pad_id)))
    with torch.no_grad():
        expected = hf(input_ids=first["tokens"], attention_mask=first["mask"].long(), labels=first["labels"],
                      **{k: first[k] for k in ("pixel_values", "image_position_ids", "mm_token_type_ids")}).loss.item()
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses, expected)
    before, after = read_tensors(base / "model.safetensors"), read_tensors(out / "step_2/model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("model.vision_tower."))
    errors = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
        code = generate.main(["--config", str(ROOT / "configs/generate.yaml"), f"checkpoint_dir={out / 'step_2'}",
                              f"image={colours / 'red_3.png'}", "prompt=Colour?", "max_new_tokens=3"])
    assert code == 0, errors.getvalue()[-2000:]
