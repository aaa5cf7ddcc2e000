"""A nan or inf never reaches a checkpoint: the run stops at that step (or skips its update), naming what went
non-finite, and the newest committed checkpoint stays the last good one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

import recipes.full_finetune as full
from tests.conftest import ROOT
from waypoint.checkpointers.commit import verify
from waypoint.run.step_dirs import step_dirs
from waypoint.checkpointers.file_formats import read_tensors

TINY = ROOT / "assets/tiny_llama"
ARGS = ["--config", str(ROOT / "configs/tiny.yaml"), f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}",
        "epochs=1", "max_steps_per_epoch=6", "save_every_n_steps=2"]


def nan_gradient_at(monkeypatch, step: int, parameter: str = "layers.1.mlp.w2.weight"):
    """Make optimizer step ``step``'s gradient of ``parameter`` nan, as an overflow would."""
    real = full.forward_backward
    calls = {"n": 0}

    def patched(model, micro_batches, device, dist, *rest):
        result = real(model, micro_batches, device, dist, *rest)
        calls["n"] += 1
        if calls["n"] == step:
            dict(model.named_parameters())[parameter].grad.fill_(float("nan"))
        return result
    monkeypatch.setattr(full, "forward_backward", patched)


def error_lines(capsys):
    return [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]


def test_nonfinite_gradient_stops_before_the_update_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    nan_gradient_at(monkeypatch, 3)
    out = tmp_path / "run"
    assert full.main([*ARGS, f"checkpointer.checkpoint_dir={TINY}", f"output_dir={out}"]) == 1
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: step 3: loss ") and "grad norm nan" in lines[0], lines[0]
    assert "the gradient of layers.1.mlp.w2.weight is the first that is not finite" in lines[0]
    assert [p.name for p in step_dirs(out)] == ["step_2"] and verify(out / "step_2").ok
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    weights = read_tensors(out / "step_2" / "model-00001-of-00003.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_skip_step_skips_the_update_and_goes_on(tmp_path, monkeypatch, capsys):
    nan_gradient_at(monkeypatch, 3)
    out = tmp_path / "run"
    assert full.main([*ARGS, f"checkpointer.checkpoint_dir={TINY}", f"output_dir={out}", "on_nonfinite=skip_step"]) == 0
    printed = capsys.readouterr().out
    assert "warning: step 3: loss" in printed and "update skipped (on_nonfinite=skip_step)" in printed
    assert [p.name for p in step_dirs(out)] == ["step_6", "step_4"]
    for f in (out / "step_6").glob("*.safetensors"):
        assert all(torch.isfinite(t).all() for t in read_tensors(f).values())


def test_garbage_tensor_bytes_in_the_input_stop_the_run_at_step_one(tmp_path, capsys):
    source = tmp_path / "garbage"
    shutil.copytree(TINY, source)
    shard = source / "model-00002-of-00003.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        key = sorted(f.keys())[0]
    header = int.from_bytes(shard.read_bytes()[:8], "little")
    data = bytearray(shard.read_bytes())
    data[8 + header:] = b"\xff" * (len(data) - 8 - header)  # every value nan; the header still reads
    shard.write_bytes(bytes(data))
    assert read_tensors(shard)[key].isnan().all(), "the header is intact, the bytes are not"
    out = tmp_path / "run"
    assert full.main([*ARGS, f"checkpointer.checkpoint_dir={source}", f"output_dir={out}"]) == 1
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: step 1: loss nan"), lines
    assert "are not finite as loaded from the checkpoint" in lines[0]
    assert not step_dirs(out)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_nonfinite_weights_are_never_saved(tmp_path, monkeypatch, capsys, value):
    """Weights that an update made non-finite, with a finite loss and gradient, are not checkpointed."""
    real, calls = torch.optim.AdamW.step, {"n": 0}

    def overflowing_step(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][-1][0] = float(value)
        return result
    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
    out = tmp_path / "run"
    assert full.main([*ARGS, f"checkpointer.checkpoint_dir={TINY}", f"output_dir={out}"]) == 1
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: step 2: not saving a checkpoint, the weights of "), lines
    assert not step_dirs(out)
