"""HFCheckpointer against transformers as the oracle: logits on load, files/keys/bytes on save."""

from __future__ import annotations

import json
import os

import pytest
import torch

from waypoint.checkpointers import CheckpointError, HFCheckpointer, load_into, load_model
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.families import from_hf_config
from tests.conftest import tiny_llama_config, write_hf_checkpoint

CONFIGS = {
    "mha": dict(n_heads=4, n_kv_heads=4),
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "head_dim_24": dict(n_heads=4, n_kv_heads=2, head_dim=24),
}


def weight_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin")))


@pytest.fixture(params=[(c, f) for c in CONFIGS for f in ("safetensors", "bin")], ids=lambda p: f"{p[0]}-{p[1]}")
def checkpoint(request, tmp_path):
    name, fmt = request.param
    hf_model = write_hf_checkpoint(tmp_path / "in", tiny_llama_config(**CONFIGS[name]), fmt=fmt)
    return hf_model, tmp_path / "in"


def test_load_matches_transformers_logits(checkpoint, tokens):
    hf_model, path = checkpoint
    assert len(weight_files(path)) >= 3, "the fixture must be sharded"
    model = load_model(path).eval()
    with torch.no_grad():
        diff = (model(tokens) - hf_model(tokens).logits).abs().max().item()
    assert diff <= 1e-5


def test_save_reproduces_input_files_keys_and_bytes(checkpoint, tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model, path = checkpoint
    ckpt = HFCheckpointer(path, output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()
    out = ckpt.save_checkpoint(state, step=5)
    assert out == tmp_path / "out" / "step_5"
    assert weight_files(out) == weight_files(path)
    for name in weight_files(path):
        before, after = read_tensors(path / name), read_tensors(out / name)
        assert list(after) == list(before) or set(after) == set(before), name
        for key in before:
            assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    index_name = [f for f in os.listdir(path) if f.endswith(".index.json")][0]
    before, after = json.loads((path / index_name).read_text()), json.loads((out / index_name).read_text())
    assert after["weight_map"] == before["weight_map"]
    assert after["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf_model.state_dict().values())
    for side_file in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (out / side_file).is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (reloaded(tokens).logits - hf_model(tokens).logits).abs().max().item() <= 1e-5


def test_unindexed_single_file_stays_single(tmp_path):
    write_hf_checkpoint(tmp_path / "in", tiny_llama_config(), max_shard_size="50MB")
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=1)
    assert sorted(set(os.listdir(out)) - {"MANIFEST.json"}) == sorted(os.listdir(tmp_path / "in"))
    assert not list(out.glob("*.index.json"))


def test_bin_to_safetensors_on_request_renames_files(tmp_path, tokens):
    from transformers import AutoModelForCausalLM

    hf_model = write_hf_checkpoint(tmp_path / "in", tiny_llama_config(), fmt="bin")
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out", safe_serialization=True)
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=2)
    assert weight_files(out) == [f.replace("pytorch_model", "model").replace(".bin", ".safetensors") for f in weight_files(tmp_path / "in")]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(weight_files(out))
    with torch.no_grad():
        assert (AutoModelForCausalLM.from_pretrained(out)(tokens).logits - hf_model(tokens).logits).abs().max() <= 1e-5


def test_dtype_is_the_inputs_unless_asked_and_config_records_what_was_written(tmp_path):
    """The files hold fp32 (config.json claims bf16): a model cast to bf16 is written back in fp32, each tensor in
    its input twin's dtype, and config.json says so; output_dtype=bf16 writes bf16."""
    write_hf_checkpoint(tmp_path / "in", tiny_llama_config().__class__(**{**tiny_llama_config().to_dict(), "dtype": "bfloat16"}))
    for output_dtype, expected, name in ((None, torch.float32, "float32"), ("bf16", torch.bfloat16, "bfloat16")):
        ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / f"out-{name}", output_dtype=output_dtype)
        state = ckpt.load_checkpoint()
        assert {t.dtype for t in state["model"].values()} == {torch.float32}  # what the files hold
        state["model"] = {k: v.to(torch.bfloat16) for k, v in state["model"].items()}
        out = ckpt.save_checkpoint(state, step=1)
        assert json.loads((out / "config.json").read_text())["dtype"] == name
        assert {t.dtype for f in weight_files(out) for t in read_tensors(out / f).values()} == {expected}


def test_optimizer_updates_the_loaded_parameters(tmp_path, tokens):
    write_hf_checkpoint(tmp_path / "in", tiny_llama_config())
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    loaded = ckpt.load_checkpoint()["model"]
    with torch.device("meta"):
        model = from_hf_config(ckpt.config)
    load_into(model, loaded)
    assert all(not p.is_meta for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(tokens).sum().backward()
    optimizer.step()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before), f"optimizer left {set(before) - set(changed)} unchanged"
    # and the files the parameters were mapped from are untouched (private mapping)
    again = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out").load_checkpoint()["model"]
    assert all(torch.equal(again[k], before[k]) for k in before)


def test_save_never_overwrites_an_existing_step(tmp_path):
    write_hf_checkpoint(tmp_path / "in", tiny_llama_config())
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()
    (tmp_path / "out" / "step_1").mkdir(parents=True)
    (tmp_path / "out" / "step_1" / "keep.txt").write_text("user data")
    with pytest.raises(CheckpointError, match="step_1: already exists"):
        ckpt.save_checkpoint(state, step=1)
    assert (tmp_path / "out" / "step_1" / "keep.txt").read_text() == "user data"
    assert sorted(os.listdir(tmp_path / "out")) == ["step_1"], "no temporary directory may be left behind"


def test_layers_the_model_does_not_run_are_carried_untouched(tmp_path):
    """A family may declare keys it carries (DeepSeek-V3's multi-token-prediction layer after the last one): they
    stay out of the native model, the load report says so, and every save writes them back in their files."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    write_hf_checkpoint(tmp_path / "in", tiny_llama_config())
    index_path = tmp_path / "in" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(set(index["weight_map"].values()))[-1]
    extra = {"model.layers.2.eh_proj.weight": torch.randn(8, 16), "model.layers.2.enorm.weight": torch.randn(8)}
    save_file({**load_file(tmp_path / "in" / name), **extra}, tmp_path / "in" / name, metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(extra, name))
    index_path.write_text(json.dumps(index))
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    ckpt.family = dataclasses.replace(ckpt.family, carried=lambda config: rf"^model\.layers\.{config['num_hidden_layers']}\.")
    state = ckpt.load_checkpoint()["model"]
    assert not [k for k in state if k.startswith("layers.2.")]
    assert "carried untouched: 2 tensors of layers the model does not run (model.layers.2.eh_proj.weight, " \
           "model.layers.2.enorm.weight); written back as they came" in ckpt.notes
    out = ckpt.save_checkpoint({"model": state}, step=1)
    written = read_tensors(out / name)
    assert all(torch.equal(written[k], t) for k, t in extra.items())
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == index["weight_map"]
