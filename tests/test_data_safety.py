"""Nothing the user owns is lost or overwritten: the input model, earlier checkpoints, the logs.

Outputs that overlap inputs are refused before anything is touched; overwrite=true sets the earlier run
aside until the new one has committed a checkpoint; one run at a time holds an output_dir; metrics.jsonl
is only appended to."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from recipes.full_finetune import main as full_finetune
from scripts import convert
from tests.recipe_runs import run_recipe
from tests.conftest import ROOT
from waypoint.run.step_dirs import settle_overwritten
from waypoint.run.metrics import MetricsLog
from waypoint.run.lock import LOCK_FILE, RunLock

TINY = ROOT / "assets/tiny_llama"
DATA = ROOT / "assets/tiny_alpaca.jsonl"
SHORT = [f"dataset.source={DATA}", "epochs=1", "max_steps_per_epoch=4", "save_every_n_steps=2"]


def snapshot(directory):
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def error_lines(capsys):
    return [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]


def train(out, *overrides, source=TINY):
    return full_finetune(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={source}",
                          f"output_dir={out}", *SHORT, *overrides])


# -- 1. scripts/convert.py never writes over, into or around its input ---------------------------------------------
def test_convert_refuses_outputs_that_overlap_the_input(tmp_path, capsys):
    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    (tmp_path / "link").symlink_to(model)
    before = snapshot(model)
    cases = [(model, "is the input"), (tmp_path / "link", "is the input"), (model / "sub", "lies inside the input"),
             (tmp_path, "contains the input")]
    for out, how in cases:
        for to in ("native", "hf"):
            assert convert.main([str(model), str(out), "--to", to, "--overwrite"]) == 1
            lines = error_lines(capsys)
            assert len(lines) == 1 and lines[0].startswith("error: the output ") and how in lines[0], lines
    assert snapshot(model) == before and not (model / "sub").exists()


def test_convert_overwrite_replaces_only_once_the_new_output_is_complete(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    broken = tmp_path / "broken"
    shutil.copytree(TINY, broken)
    (broken / "model-00002-of-00003.safetensors").write_bytes(b"truncated")
    assert convert.main([str(broken), str(out), "--to", "native", "--overwrite"]) == 1
    assert (out / "keep.txt").read_text() == "mine", "a failed conversion leaves the old output as it was"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "out"], "nothing staged is left behind"
    assert convert.main([str(TINY), str(out), "--to", "native", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "waypoint_model.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "out"]


# -- 2. overwrite never deletes what the run reads, nor earlier checkpoints before the new run has one -------------
def test_overwrite_refuses_to_delete_the_checkpoint_it_trains_from(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert train(run, "resume=false", "overwrite=true", source=run / "step_4") == 1
    lines = error_lines(capsys)
    assert len(lines) == 1 and "checkpointer.checkpoint_dir" in lines[0] and "lies inside" in lines[0], lines
    assert snapshot(run) == before


def test_a_run_that_fails_before_its_first_checkpoint_puts_the_overwritten_one_back(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run) == 0
    before = snapshot(run)
    # lr 1e30: step 1 is finite, its update is not, so step 2 stops the run before any checkpoint of its own
    assert train(run, "resume=false", "overwrite=true", "optimizer.lr=1e30", "lr_scheduler.num_warmup_steps=0") == 1
    assert "step 2: loss" in error_lines(capsys)[-1]
    assert snapshot(run) == before, "the earlier checkpoints and metrics are back, byte for byte"
    assert not list(run.glob(".overwritten-*"))


def test_overwrite_takes_effect_when_the_new_run_commits(tmp_path):
    run = tmp_path / "run"
    assert train(run, "seed=1") == 0
    assert train(run, "resume=false", "overwrite=true", "max_steps_per_epoch=2") == 0
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "step_2"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_kill_while_setting_aside_puts_everything_back(tmp_path):
    """Killed after moving step_4 but not yet step_2: step_2 is the earlier run's, not a new checkpoint."""
    run = tmp_path / "run"
    assert train(run) == 0
    before = snapshot(run)
    aside = run / ".overwritten-99999"
    aside.mkdir()
    (run / "step_4").rename(aside / "step_4")
    settle_overwritten(run)
    assert snapshot(run) == before and not aside.exists()


@pytest.mark.slow
def test_killed_overwrite_run_gives_the_earlier_checkpoints_back_to_the_rerun(tmp_path):
    run = tmp_path / "run"
    assert train(run) == 0
    before = snapshot(run)
    cmd = ["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={TINY}", f"output_dir={run}", *SHORT]
    killed = run_recipe("full", [*cmd, "resume=false", "overwrite=true"], fault=["kill-group-at-step", "1", "-"])
    assert killed.returncode == -signal.SIGKILL
    assert list(run.glob(".overwritten-*")) and not list(run.glob("step_*")), "set aside while the new run had no checkpoint"
    resumed = run_recipe("full", cmd)  # in this process
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "run already finished" in resumed.stdout
    assert snapshot(run) == before


# -- 3. one run per output_dir ---------------------------------------------------------------------------------------
def test_a_second_run_on_a_held_output_dir_refuses_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with RunLock(out):
        before = snapshot(out)
        assert train(out) == 1
        lines = error_lines(capsys)
        assert len(lines) == 1 and f"output_dir {out} is in use by another run (host " in lines[0], lines
        assert f"pid {os.getpid()}, since 20" in lines[0]
        assert snapshot(out) == before
    assert not (out / LOCK_FILE).exists(), "released: the file goes with the lock"


def test_a_lock_left_by_a_killed_process_never_blocks(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom waypoint.run.lock import RunLock\n"
                               f"RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(Exception, match="in use by another run"):
        RunLock(out).acquire()
    holder.kill()
    holder.wait()
    assert (out / LOCK_FILE).exists(), "the killed holder could not remove its file"
    with RunLock(out):
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_refused_run_leaves_no_output_dir_behind(tmp_path, capsys):
    out = tmp_path / "new"
    assert train(out, source=tmp_path / "nowhere") == 1
    assert not out.exists()


# -- 4. metrics.jsonl is appended to, never rewritten ----------------------------------------------------------------
def test_metrics_torn_line_dropped_and_later_steps_cut_in_place(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)]
    path.write_text("".join(lines) + '{"step": 6, "lo')
    inode = path.stat().st_ino
    notes = []
    MetricsLog(tmp_path, keep_through_step=10, report=notes.append).close()
    assert path.read_text() == "".join(lines) and path.stat().st_ino == inode
    assert notes == ["note: metrics.jsonl: dropped a torn last line (the run was killed while writing it)"]
    MetricsLog(tmp_path, keep_through_step=3, report=notes.append).close()
    assert path.read_text() == "".join(lines[:3]) and path.stat().st_ino == inode and len(notes) == 1
    path.write_text("".join(lines[:2]) + "not json\n" + lines[2])
    MetricsLog(tmp_path, keep_through_step=10, report=notes.append).close()
    assert path.read_text() == "".join(lines[:2]) + "not json\n" + lines[2], "an odd line that is not the last stays"


def without_dac_override() -> None:
    """In the child, before exec: root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH obeys file modes."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_read_only_output_dir_is_one_line(tmp_path):
    out = tmp_path / "readonly"
    out.mkdir()
    out.chmod(0o555)
    result = subprocess.run([sys.executable, str(ROOT / "recipes/full_finetune.py"), "--config", str(ROOT / "configs/tiny.yaml"),
                             f"checkpointer.checkpoint_dir={TINY}", f"output_dir={out}", *SHORT], capture_output=True, text=True,
                            timeout=300, preexec_fn=without_dac_override if os.geteuid() == 0 else None)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith(f"error: output_dir {out}: cannot create {LOCK_FILE} there (Permission denied)")
