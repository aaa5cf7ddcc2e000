"""The output's dtype is the input's: a bf16 checkpoint trained in fp32 comes out in bf16 (every tensor, config.json,
the index's total_size), the merged LoRA model too; output_dtype changes it on request; resuming stays exact."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from recipes import full_finetune, lora_finetune
from tests.conftest import ROOT, tiny_llama_config
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.run.metrics import MetricsLog

TINY = ROOT / "assets/tiny_llama"
COMMON = [f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "epochs=1", "max_steps_per_epoch=4", "save_every_n_steps=2",
          "keep_last_n_checkpoints=null", "model.attn_dropout=0.1"]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A bf16 Llama in HF format (3 shards, an index), written by transformers, with the tiny tokenizer."""
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("bf16") / "model"
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab=512, hidden=64, layers=2)).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, path / name)
    return path


def tensors(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(read_tensors(f))
    return out


def config_dtype(directory):
    config = json.loads((directory / "config.json").read_text())
    return config.get("dtype", config.get("torch_dtype"))


def total_size(directory):
    return json.loads((directory / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


def run(recipe, config, source, out, *overrides):
    return recipe.main(["--config", str(ROOT / config), f"checkpointer.checkpoint_dir={source}", f"output_dir={out}",
                        *COMMON, *overrides])


def test_bf16_in_fp32_training_bf16_out(bf16_model, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(full_finetune, "configs/tiny.yaml", bf16_model, out, "dtype=fp32") == 0
    printed = capsys.readouterr().out
    assert "checkpoints are written in bfloat16 like the input (output_dtype changes it)" in printed
    assert f"done: the final model is {out / 'step_4'} (Hugging Face format, bfloat16)" in printed
    for step in ("step_2", "step_4"):
        written = tensors(out / step)
        assert written.keys() == tensors(bf16_model).keys() and {t.dtype for t in written.values()} == {torch.bfloat16}
        assert config_dtype(out / step) == "bfloat16" and total_size(out / step) == total_size(bf16_model)
        assert sorted(p.name for p in (out / step).glob("*.safetensors")) == sorted(p.name for p in bf16_model.glob("*.safetensors"))
    assert not torch.equal(tensors(out / "step_4")["model.norm.weight"], tensors(bf16_model)["model.norm.weight"])
    recipe_state = torch.load(out / "step_4" / "recipe_state.pt", weights_only=True)
    assert recipe_state["model"]["norm.weight"].dtype == torch.float32, "the fp32 weights, for an exact resume"


def test_merged_lora_model_in_the_inputs_dtype(bf16_model, tmp_path):
    out = tmp_path / "lora"
    assert run(lora_finetune, "configs/tiny_lora.yaml", bf16_model, out, "dtype=fp32", "lora.targets=[q_proj,v_proj,w2]") == 0
    merged = out / "step_4" / "merged"
    written = tensors(merged)
    assert {t.dtype for t in written.values()} == {torch.bfloat16} and written.keys() == tensors(bf16_model).keys()
    assert config_dtype(merged) == "bfloat16" and total_size(merged) == total_size(bf16_model)
    changed = written["model.layers.0.self_attn.q_proj.weight"].float() - tensors(bf16_model)["model.layers.0.self_attn.q_proj.weight"].float()
    assert changed.abs().max() > 0, "the update survives the cast to bf16"
    adapter = read_tensors(out / "step_4" / "adapter_model.safetensors")
    assert {t.dtype for t in adapter.values()} == {torch.float32}, "adapters stay fp32, as PEFT keeps them"


def test_fp32_in_bf16_training_fp32_out_and_output_dtype_on_request(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(full_finetune, "configs/tiny.yaml", TINY, out, "dtype=bf16", "max_steps_per_epoch=2") == 0
    assert {t.dtype for t in tensors(out / "step_2").values()} == {torch.float32} and config_dtype(out / "step_2") == "float32"
    assert total_size(out / "step_2") == total_size(TINY)
    assert "model" not in torch.load(out / "step_2" / "recipe_state.pt", weights_only=True), "bf16 -> fp32 loses nothing"
    capsys.readouterr()
    asked = tmp_path / "asked"
    assert run(full_finetune, "configs/tiny.yaml", TINY, asked, "output_dtype=bf16", "max_steps_per_epoch=2") == 0
    assert "checkpoints are written in bfloat16 (output_dtype)" in capsys.readouterr().out
    assert {t.dtype for t in tensors(asked / "step_2").values()} == {torch.bfloat16} and config_dtype(asked / "step_2") == "bfloat16"
    assert total_size(asked / "step_2") == total_size(TINY) // 2


def test_resume_from_a_narrower_checkpoint_is_exact(bf16_model, tmp_path, monkeypatch):
    """Stopped at step 2 (bf16 files of fp32 weights), resumed: the same losses and files as a run that never stopped."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run(full_finetune, "configs/tiny.yaml", bf16_model, whole, "dtype=fp32") == 0
    write = MetricsLog.write

    def stop_at_step_2(self, **record):
        write(self, **record)
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
    monkeypatch.setattr(MetricsLog, "write", stop_at_step_2)
    assert run(full_finetune, "configs/tiny.yaml", bf16_model, parts, "dtype=fp32") == 75
    monkeypatch.setattr(MetricsLog, "write", write)
    assert run(full_finetune, "configs/tiny.yaml", bf16_model, parts, "dtype=fp32") == 0
    assert (parts / "metrics.jsonl").read_text().count("\n") == 4
    losses = [[json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, parts)]
    assert losses[0] == losses[1]
    for f in whole.glob("step_4/*.safetensors"):
        assert f.read_bytes() == (parts / "step_4" / f.name).read_bytes()
