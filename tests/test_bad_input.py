"""Bad input: a one-line error naming the file or key, and nothing in output_dir touched."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from waypoint.checkpointers import HFCheckpointer, load_model
from tests.conftest import ROOT, tiny_llama_config, write_hf_checkpoint


def _first_shard(path):
    return sorted(path.glob("model-*.safetensors"))[0]


def missing_config(path):
    (path / "config.json").unlink()
    return r"config\.json: missing"


def truncated_shard(path):
    shard = _first_shard(path)
    shard.write_bytes(shard.read_bytes()[:-100])
    return rf"{shard.name}: unreadable weight file"


def index_names_missing_file(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return r"model\.safetensors\.index\.json: names 'model-00099-of-00099\.safetensors'"


def index_escapes_directory(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../outside.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return r"'\.\./outside\.safetensors' escapes the checkpoint directory"


def unknown_key(path):
    shard = _first_shard(path)
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, shard, metadata={"format": "pt"})
    return rf"unknown hf key 'model\.layers\.0\.self_attn\.q_proj\.bias' in {shard.name}"


def shape_does_not_fit(path):
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 100
    (path / "config.json").write_text(json.dumps(config))
    return r"layers\.0\.mlp\.w1\.weight: checkpoint shape \(96, 64\) does not fit the model's \(100, 64\)"


def heads_do_not_fit(path):
    config = json.loads((path / "config.json").read_text())
    config["num_attention_heads"], config["head_dim"] = 2, 16
    (path / "config.json").write_text(json.dumps(config))
    return r"cannot convert model\.layers\.0\.self_attn\.q_proj\.weight \(64, 64\) in model-"


CASES = [missing_config, truncated_shard, index_names_missing_file, index_escapes_directory, unknown_key,
         shape_does_not_fit, heads_do_not_fit]


@pytest.mark.parametrize("damage", CASES, ids=lambda f: f.__name__)
def test_bad_checkpoint_one_line_error_and_output_dir_untouched(damage, tmp_path, capsys):
    from recipes.full_finetune import main

    ckpt = tmp_path / "in"
    write_hf_checkpoint(ckpt, tiny_llama_config(), max_shard_size="60KB")
    (ckpt / "tokenizer.json").write_bytes((ROOT / "assets/tiny_llama/tokenizer.json").read_bytes())
    expected = damage(ckpt)
    out = tmp_path / "out"
    (out / "step_3").mkdir(parents=True)
    (out / "step_3" / "model.safetensors").write_bytes(b"the user's earlier checkpoint")
    (out / "metrics.jsonl").write_text("earlier metrics\n")
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    code = main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={ckpt}",
                 f"output_dir={out}", "overwrite=true", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}"])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
    assert code == 1
    assert len(err) == 1 and err[0].startswith("error: "), err
    import re
    assert re.search(expected, err[0]), err[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snapshot


def test_load_model_errors_name_the_problem(tmp_path):
    write_hf_checkpoint(tmp_path / "in", tiny_llama_config())
    with pytest.raises(Exception, match="config.json"):
        load_model(tmp_path / "nowhere")
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()
    del state["model"]["norm.weight"]
    with pytest.raises(Exception, match="state dict lacks 'model.norm.weight' that the input checkpoint has"):
        ckpt.save_checkpoint(state, step=1)
    assert not (tmp_path / "out").exists(), "a refused save writes nothing"


def test_too_few_samples_for_the_global_batch_is_one_line(tmp_path, capsys):
    from recipes.full_finetune import main

    out = tmp_path / "out"
    code = main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
                 f"output_dir={out}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "batch_size=300",
                 "gradient_accumulation_steps=2"])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
    assert code == 1
    assert err == ["error: dataset has 400 samples: too few for batch_size=300 x gradient_accumulation_steps=2 x 1 processes"]
    assert not out.exists()
