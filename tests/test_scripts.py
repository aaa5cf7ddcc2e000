"""scripts/convert.py and scripts/inspect.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from waypoint.checkpointers.file_formats import read_tensors
from scripts import convert, inspect as inspect_script
from tests.conftest import ROOT, tiny_family_config, tiny_llama_config, write_family_checkpoint, write_hf_checkpoint

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


def test_every_conversion_is_read_back_before_it_is_committed(tmp_path, capsys, monkeypatch):
    """The output goes through a checkpointer into a fresh model whose logits must match the input's; a converter
    that writes a broken model (here the RoPE permutation undone on the way out) fails in one line and leaves
    no output, committed or half-written."""
    from waypoint.converters.ops import RopePermute

    assert convert.main([str(TINY), str(tmp_path / "meta"), "--to", "meta"]) == 0
    assert "export verified: max |dlogit| 0 over 2x64 tokens" in capsys.readouterr().out
    monkeypatch.setattr(RopePermute, "inverse", lambda self, tensors: list(tensors))
    assert convert.main([str(TINY), str(tmp_path / "broken"), "--to", "hf", "--num-shards", "2"]) == 1
    assert "error: the export does not compute what was written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta"]  # no output, no staging left
    assert convert.main([str(TINY), str(tmp_path / "unchecked"), "--to", "hf", "--num-shards", "2", "--no-verify"]) == 0
    assert "export verified" not in capsys.readouterr().out


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


@pytest.mark.parametrize("via", ["native", "meta"])
def test_converted_back_to_hf_is_the_original_config_files_and_key_map(tmp_path, via):
    """HF -> native/Meta -> HF gives back the input's config.json, file names, key -> file map (transformers packs
    small shards out of key order) and index metadata, and the same tensors."""
    family = "qwen2" if via == "native" else "llama"  # Meta's reference layout has no q/k/v biases
    config = tiny_family_config(family, bos_token_id=1, eos_token_id=2, max_position_embeddings=96)
    write_family_checkpoint(tmp_path / "hf", config, max_shard_size="30KB")
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / via), "--to", via]) == 0
    assert convert.main([str(tmp_path / via), str(tmp_path / "back"), "--to", "hf"]) == 0
    hf, back = tmp_path / "hf", tmp_path / "back"
    names = sorted(p.name for p in hf.iterdir())
    assert sorted(p.name for p in back.iterdir() if p.name != "MANIFEST.json") == names
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    index_in = json.loads((hf / "model.safetensors.index.json").read_text())
    index_out = json.loads((back / "model.safetensors.index.json").read_text())
    assert index_out == index_in
    for name in names:
        if name.endswith(".safetensors"):
            before, after = read_tensors(hf / name), read_tensors(back / name)
            assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), name


def test_without_a_source_config_json_comes_from_the_weights_and_tokenizer(tmp_path):
    """Meta -> HF with nothing kept: positions, rope, ids and dtype say what params.json, the tensors and the
    tokenizer say, and transformers' logits equal the input's."""
    assert convert.main([str(TINY), str(tmp_path / "meta"), "--to", "meta"]) == 0
    (tmp_path / "meta" / "hf_source.json").unlink()
    assert convert.main([str(tmp_path / "meta"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads((TINY / "config.json").read_text())
    tokenizer = json.loads((TINY / "tokenizer.json").read_text())
    eos = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "</s>")
    assert config["eos_token_id"] == eos and config["dtype"] == "float32"
    assert config["rope_parameters"]["rope_theta"] == original.get("rope_theta", original.get("rope_parameters", {}).get("rope_theta"))
    tokens = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    assert (logits(tmp_path / "hf", tokens) - logits(TINY, tokens)).abs().max().item() <= 1e-6


def test_meta_model_parallel_files_split_llama3_embedding_by_vocabulary_rows(tmp_path):
    """Llama 3's reference code splits the embedding by rows (VocabParallelEmbedding), Llama 2's by columns."""
    for vocab, dim_split in ((128256, 0), (512, 1)):
        config = tiny_family_config("llama", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2)
        write_family_checkpoint(tmp_path / f"hf{vocab}", config, max_shard_size="100MB")
        out = tmp_path / f"meta{vocab}"
        assert convert.main([str(tmp_path / f"hf{vocab}"), str(out), "--to", "meta", "--num-shards", "2"]) == 0
        part = torch.load(out / "consolidated.00.pth", weights_only=True)["tok_embeddings.weight"]
        assert part.shape == ((vocab // 2, 16) if dim_split == 0 else (vocab, 8))
        assert convert.main([str(out), str(tmp_path / f"back{vocab}"), "--to", "hf"]) == 0
        before = read_tensors(tmp_path / f"hf{vocab}" / "model.safetensors")
        after = read_tensors(tmp_path / f"back{vocab}" / "model.safetensors")
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_family_meta_cannot_hold_is_refused_in_one_line(tmp_path, capsys):
    write_family_checkpoint(tmp_path / "qwen3", tiny_family_config("qwen3"))
    assert convert.main([str(tmp_path / "qwen3"), str(tmp_path / "meta"), "--to", "meta"]) == 1
    errors = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Meta's reference layout holds Llama-architecture models" in errors[0]
    assert "attn.k_norm.weight" in errors[0] and not (tmp_path / "meta").exists()
