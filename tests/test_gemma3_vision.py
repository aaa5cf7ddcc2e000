"""Gemma 3 with images (``Gemma3ForConditionalGeneration`` is the oracle): the native model loads the whole repo,
SigLIP tower and projector included, takes the processor's ``pixel_values`` and ``token_type_ids`` by their names,
and computes transformers' logits in fp32 (several images a row, sliding layers whose window an image crosses, the
bidirectional attention inside each image); HF -> native -> HF is bitwise, with SigLIP's unused head carried."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_family_config
from waypoint.checkpointers import HFCheckpointer, load_model
from waypoint.checkpointers.file_formats import read_tensors

pytest.importorskip("transformers")

IMAGE, BOI, EOI = 127, 125, 126  # the tiny vocabulary's last ids
TOKENS_PER_IMAGE = 4


def vlm_repo(path, use_head: bool = False, seed: int = 0, sliding_window: int = 4, image_size: int = 28,
             patch_size: int = 7, mm_tokens_per_image: int = TOKENS_PER_IMAGE):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_family_config("gemma3", sliding_window=sliding_window).to_dict()
    config = Gemma3Config(text_config={k: v for k, v in text.items() if k not in ("model_type", "architectures")},
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                             image_size=image_size, patch_size=patch_size, vision_use_head=use_head),
                          mm_tokens_per_image=mm_tokens_per_image, image_token_index=IMAGE, boi_token_index=BOI,
                          eoi_token_index=EOI)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if name.endswith(("norm.weight", ".bias", "norm1.weight", "norm2.weight")) \
                else p.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size="60KB")
    return model


def with_images(text: list[list[int]], n_images: list[int], seed: int = 1, tokens: int = TOKENS_PER_IMAGE,
                size: int = 28):
    """Rows of token ids with ``<boi> <image>*tokens <eoi>`` where a row says -1 (right-padded with token 0 to one
    length), the token types, random pixel values."""
    rows, types = [], []
    for row in text:
        ids = []
        for t in row:
            ids += [BOI, *[IMAGE] * tokens, EOI] if t == -1 else [t]
        rows.append(ids)
    width = max(map(len, rows))
    rows = [ids + [0] * (width - len(ids)) for ids in rows]
    for ids in rows:
        types.append([int(t == IMAGE) for t in ids])
    images = sum(n_images)
    pixels = torch.randn(images, 3, size, size, generator=torch.Generator().manual_seed(seed))
    return torch.tensor(rows), torch.tensor(types), pixels


ROWS = [[5, 9, -1, 17, 3, 8, -1, 40, 2, 11, 12], [7, -1, 33, 21, 4, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]  # 2 images, then 1


@pytest.mark.parametrize("use_head", [False, True], ids=["no-head", "siglip-head"])
def test_logits_with_images_equal_transformers(tmp_path, use_head):
    hf = vlm_repo(tmp_path / "in", use_head=use_head)
    tokens, types, pixels = with_images(ROWS, [2, 1])
    model = load_model(tmp_path / "in").eval()
    assert model.args.vision is not None and model.vision is not None
    with torch.no_grad():
        expected = hf(input_ids=tokens, pixel_values=pixels, token_type_ids=types).logits
        got = model(tokens, pixel_values=pixels, token_type_ids=types)
        text_only = (model(tokens) - hf(input_ids=tokens).logits).abs().max().item()
        no_bidirectional = (model(tokens, pixel_values=pixels) - expected).abs().max().item()
    diff = (got - expected).abs().max().item()
    print(f"\ngemma3 with images: max |native - transformers| logit = {diff:.3g} (scale {expected.abs().max():.3g}); "
          f"text only {text_only:.3g}")
    assert diff <= 1e-5 and text_only <= 1e-5
    assert no_bidirectional > 1e-3  # the image's bidirectional attention is what makes them equal


@pytest.mark.parametrize("image_size,mm_tokens_per_image,tokens", [(20, 2, 1), (25, 4, 4), (20, 5, 4)],
                         ids=["2-on-4x4", "4-on-5x5", "5-on-4x4"])
def test_tokens_per_image_pooled_as_transformers(tmp_path, image_size, mm_tokens_per_image, tokens):
    """mm_tokens_per_image whose root does not divide the patch grid (transformers' own tester: 2 on 4x4 patches)
    pools as transformers' projector does: a kernel of the grid's side over int(sqrt(mm_tokens_per_image)), so an
    image becomes ``image_tokens`` tokens (the processor's image_seq_length must give it that many, as transformers')."""
    hf = vlm_repo(tmp_path / "in", image_size=image_size, patch_size=5, mm_tokens_per_image=mm_tokens_per_image)
    model = load_model(tmp_path / "in").eval()
    assert (model.args.vision.tokens_per_image, model.args.vision.image_tokens) == (mm_tokens_per_image, tokens)
    ids, types, pixels = with_images(ROWS, [2, 1], tokens=tokens, size=image_size)
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels, token_type_ids=types).logits
        got = model(ids, pixel_values=pixels, token_type_ids=types)
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("n", [25, 0])
def test_tokens_per_image_transformers_cannot_pool_are_refused(n):
    """Where transformers' pooling kernel would be 0 (more tokens a side than patches), in one line by config.json's
    names."""
    from waypoint.families.vision_rules import gemma3_vision

    with pytest.raises(ValueError, match=f"^mm_tokens_per_image={n} does not pool from vision_config's 4x4 patch grid "
                                         r"\(image_size 20, patch_size 5\): set it to at least 1 and at most 16") as e:
        gemma3_vision({"vision_config": {"image_size": 20, "patch_size": 5}, "mm_tokens_per_image": n})
    assert "\n" not in str(e.value)


def test_round_trip_is_bitwise_and_the_head_is_carried(tmp_path):
    vlm_repo(tmp_path / "in", use_head=True)
    index_in = json.loads((tmp_path / "in/model.safetensors.index.json").read_text())["weight_map"]
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()["model"]
    assert any(k.startswith("vision.layers.1.attn.o_proj") for k in state) and "projector.weight" in state
    assert not any(k.startswith("vision_tower.head") for k in state)  # carried, not loaded
    out = ckpt.save_checkpoint({"model": state}, step=1)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == index_in
    for f in set(index_in.values()):
        before, after = read_tensors(tmp_path / "in" / f), read_tensors(out / f)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), f


def test_a_trained_tower_is_written_under_its_hf_names(tmp_path):
    """What the model's tower and projector hold is what the files get (the tower is not a passthrough)."""
    from transformers import Gemma3ForConditionalGeneration

    vlm_repo(tmp_path / "in")
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = dict(ckpt.load_checkpoint()["model"])
    state["vision.layers.0.attn.q_proj.weight"] = state["vision.layers.0.attn.q_proj.weight"] + 1.0
    state["projector.weight"] = state["projector.weight"] * 2
    out = ckpt.save_checkpoint({"model": state}, step=1)
    reloaded = Gemma3ForConditionalGeneration.from_pretrained(out)
    hf_state = reloaded.state_dict()
    q = next(v for k, v in hf_state.items() if k.endswith("encoder.layers.0.self_attn.q_proj.weight"))
    proj = next(v for k, v in hf_state.items() if k.endswith("mm_input_projection_weight"))
    assert torch.equal(q, state["vision.layers.0.attn.q_proj.weight"]) and torch.equal(proj, state["projector.weight"])


def test_google_layout_vision_model_prefix_round_trips(tmp_path):
    """Google's files nest the tower under ``vision_tower.vision_model.``: read there and written back there."""
    from safetensors.torch import save_file

    hf = vlm_repo(tmp_path / "v5")
    google = tmp_path / "google"
    google.mkdir()
    renamed = {(k.replace("vision_tower.", "vision_tower.vision_model.", 1) if k.startswith("vision_tower.") else k): v
               for k, v in read_tensors_all(tmp_path / "v5").items()}
    save_file(renamed, google / "model.safetensors", metadata={"format": "pt"})
    (google / "config.json").write_text((tmp_path / "v5/config.json").read_text())
    tokens, types, pixels = with_images(ROWS, [2, 1])
    with torch.no_grad():
        diff = (load_model(google).eval()(tokens, pixel_values=pixels, token_type_ids=types)
                - hf(input_ids=tokens, pixel_values=pixels, token_type_ids=types).logits).abs().max().item()
    assert diff <= 1e-5
    ckpt = HFCheckpointer(google, output_dir=tmp_path / "out")
    out = ckpt.save_checkpoint({"model": ckpt.load_checkpoint()["model"]}, step=1)
    after = read_tensors(out / "model.safetensors")
    assert after.keys() == renamed.keys() and all(torch.equal(after[k], renamed[k]) for k in renamed)


def read_tensors_all(directory):
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors |= read_tensors(f)
    return tensors


def test_greedy_generation_about_an_image_equals_transformers(tmp_path):
    """The prompt's images go into the first forward (the cache then holds their keys), as transformers' generate."""
    from waypoint.models.generate import Sampling, generate

    hf = vlm_repo(tmp_path / "in")
    tokens, types, pixels = with_images([[5, 9, -1, 17, 3]], [1])
    model = load_model(tmp_path / "in").eval()
    ours = generate(model, tokens[0].tolist(), 8, Sampling(temperature=0.0),
                    images={"pixel_values": pixels, "token_type_ids": types})
    theirs = hf.generate(input_ids=tokens, pixel_values=pixels, token_type_ids=types, attention_mask=torch.ones_like(tokens),
                         max_new_tokens=8, do_sample=False, eos_token_id=None)[0, tokens.shape[1]:].tolist()
    without = generate(model, tokens[0].tolist(), 8, Sampling(temperature=0.0))
    assert ours == theirs and ours != without
