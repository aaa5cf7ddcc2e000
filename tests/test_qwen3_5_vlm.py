"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``, and its MoE sibling, are the oracles): the native model
loads the whole repo, vision tower included, takes the processor's ``pixel_values``, ``image_grid_thw`` and
``mm_token_type_ids`` by their names, places the merged image embeddings at ``<|image_pad|>`` and gives the image
tokens mRoPE's 2-D positions; fp32 logits equal transformers' (several images a row, grids of several shapes);
greedy generation after an image equals transformers' generate (the positions after an image run behind the tokens);
HF -> native -> HF is bitwise."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import on_test_device
from waypoint.checkpointers import HFCheckpointer, load_model
from waypoint.checkpointers.file_formats import read_tensors

pytest.importorskip("transformers")

VISION = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=16)
TEXT = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [3, 3, 2], "mrope_interleaved": True})
START, IMAGE, END = 120, 121, 122  # vision_start, image_pad, vision_end


def vlm_repo(path, moe: bool = False):
    import transformers

    text = dict(TEXT, **(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                shared_expert_intermediate_size=16) if moe else {}))
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(vision_config=VISION, text_config=text, image_token_id=IMAGE,
                                                    vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="100KB")
    return model


GRIDS = [[1, 4, 6], [1, 2, 2], [1, 6, 4]]  # patches (t, h, w): 6, 1 and 6 merged tokens


def batch(rows: list[list[int]], grids: list[list[int]], seed: int = 1):
    """Rows of ids where -1 is an image (``<|vision_start|> <|image_pad|>*n <|vision_end|>``, n its merged tokens),
    the token types and random patches for ``grids`` in order."""
    it, out = iter(grids), []
    for row in rows:
        ids = []
        for t in row:
            if t == -1:
                g = next(it)
                ids += [START, *[IMAGE] * (g[0] * g[1] * g[2] // 4), END]
            else:
                ids.append(t)
        out.append(ids)
    width = max(map(len, out))
    assert all(len(r) == width for r in out), [len(r) for r in out]
    tokens = torch.tensor(out)
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))
    return tokens, (tokens == IMAGE).long(), pixels, torch.tensor(grids)


ROWS = [[5, 9, -1, 17, 3, 8, 40, 2, 11, 12, 13, 14, 15, 16], [7, -1, 33, -1, 60, 61, 62, 63, 64, 65, 66, 67]]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_with_images_equal_transformers(tmp_path, moe):
    hf = vlm_repo(tmp_path / "in", moe)
    tokens, types, pixels, grids = batch(ROWS, GRIDS)
    model = load_model(tmp_path / "in").eval()
    assert model.args.vision.tower == "qwen3_5" and model.args.mrope_section == (3, 3, 2)
    hf, model, tokens, types, pixels, grids = on_test_device(hf, model, tokens, types, pixels, grids)
    with torch.no_grad():
        expected = hf(input_ids=tokens, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=types).logits
        got = model(tokens, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=types)
        flat = model(tokens, pixel_values=pixels, image_grid_thw=grids)  # the images, without their 2-D positions
        text = (model(tokens) - hf(input_ids=tokens).logits).abs().max().item()
    diff = (got - expected).abs().max().item()
    print(f"\nqwen3.5{'-moe' if moe else ''} with images: max |native - transformers| logit = {diff:.3g} "
          f"(scale {expected.abs().max():.3g}); text only {text:.3g}")
    assert diff <= 1e-5 and text <= 1e-5
    assert (flat - expected).abs().max().item() > 1e-4  # mRoPE's positions are what make them equal


def test_greedy_generation_after_an_image_equals_transformers(tmp_path):
    from waypoint.models.generate import Sampling, generate

    hf = vlm_repo(tmp_path / "in")
    tokens, types, pixels, grids = batch([[5, 9, -1, 17, 3]], [[1, 4, 6]])
    model = load_model(tmp_path / "in").eval()
    ours = generate(model, tokens[0].tolist(), 10, Sampling(temperature=0.0),
                    images={"pixel_values": pixels, "image_grid_thw": grids, "mm_token_type_ids": types})
    theirs = hf.generate(input_ids=tokens, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=types,
                         attention_mask=torch.ones_like(tokens), max_new_tokens=10, do_sample=False,
                         eos_token_id=None)[0, tokens.shape[1]:].tolist()
    assert ours == theirs


def test_round_trip_is_bitwise_with_the_tower_loaded(tmp_path):
    vlm_repo(tmp_path / "in")
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()["model"]
    assert "vision.patch_embedding.weight" in state and state["vision.patch_embedding.weight"].dim() == 2
    out = ckpt.save_checkpoint({"model": state}, step=1)
    files = sorted(p.name for p in (tmp_path / "in").glob("*.safetensors"))
    assert files == sorted(p.name for p in out.glob("*.safetensors"))
    for f in files:
        before, after = read_tensors(tmp_path / "in" / f), read_tensors(out / f)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), f
