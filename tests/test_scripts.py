"""scripts/convert.py and scripts/inspect.py."""

from __future__ import annotations

import json
import os

import torch

from waypoint.checkpointers.file_formats import read_tensors
from scripts import convert, inspect as inspect_script
from tests.conftest import ROOT, tiny_llama_config, write_hf_checkpoint

TINY = ROOT / "assets/tiny_llama"


def logits(path, tokens):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(path)).eval()(tokens).logits


def test_hf_to_meta_to_native_to_hf_keeps_the_model(tmp_path, capsys):
    tokens = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    assert convert.main([str(TINY), str(tmp_path / "meta"), "--to", "meta", "--num-shards", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "meta").glob("*.pth")) == ["consolidated.00.pth", "consolidated.01.pth"]
    assert convert.main([str(tmp_path / "meta"), str(tmp_path / "native"), "--to", "native"]) == 0
    assert len(list((tmp_path / "native").glob("*.safetensors"))) == 2, "as many files as the input by default"
    assert convert.main([str(tmp_path / "native"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert (logits(tmp_path / "hf", tokens) - logits(TINY, tokens)).abs().max().item() <= 1e-6
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes()


def test_same_format_keeps_files_and_reshards_on_request(tmp_path):
    assert convert.main([str(TINY), str(tmp_path / "same"), "--to", "hf"]) == 0
    for f in TINY.glob("*.safetensors"):
        before, after = read_tensors(f), read_tensors(tmp_path / "same" / f.name)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert convert.main([str(TINY), str(tmp_path / "small"), "--to", "hf", "--max-shard-size", "600KB"]) == 0
    index = json.loads((tmp_path / "small" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 6 and all(os.path.getsize(tmp_path / "small" / f) <= 600_000 + 300_000 for f in files)
    tokens = torch.randint(0, 512, (1, 5))
    assert (logits(tmp_path / "small", tokens) - logits(TINY, tokens)).abs().max().item() == 0


def test_convert_refuses_a_non_empty_output(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert.main([str(TINY), str(out), "--to", "native"]) == 1
    assert "not empty; choose another directory or pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert convert.main([str(tmp_path / "nowhere"), str(tmp_path / "x"), "--to", "hf"]) == 1
    assert convert.main([str(TINY), str(out), "--to", "native", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists()


def test_inspect_tells_what_a_checkpoint_is(tmp_path, capsys):
    write_hf_checkpoint(tmp_path / "hf", tiny_llama_config(tie=True))
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "native"), "--to", "native"]) == 0
    capsys.readouterr()
    assert inspect_script.main([str(tmp_path / "native")]) == 0
    out = capsys.readouterr().out
    assert "native checkpoint, model type LLAMA2" in out
    assert "layers.{0..1}.attn.q_proj.weight" in out and "[64, 64]" in out and "F32" in out
    assert "tied: output.weight = tok_embeddings.weight (stored once)" in out
    assert "manifest: verified" in out
    assert inspect_script.main([str(TINY)]) == 0
    out = capsys.readouterr().out
    assert "hf checkpoint, model type LLAMA2" in out and "total: 869,504 parameters" in out
    assert "manifest: none" in out


def test_hf_to_native_and_back_is_bitwise_with_the_same_config(tmp_path):
    write_hf_checkpoint(tmp_path / "hf", tiny_llama_config(tie=True), max_shard_size="60KB")
    n_files = len(list((tmp_path / "hf").glob("*.safetensors")))
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "native"), "--to", "native"]) == 0
    assert convert.main([str(tmp_path / "native"), str(tmp_path / "back"), "--to", "hf"]) == 0
    before, after = {}, {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        before.update(read_tensors(f))
    for f in (tmp_path / "back").glob("*.safetensors"):
        after.update(read_tensors(f))
    assert len(list((tmp_path / "back").glob("*.safetensors"))) == n_files
    assert before.keys() == after.keys() and "lm_head.weight" not in after
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((tmp_path / "hf" / "config.json").read_text())
