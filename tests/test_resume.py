"""Interrupted runs resume exactly: SIGTERM, SIGKILL mid-save, corruption, disk full, config changes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import pytest
import torch

from waypoint.checkpointers.commit import verify
from waypoint.checkpointers.file_formats import read_tensors
from tests.conftest import ROOT, sigterm_at_step
from tests.launch import FileSizeLimit
from tests.recipe_runs import run_recipe

STEPS_PER_EPOCH, EPOCHS = 8, 2
BASE = [f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}",
        f"epochs={EPOCHS}", f"max_steps_per_epoch={STEPS_PER_EPOCH}", "model.attn_dropout=0.1",
        "keep_last_n_checkpoints=null", "save_every_n_steps=4"]
FINAL = f"step_{STEPS_PER_EPOCH * EPOCHS}"


def run(out, *overrides, fault=None, preexec_fn=None, env=None):
    """The full recipe on the tiny checkpoint, in this process unless the fault kills it (``tests/recipe_runs.py``)."""
    if not any(o.startswith("checkpointer.checkpoint_dir=") for o in overrides):
        overrides = (f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}", *overrides)
    return run_recipe("full", ["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={out}", *BASE, *overrides],
                      fault=fault, preexec_fn=preexec_fn, env=env)


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(step_dir):
    merged = {}
    for f in sorted(step_dir.glob("*.safetensors")):
        merged.update(read_tensors(f))
    return merged


def assert_same_run(out, reference):
    assert losses(out) == losses(reference), "per-step losses differ from the uninterrupted run"
    mine, theirs = weights(out / FINAL), weights(reference / FINAL)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not list(out.glob(".step_*")), "a temporary checkpoint directory was left behind"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run(out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(out)) == STEPS_PER_EPOCH * EPOCHS
    return out


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run stopped by SIGTERM after step 12: checkpoints step_4, step_8, step_12."""
    out = tmp_path_factory.mktemp("interrupted")
    result = run(out, fault=["signal-at-step", "12", "SIGTERM"])
    assert result.returncode == 75, result.stderr[-3000:]
    return out


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("stop_at,where,sig", [(5, "epoch 0, sample 40/64", "SIGTERM"), (8, "epoch 1, sample 0/64", "SIGTERM"),
                                              (5, "epoch 0, sample 40/64", "SIGUSR1")], ids=["mid-epoch", "epoch-boundary", "sigusr1"])
def test_signal_then_same_command_is_bit_exact(tmp_path, reference, stop_at, where, sig):
    out = tmp_path / "run"
    stopped = run(out, fault=["signal-at-step", str(stop_at), sig])
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert f"stopped by {sig} at step {stop_at}" in stopped.stdout
    assert verify(out / f"step_{stop_at}").ok
    resumed = run(out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step_{stop_at} ({where}), " in resumed.stdout
    assert_same_run(out, reference)


def test_second_signal_during_the_save_corrupts_nothing(tmp_path, reference):
    out = tmp_path / "run"
    stopped = run(out, fault=["signal-twice", "6", "SIGTERM"])
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert verify(out / "step_6").ok
    assert run(out).returncode == 0
    assert_same_run(out, reference)


@pytest.mark.slow
@pytest.mark.parametrize("moment,resumes_from", [("first-file", 8), ("before-manifest", 8), ("before-rename", 8), ("after-rename", 12)])
def test_sigkill_during_save(tmp_path, reference, moment, resumes_from):
    out = tmp_path / "run"
    killed = run(out, fault=["kill-in-save", "12", moment])
    assert killed.returncode == -signal.SIGKILL
    resumed = run(out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step_{resumes_from} " in resumed.stdout
    assert_same_run(out, reference)


def _truncate(path):
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-7])


def _flip_byte(path):
    shard = sorted(path.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _drop_manifest(path):
    (path / "MANIFEST.json").unlink()


@pytest.mark.parametrize("damage,problem", [(_truncate, r"model-\S+ has \d+ bytes, manifest says"), (_flip_byte, r"model-\S+ does not match its hash"),
                                            (_drop_manifest, "no MANIFEST.json")], ids=["truncated", "flipped", "no-manifest"])
def test_corrupt_newest_checkpoint_falls_back(tmp_path, interrupted, reference, damage, problem):
    out = copy_run(interrupted, tmp_path / "run")
    damage(out / "step_12")
    assert not verify(out / "step_12").ok
    resumed = run(out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(rf"warning: skipping step_12: {problem}", resumed.stdout), resumed.stdout
    assert "resuming from step_8 " in resumed.stdout
    assert (out / "step_12.corrupt").is_dir(), "the damaged checkpoint is kept for inspection"
    assert_same_run(out, reference)


def test_pinned_checkpoint_resumes_there(tmp_path, interrupted, reference):
    out = copy_run(interrupted, tmp_path / "run")
    result = run(out, f"resume={out / 'step_8'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from step_8 " in result.stdout
    assert (out / "step_12.superseded").is_dir()
    assert_same_run(out, reference)


def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path, interrupted):
    out = copy_run(interrupted, tmp_path / "run")
    shutil.rmtree(out / "step_12")
    before = {p: p.read_bytes() for p in (out / "step_8").iterdir()}

    result = run(out, preexec_fn=FileSizeLimit(1_000_000))
    assert result.returncode == 1
    assert result.stderr.count("error:") == 1, result.stderr
    assert re.search(r"error: could not write \S+/step_12: File too large \(OSError\); nothing was committed", result.stderr)
    assert verify(out / "step_8").ok and {p: p.read_bytes() for p in (out / "step_8").iterdir()} == before
    assert not list(out.glob(".step_*")) and not (out / "step_12").exists()


def test_incompatible_config_change_is_refused_with_the_keys(tmp_path, interrupted):
    out = copy_run(interrupted, tmp_path / "run")
    result = run(out, "max_steps_per_epoch=6", "seed=7")
    assert result.returncode == 1
    assert "the config changed max_steps_per_epoch, seed;" in result.stderr
    smaller = run(out, "batch_size=4")
    assert smaller.returncode == 1
    assert ("its global batch is 8 samples per step, this run's is 4 (batch_size 4 x gradient_accumulation_steps 1 x "
            "1 processes); set gradient_accumulation_steps=2 to keep it") in smaller.stderr
    harmless = run(out, "clip_grad_norm=0.5")
    assert harmless.returncode == 0, harmless.stderr[-2000:]
    assert "note: clip_grad_norm: 1.0 -> 0.5 (takes effect from step 13)" in harmless.stdout


def lrs(out):
    return [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_changed_optimizer_settings_take_effect_on_resume(tmp_path, interrupted, reference):
    """Not accepted and ignored (the restored param groups and scheduler would bring the old values back)."""
    out = copy_run(interrupted, tmp_path / "run")
    result = run(out, "optimizer.lr=1.0e-3", "optimizer.weight_decay=0.1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "note: optimizer.lr: 0.003 -> 0.001 (takes effect from step 13)" in result.stdout
    assert "note: optimizer.weight_decay: 0.0 -> 0.1 (takes effect from step 13)" in result.stdout
    mine, theirs = lrs(out), lrs(reference)
    assert mine[:12] == theirs[:12] and len(mine) == len(theirs)
    assert all(abs(a - b / 3) <= 1e-12 for a, b in zip(mine[12:], theirs[12:])), "the schedule follows the new lr"
    final_mine, final_theirs = weights(out / FINAL), weights(reference / FINAL)
    assert any(not torch.equal(final_mine[k], final_theirs[k]) for k in final_mine)


def test_an_option_added_since_with_its_default_is_no_change():
    """A GRPO run from before reward_timeout existed resumes with today's config (reward_timeout: 120, the default)
    without a note that it changed; set to another value, the note names the default the old run had."""
    import yaml

    from recipes.grpo_finetune import REWARD_TIMEOUT_S
    from waypoint.run.resume import ADDED_DEFAULTS, check_config

    shipped = yaml.safe_load((ROOT / "configs/tiny_grpo.yaml").read_text())["reward_timeout"]
    assert ADDED_DEFAULTS["reward_timeout"] == REWARD_TIMEOUT_S == shipped
    saved = {"seed": 1234, "loss": {"beta": 0.0}}
    assert check_config(saved, {**saved, "reward_timeout": shipped}, ROOT / "step_8") == []
    assert check_config(saved, {**saved, "reward_timeout": 30}, ROOT / "step_8") == [("reward_timeout", 120, 30)]


def test_apply_changes_sets_the_resumed_steps_learning_rate():
    from waypoint.training.lr_schedule import warmup_cosine
    from waypoint.run.resume import apply_changes

    def make(lr):
        param = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=0.0)
        return param, optimizer, warmup_cosine(optimizer, num_training_steps=20, num_warmup_steps=4)

    param, optimizer, scheduler = make(3e-3)
    for _ in range(6):
        param.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
    saved = optimizer.state_dict(), scheduler.state_dict()
    _, resumed_optimizer, resumed_scheduler = make(1e-3)
    resumed_optimizer.load_state_dict(saved[0])
    resumed_scheduler.load_state_dict(saved[1])
    assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"], "restored: the old value is back"
    apply_changes(resumed_optimizer, resumed_scheduler, [("optimizer.lr", 3e-3, 1e-3), ("optimizer.weight_decay", 0.0, 0.1)])
    group = resumed_optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(optimizer.param_groups[0]["lr"] / 3) and group["weight_decay"] == 0.1
    assert resumed_scheduler.get_last_lr() == [group["lr"]]


def test_torn_metrics_line_does_not_block_resume(tmp_path, interrupted, reference):
    out = copy_run(interrupted, tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "lo')  # a kill in the middle of a write
    result = run(out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "note: metrics.jsonl: dropped a torn last line (the run was killed while writing it)" in result.stdout
    assert_same_run(out, reference)


def test_same_global_batch_in_smaller_micro_batches_resumes(tmp_path, interrupted, reference):
    """batch_size 8 -> 4 x 2 accumulation steps: the same samples per step, so the same run up to float
    rounding and dropout (these runs use attention dropout 0.1, whose masks follow the batch shape)."""
    out = copy_run(interrupted, tmp_path / "run")
    result = run(out, "batch_size=4", "gradient_accumulation_steps=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "note: batch_size, gradient_accumulation_steps differ" not in result.stdout
    mine, theirs = losses(out), losses(reference)
    assert mine[:12] == theirs[:12] and len(mine) == len(theirs)
    assert max(abs(a - b) for a, b in zip(mine, theirs)) < 1e-2


def tiny_in_format(fmt, tmp_path):
    """The embedded tiny checkpoint in HF, native or 2-file Meta format (tokenizer files beside it)."""
    from waypoint.checkpointers import load_model
    from waypoint.checkpointers import Conversion, write_checkpoint
    from tests.test_formats import hf_to_meta_oracle, write_meta_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    source = ROOT / "assets/tiny_llama"
    tokenizer_files = [source / "tokenizer.json", source / "tokenizer_config.json"]
    if fmt == "hf":
        return source
    if fmt == "native":
        model = load_model(source)
        return write_checkpoint(model.state_dict(), Conversion(model.args), "native", tmp_path / "native", side_files=tokenizer_files)
    config = LlamaConfig.from_pretrained(source)
    meta = hf_to_meta_oracle(LlamaForCausalLM.from_pretrained(source).state_dict(), config)
    write_meta_checkpoint(tmp_path / "meta", meta, config, 2, 1)
    params = json.loads((tmp_path / "meta/params.json").read_text())
    params.pop("multiple_of")
    (tmp_path / "meta/params.json").write_text(json.dumps(params))
    (tmp_path / "meta/tokenizer.model").unlink()
    for f in tokenizer_files:
        shutil.copy(f, tmp_path / "meta" / f.name)
    return tmp_path / "meta"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hf", "meta", "native"])
def test_extra_state_survives_resume(tmp_path, fmt):
    from recipes import full_finetune

    source = tiny_in_format(fmt, tmp_path)
    lazy = ["model._target_=tests.lazy_state_model.build", "save_every_n_steps=null", "epochs=1",
            f"checkpointer={fmt}", f"checkpointer.checkpoint_dir={source}"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"

    def run_in_process(out, stop_at=None):  # in this process (the signal is a real one): no interpreter start-up
        with sigterm_at_step(stop_at):
            return full_finetune.main(["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={out}", *BASE, *lazy])
    assert run_in_process(whole) == 0
    assert run_in_process(parts, stop_at=3) == 75
    saved = torch.load(parts / "step_3" / "extra_state.pt", weights_only=True)
    assert saved["calibration._extra_state"]["draws"] == 1 and saved["calibration._extra_state"]["p"].shape == (128,)
    assert "extra_state.pt" in json.loads((parts / "step_3" / "MANIFEST.json").read_text())["files"]
    assert run_in_process(parts) == 0
    assert losses(parts) == losses(whole), "the lazily drawn tensor was not restored"


def test_checkpoint_without_extra_state_loads(caplog):
    from waypoint.checkpointers import HFCheckpointer, load_into
    from tests.lazy_state_model import build

    state = HFCheckpointer(ROOT / "assets/tiny_llama", output_dir=ROOT / "unused").load_checkpoint()["model"]
    with torch.device("meta"):
        model = build(ROOT / "assets/tiny_llama")
    with caplog.at_level("WARNING"):
        load_into(model, state)
    assert model.calibration.p is None and model.calibration.draws == 0
    assert "calibration._extra_state" in caplog.text


def test_resumed_run_outlives_the_checkpoint_it_resumed_from(tmp_path):
    """Retention deletes the step a run resumed from; later saves must not need it (its side files,
    layout and config come from the input)."""
    out = tmp_path / "run"
    often = ["epochs=1", "max_steps_per_epoch=8", "save_every_n_steps=2", "keep_last_n_checkpoints=2"]
    stopped = run(out, *often, fault=["signal-at-step", "2", "SIGTERM"])
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    resumed = run(out, *often)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step_2" in resumed.stdout
    assert sorted(p.name for p in out.glob("step_*")) == ["step_6", "step_8"] and verify(out / "step_8").ok


def test_retention_keeps_the_newest(tmp_path):
    out = tmp_path / "run"
    result = run(out, "epochs=1", "save_every_n_steps=2", "keep_last_n_checkpoints=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in out.glob("step_*")) == ["step_6", "step_8"]


def test_preemption_requeues_under_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.log'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    result = run(tmp_path / "run", "epochs=1", "requeue=true", fault=["signal-at-step", "2", "SIGTERM"],
                 env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"})
    assert result.returncode == 75, result.stderr[-2000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
