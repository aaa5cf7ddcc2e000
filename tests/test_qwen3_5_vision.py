"""Qwen3.5's vision tower (models.qwen3_5_vision) and image preprocessing (vision.qwen_images) against transformers:
the tower's merged embeddings against ``get_image_features`` of a tiny random ``Qwen3_5ForConditionalGeneration`` in
fp32 and fp64 (several images a call: grids smaller and larger than the learned position grid, non-square, one of
two frames), its weights through our names and back bitwise; the pixel values bitwise against the PIL image
processor, and the text expansion against ``Qwen3VLProcessor``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import on_test_device
from waypoint.converters.table import Converter
from waypoint.families.qwen_vision_rules import MODULES, qwen3_5_vision, qwen_vision_rules
from waypoint.models.qwen3_5_vision import QwenVisionTower
from waypoint.vision.qwen_images import (IMAGE_PLACEHOLDER, expand, from_checkpoint, image_token_count, mm_token_type_ids,
                                         preprocess, smart_resize)

# patch 4, a 4x4 learned position grid (16), out 48: the merged tokens' width
VISION = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=16)
TEXT = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"])
# (t, h, w) in patches: under the 4x4 grid in height, over it in both, equal, the least, tall, two frames
GRIDS = [[1, 2, 4], [1, 6, 10], [1, 4, 4], [1, 2, 2], [1, 8, 2], [2, 4, 6]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3_5ForConditionalGeneration (every weight, norms and biases too, moved off its init), saved by
    ``save_pretrained``; returns (the model, the folder)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(vision_config=VISION, text_config=TEXT)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("qwen3_5_vl")
    model.save_pretrained(path)
    return model, path


def from_hf_config(vision_config: dict):
    return qwen3_5_vision({"vision_config": vision_config})


def hf_to_native(hf_state: dict, prefix: str = "model.visual.", args=None) -> dict:
    """The tower's tensors under the tower's own names, through the family's converter rules (what loading does)."""
    rules = qwen_vision_rules(args or from_hf_config({}))
    native = Converter(rules=rules).to_native({"visual." + k[len(prefix):]: v for k, v in hf_state.items() if k.startswith(prefix)})
    return {k.removeprefix("vision."): native[k] for k in native}


def native_to_hf(state: dict, args, prefix: str = "model.visual.") -> dict:
    hf = Converter(rules=qwen_vision_rules(args)).from_native({"vision." + k: v for k, v in state.items()})
    return {prefix + k.removeprefix("visual."): v for k, v in hf.items()}


def hf_visual_state(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(path / "model.safetensors").items() if k.startswith("model.visual.")}


def native_tower(path) -> QwenVisionTower:
    config = json.loads((path / "config.json").read_text())
    tower = QwenVisionTower(from_hf_config(config["vision_config"])).eval()
    tower.load_state_dict(hf_to_native(hf_visual_state(path), args=tower.args))  # strict: every parameter, no other
    return tower


def random_patches(grids, patch_dim=96, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, patch_dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_tower_matches_transformers(checkpoint, dtype, tol):
    model, path = checkpoint
    tower = native_tower(path).to(dtype)
    hf = model.to(dtype)
    grid = torch.tensor(GRIDS)
    pixel_values = random_patches(GRIDS).to(dtype)
    tower, hf, pixel_values, grid = on_test_device(tower, hf, pixel_values, grid)
    try:
        with torch.no_grad():
            ref = torch.cat(hf.get_image_features(pixel_values, grid).pooler_output)  # what the language model takes
            ours = tower(pixel_values, grid)
    finally:
        model.float().cpu()
    assert ours.shape == ref.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 48) and ours.dtype == dtype
    diff = (ours - ref).abs().max().item()
    print(f"\n{dtype}: {len(GRIDS)} images, max |native - transformers| = {diff:.3g} (outputs ~{ref.abs().max():.2g})")
    assert diff <= tol


def test_tower_on_processed_images_matches_transformers(checkpoint, tmp_path):
    """End to end: our pixel values (of real images, resized) through both towers; a single image alone too."""
    model, path = checkpoint
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIGS[0]))
    tower = native_tower(path)
    for images in (IMAGES, IMAGES[:1]):
        batch = preprocess(images, from_checkpoint(tmp_path))
        with torch.no_grad():
            ref = torch.cat(model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output)
            assert (tower(batch["pixel_values"], batch["image_grid_thw"]) - ref).abs().max() <= 1e-5


def test_patch_embedding_is_the_conv3d():
    """Our Linear over the flat patch against transformers' Conv3d, at Qwen3.5's own shape (1152 wide, 16-pixel
    patches): the same sums in another order, so equal to rounding; against float64 the Linear is the nearer."""
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionPatchEmbed

    torch.manual_seed(0)
    conv = Qwen3_5VisionPatchEmbed(Qwen3_5VisionConfig(hidden_size=1152, patch_size=16))
    linear = torch.nn.Linear(1536, 1152)
    native = hf_to_native({f"patch_embed.{k}": v for k, v in conv.state_dict().items()}, prefix="",
                          args=from_hf_config({"hidden_size": 1152, "patch_size": 16}))
    linear.load_state_dict({k.removeprefix("patch_embedding."): v for k, v in native.items()})
    patches = torch.randn(1024, 1536)
    conv, linear, patches = on_test_device(conv, linear, patches)
    with torch.no_grad():
        exact = torch.nn.functional.linear(patches.double(), linear.weight.double(), linear.bias.double())
        ours, ref = linear(patches), conv(patches)
        conv.double()
        diff64 = (linear.double()(patches.double()) - conv(patches.double())).abs().max().item()
    diff, ours_err, ref_err = ((a - b).abs().max().item() for a, b in [(ours, ref), (ours, exact), (ref, exact)])
    print(f"\npatch embedding, outputs ~{exact.abs().max():.2g}: |linear - conv3d| fp32 {diff:.3g}, fp64 {diff64:.3g}; "
          f"from exact: linear {ours_err:.3g}, conv3d {ref_err:.3g}")
    assert diff64 <= 1e-12 and diff <= 1e-5 and ours_err <= ref_err


def test_state_dict_round_trip_is_bitwise(checkpoint):
    model, path = checkpoint
    hf_state = hf_visual_state(path)
    assert len(hf_state) == 33  # the positions; patch embedding, 2 layers of 6 modules, merger's 3: a weight and a bias each
    args = from_hf_config(json.loads((path / "config.json").read_text())["vision_config"])
    native = hf_to_native(hf_state, args=args)
    assert set(native) == set(native_tower(path).state_dict())
    back = native_to_hf(native, args)
    assert sorted(back) == sorted(hf_state)
    for key, tensor in hf_state.items():
        assert back[key].shape == tensor.shape and back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    # the standalone Qwen3_5VisionModel's keys (no prefix) and a language model's keys passed over
    bare = {k[len("model.visual."):]: v for k, v in hf_state.items()}
    assert set(hf_to_native({**bare}, prefix="", args=args)) == set(native)
    assert set(hf_to_native({**hf_state, "model.language_model.norm.weight": torch.ones(1)}, args=args)) == set(native)
    with pytest.raises(Exception, match="deepstack"):
        hf_to_native({"model.visual.deepstack_merger_list.0.norm.weight": torch.ones(1)}, args=args)
    assert all("{i}" in hf for hf, _ in MODULES if hf.startswith("blocks"))


def test_config_fields():
    from transformers import Qwen3_5VisionConfig

    args = from_hf_config(Qwen3_5VisionConfig(**VISION).to_dict())
    assert (args.dim, args.n_layers, args.n_heads, args.hidden_dim, args.out_dim, args.n_positions, args.patch_size,
            args.temporal_patch_size, args.merge_size, args.rope_theta) == (32, 2, 2, 40, 48, 16, 4, 2, 2, 10000.0)
    # an older config.json: model_type "qwen3_5", deepstack_visual_indexes [], no rope_parameters; the defaults
    default = from_hf_config({"model_type": "qwen3_5", "deepstack_visual_indexes": []})
    assert (default.dim, default.n_layers, default.patch_size, default.n_positions) == (1152, 27, 16, 2304)
    assert from_hf_config({**VISION, "rope_theta": 500.0, "patch_size": [4, 4]}).rope_theta == 500.0
    with pytest.raises(ValueError, match="axial"):
        from_hf_config({**VISION, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="square"):
        from_hf_config({**VISION, "num_position_embeddings": 15})


def test_bad_inputs_are_refused(checkpoint):
    tower = native_tower(checkpoint[1])
    with pytest.raises(ValueError, match="account"):
        tower(random_patches([[1, 2, 2]]), torch.tensor([[1, 2, 4]]))
    with pytest.raises(ValueError, match="multiples"):
        tower(random_patches([[1, 3, 2]]), torch.tensor([[1, 3, 2]]))


# Image preprocessing ----------------------------------------------------------------------------------------------

def _images():
    gen = np.random.default_rng(0)
    noise = Image.fromarray(gen.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    gradient = Image.fromarray(np.broadcast_to(np.linspace(0, 255, 120, dtype=np.uint8), (64, 120)).copy()).convert("RGB")
    rgba = np.concatenate([gen.integers(0, 256, (90, 70, 3)), np.tile(np.linspace(0, 255, 70), (90, 1))[..., None]], axis=-1)
    palette = Image.fromarray(gen.integers(0, 8, (20, 30), dtype=np.uint8), mode="L").convert("P")
    palette.info["transparency"] = 3
    return [Image.new("RGB", (30, 20), (255, 0, 0)),  # solid, upscaled (under min_pixels)
            noise,  # non-square, odd sides
            Image.fromarray(gen.integers(0, 256, (300, 200, 3), dtype=np.uint8)),  # downscaled (over max_pixels)
            gradient,
            Image.fromarray(rgba.astype(np.uint8), mode="RGBA"),  # transparency composited onto white
            Image.fromarray(gen.integers(0, 256, (9, 150), dtype=np.uint8), mode="L"),  # grey, 1:16
            Image.fromarray(gen.integers(0, 256, (40, 24, 2), dtype=np.uint8), mode="LA"),
            palette,  # a palette with a transparent colour
            Image.new("RGB", (32, 48), (10, 200, 30))]  # already whole blocks


IMAGES = _images()
# patch 4, merge 2 (factor 8), pixel bounds small enough that most images are resized; the second as Qwen3.5's own
# file writes it (mean/std 0.5, size's edges) with bilinear resampling, the third the legacy min/max_pixels keys
PREPROCESSOR_CONFIGS = [
    dict(size={"shortest_edge": 1024, "longest_edge": 4096}, patch_size=4, temporal_patch_size=2, merge_size=2),
    dict(size={"shortest_edge": 512, "longest_edge": 2048}, patch_size=4, temporal_patch_size=2, merge_size=2,
         image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], resample=2, image_processor_type="Qwen2VLImageProcessorFast"),
    dict(min_pixels=300, max_pixels=5000, patch_size=2, temporal_patch_size=3, merge_size=2, do_convert_rgb=True),
]


@pytest.mark.parametrize("config", PREPROCESSOR_CONFIGS)
def test_pixel_values_are_transformers_bitwise(config, tmp_path):
    from transformers import Qwen2VLImageProcessorPil

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    reference, settings = Qwen2VLImageProcessorPil.from_pretrained(tmp_path), from_checkpoint(tmp_path)
    for batch in [[image] for image in IMAGES] + [IMAGES]:
        ref = reference(batch, return_tensors="pt")
        ours = preprocess(batch, settings)
        assert ours["pixel_values"].dtype == ref["pixel_values"].dtype == torch.float32
        assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])
        assert torch.equal(ours["pixel_values"], ref["pixel_values"]), [image.mode for image in batch]
    sizes = [tuple(int(x) for x in g[1:] * settings.patch_size) for g in preprocess(IMAGES, settings)["image_grid_thw"]]
    assert sum(size != image.size[::-1] for size, image in zip(sizes, IMAGES)) >= 6  # most were resized


def test_smart_resize_is_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    for height in range(1, 400, 7):
        for width in range(1, 400, 11):
            if max(height, width) / min(height, width) <= 200:
                for factor, low, high in [(8, 1024, 4096), (28, 56 * 56, 28 * 28 * 1280), (32, 65536, 16777216)]:
                    assert smart_resize(height, width, factor, low, high) == reference(height, width, factor, low, high)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 8, 64, 4096)


def tiny_processor(image_processor, monkeypatch):
    """``Qwen3VLProcessor`` over a byte-level tokenizer holding Qwen's vision tokens. Its video processor needs
    torchvision, absent here: the constructor's class check is skipped for it (no videos are processed)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    tokenizer = TokenizersBackend(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    check = ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg))
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def test_text_expansion_is_the_processors(tmp_path, monkeypatch):
    from transformers import Qwen2VLImageProcessorPil

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIGS[0]))
    settings = from_checkpoint(tmp_path)
    processor = tiny_processor(Qwen2VLImageProcessorPil.from_pretrained(tmp_path), monkeypatch)
    texts = [f"Look: {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}, which is red?", f"{IMAGE_PLACEHOLDER}\nDescribe."]
    images = [IMAGES[0], IMAGES[2], IMAGES[5]]
    out = processor(images=images, text=texts)
    grids = preprocess(images, settings)["image_grid_thw"]
    assert torch.equal(grids, torch.as_tensor(out["image_grid_thw"]))
    expected = [expand(texts[0], grids[:2], settings.merge_size), expand(texts[1], grids[2:], settings.merge_size)]
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for ids, text, types, grid in zip(out["input_ids"], expected, out["mm_token_type_ids"], [grids[:2], grids[2:]]):
        assert processor.tokenizer.decode(ids) == text
        assert ids == processor.tokenizer(text)["input_ids"]
        assert types == mm_token_type_ids(ids, image_id, video_id)
        assert sum(types) == sum(image_token_count(g, settings.merge_size) for g in grid)
    counts = processor._get_num_multimodal_tokens(image_sizes=[image.size[::-1] for image in images])["num_image_tokens"]
    assert counts == [image_token_count(g, settings.merge_size) for g in grids]
    with pytest.raises(ValueError, match="2 <\\|image_pad\\|> in the text for 1 images"):
        expand(texts[0], grids[:1], 2)


def test_no_images_no_tokens(checkpoint):
    """A batch without images: the tower gives no tokens (and the model places none)."""
    _, path = checkpoint
    tower = native_tower(path)
    out = tower(torch.zeros(0, tower.args.patch_dim), torch.zeros(0, 3, dtype=torch.long))
    assert out.shape == (0, tower.args.out_dim)
