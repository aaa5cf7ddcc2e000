"""Checkpoint layouts beyond one model in one set of keys: MoE experts (per-expert or packed keys), a text model
nested in a multimodal repo, a native checkpoint remembering its family."""

from __future__ import annotations

import json

import pytest
import torch

from waypoint.checkpointers import CheckpointError, HFCheckpointer, load_into, load_model
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.families import from_hf_config
from tests.conftest import tiny_family_config, write_family_checkpoint
from tests.test_families import FAMILIES


# -- mixture of experts ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe-packed", "qwen2-moe"])
def test_moe_aux_loss_is_transformers_router_loss(name, tmp_path, tokens):
    """The load-balancing loss of the native model equals transformers' ``aux_loss`` (output_router_logits) on
    the same batch and weights, and the coefficient is the config's."""
    fam, overrides, _ = FAMILIES[name]
    config = tiny_family_config(fam, **overrides, router_aux_loss_coef=0.02)
    hf_model = write_family_checkpoint(tmp_path / "in", config, packed=name.endswith("-packed"))
    model = load_model(tmp_path / "in").eval()
    with torch.no_grad():
        theirs = hf_model(tokens, output_router_logits=True)
        model(tokens)
        ours = model.aux_loss()
    assert model.args.router_aux_loss_coef == 0.02
    assert theirs.aux_loss is not None and abs(ours.item() - theirs.aux_loss.item()) <= 1e-6, (ours, theirs.aux_loss)
    uniform = torch.full_like(model.router_logits[0], 0.0)
    from waypoint.models.balance_loss import load_balancing_loss
    assert load_balancing_loss([uniform], model.args.n_experts, model.args.experts_per_token).item() != pytest.approx(ours.item())


def test_an_expert_group_spread_over_files_loads_and_saves_back(tmp_path):
    """Per-expert keys of one layer in several shards (small max_shard_size): stacked on load, unstacked into the
    same files on save."""
    write_family_checkpoint(tmp_path / "in", tiny_family_config("mixtral"), max_shard_size="20KB")
    index = json.loads((tmp_path / "in/model.safetensors.index.json").read_text())["weight_map"]
    files = {f for k, f in index.items() if k.startswith("model.layers.0.block_sparse_moe.experts.")}
    assert len(files) > 1, "the fixture must spread one layer's experts over files"
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()
    assert tuple(state["model"]["layers.0.moe.w1"].shape) == (4, 32, 64)
    out = ckpt.save_checkpoint(state, step=1)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == index
    for f in set(index.values()):
        before, after = read_tensors(tmp_path / "in" / f), read_tensors(out / f)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_lora_on_experts_is_refused_in_one_line(tmp_path):
    from waypoint.checkpointers.peft_adapter import check_targets
    from waypoint.models.lora import apply_lora

    write_family_checkpoint(tmp_path / "in", tiny_family_config("mixtral"))
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    model = load_model(tmp_path / "in")
    apply_lora(model, ["q_proj", "v_proj"], rank=2, alpha=4)
    check_targets(model, ckpt.hf_converter(), ckpt.family)  # attention: fine
    model = load_model(tmp_path / "in")
    with pytest.raises((CheckpointError, ValueError), match="w1") as e:
        apply_lora(model, ["w1"], rank=2, alpha=4)
        check_targets(model, ckpt.hf_converter(), ckpt.family)
    assert "\n" not in str(e.value)


def test_multimodal_gemma3_trains_its_text_model_and_keeps_the_vision_tower(tmp_path, tokens):
    """A Gemma3ForConditionalGeneration repo: the text model under language_model. loads with transformers' logits,
    and saving writes every file back bitwise, vision tower included, with the prefix and key map it came with."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_family_config("gemma3").to_dict()
    config = Gemma3Config(text_config={k: v for k, v in text.items() if k not in ("model_type", "architectures")},
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14),
                          mm_tokens_per_image=4, image_token_index=127, boi_token_index=125, eoi_token_index=126)
    torch.manual_seed(0)
    hf_model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if name.endswith(("norm.weight", ".bias")) else p.normal_(0.0, 0.1)
    hf_model.save_pretrained(tmp_path / "in", max_shard_size="40KB")
    index_in = json.loads((tmp_path / "in/model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("vision_tower.") for k in index_in) and any(k.startswith("language_model.model.") for k in index_in)

    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    assert ckpt.model_type == "GEMMA3"
    state = ckpt.load_checkpoint()
    with torch.device("meta"):
        model = from_hf_config(ckpt.config)
    load_into(model, state["model"])
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
        diff = (model.eval()(tokens) - expected).abs().max().item()
    assert diff <= 1e-5, diff
    out = ckpt.save_checkpoint({"model": model.state_dict()}, step=1)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == index_in
    for f in set(index_in.values()):
        before, after = read_tensors(tmp_path / "in" / f), read_tensors(out / f)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), f
    reloaded = Gemma3ForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=tokens).logits, expected)


@pytest.mark.parametrize("fam", ["phi3", "qwen3"])
def test_a_native_checkpoint_keeps_its_family_for_peft_names(fam, tmp_path):
    """A native checkpoint converted from HF names its family, so LoRA adapters get that family's PEFT modules
    (Phi-3's fused projections refused, Qwen3's q/k rows permuted as Qwen3's), not Llama's."""
    from scripts import convert
    from waypoint.checkpointers import NativeCheckpointer
    from waypoint.checkpointers.peft_adapter import check_targets, hf_module
    from waypoint.models.lora import apply_lora

    write_family_checkpoint(tmp_path / "hf", tiny_family_config(fam))
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "native"), "--to", "native"]) == 0
    ckpt = NativeCheckpointer(tmp_path / "native", output_dir=tmp_path / "out")
    assert ckpt.family.name == fam
    model = load_model(tmp_path / "native")
    converter = ckpt.hf_converter()
    assert hf_module(converter, "layers.0.attn.output_proj") == "model.layers.0.self_attn.o_proj"
    apply_lora(model, ["q_proj"], rank=2, alpha=4)
    if fam == "phi3":
        with pytest.raises(CheckpointError, match="q_proj cannot be adapted in phi3 models"):
            check_targets(model, converter, ckpt.family)
    else:
        check_targets(model, converter, ckpt.family)
        assert any(g.targets == ("model.layers.0.self_attn.q_norm.weight",) for g in converter.plan(["layers.0.attn.q_norm.weight"], "native"))
