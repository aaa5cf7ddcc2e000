"""The console: in a log (stderr not a terminal) a plain line every progress_every_n_steps and no bar redraws;
``progress: bar | lines | off`` chooses otherwise; metrics.jsonl is the same whatever is shown."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import ROOT
from tests.recipe_runs import run_recipe

TINY = [f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}",
        "epochs=1", "max_steps_per_epoch=7", "save_every_epoch=false", "verify_export=false"]
CONFIG = {"full": "configs/tiny.yaml", "lora": "configs/tiny_lora.yaml"}


def run(recipe, out, *more):
    return run_recipe(recipe, ["--config", str(ROOT / CONFIG[recipe]), f"output_dir={out}", *TINY, *more])


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe", ["full", "lora"])
def test_a_log_gets_a_line_every_n_steps_and_at_the_last_and_no_bar(tmp_path, recipe):
    result = run(recipe, tmp_path / "run", "progress_every_n_steps=3")  # stdout and stderr are files here, not terminals
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("train step ")]
    assert [line.split()[2] for line in lines] == ["3/7", "6/7", "7/7"], result.stdout
    assert re.fullmatch(r"train step 3/7 \(43%\): loss \d+\.\d{4}, lr \d\.\d\de-\d\d, tok_s \d+, "
                        r"\d+:\d\d:\d\d elapsed, \d+:\d\d:\d\d left", lines[0]), lines[0]
    assert "\r" not in result.stdout + result.stderr, "a bar was drawn into the log"


def test_off_shows_nothing_bar_draws_a_bar_and_the_metrics_file_is_the_same(tmp_path):
    lines, off, bar = (run("full", tmp_path / style, f"progress={style}") for style in ("lines", "off", "bar"))
    assert all(r.returncode == 0 for r in (lines, off, bar)), off.stderr[-2000:] + bar.stderr[-2000:]
    assert "train step" not in off.stdout and "\r" not in off.stdout + off.stderr
    assert "train step" not in bar.stdout and "\r" in bar.stderr and "train: 100%" in bar.stderr
    assert "load: " in bar.stderr, "the loading bars follow the setting too"
    assert losses(tmp_path / "lines") == losses(tmp_path / "off") == losses(tmp_path / "bar")


def test_a_grpo_line_shows_what_moves_every_val_reward_a_note_and_a_warning_when_nothing_can_learn(
        tmp_path, monkeypatch):
    """GRPO's loss stays near 0 on-policy: a note says so once, before the first line, and each line shows the reward
    figures instead; a step that measured val_reward (every 2 here) gets its line whatever progress_every_n_steps
    says; a reward that scores every completion alike (no group has a spread, nothing learns) is warned of once,
    after ZERO_SPREAD_STEPS (3 here) such steps in a row."""
    from waypoint.run import grpo_progress

    (tmp_path / "same_rewards_p.py").write_text("def same(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grpo_progress, "ZERO_SPREAD_STEPS", 3)
    result = run_recipe("grpo", ["--config", str(ROOT / "configs/tiny_grpo.yaml"), f"output_dir={tmp_path / 'run'}",
                                 "epochs=1", "max_steps_per_epoch=4", "validation.every_n_steps=2", "progress=lines",
                                 "progress_every_n_steps=3", "verify_export=false", "reward_funcs=[same_rewards_p.same]"])
    assert result.returncode == 0, result.stderr[-2000:]
    shown = [line for line in result.stdout.splitlines()
             if line.startswith(("train step ", "note: GRPO's loss", "warning: steps"))]
    assert [line.split(":")[0] for line in shown] == ["note", "train step 2/4 (50%)", "train step 3/4 (75%)",
                                                      "warning", "train step 4/4 (100%)"], result.stdout
    assert shown[0] == grpo_progress.LOSS_NOTE
    assert re.fullmatch(r"train step 2/4 \(50%\): loss -?\d\.\d{4}, reward 1\.000, reward_std 0\.000, "
                        r"frac_reward_zero_std 1\.00, len \d\.\d, tok_s \d+, val_reward 1\.000, "
                        r"\d+:\d\d:\d\d elapsed, \d+:\d\d:\d\d left", shown[1]), shown[1]
    assert "val_reward" not in shown[2] and "val_reward 1.000" in shown[4]
    assert shown[3].startswith("warning: steps 1-3: every group's completions got the same reward "
                               "(frac_reward_zero_std 1.0), so every advantage is 0 and no gradient flows")


def test_the_zero_spread_warning_needs_that_many_steps_in_a_row_and_comes_once():
    from waypoint.run.grpo_progress import ZeroSpreadWatch

    watch = ZeroSpreadWatch(3)
    said = [watch.update(step, frac) for step, frac in enumerate([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0], 1)]
    assert [i for i, line in enumerate(said, 1) if line] == [6]  # steps 4-6; step 3 had a group with a spread
    assert said[5].startswith("warning: steps 4-6: ")


def test_a_grpo_line_shows_the_kl_when_beta_adds_it():
    from waypoint.run.grpo_progress import progress_values

    record = {"loss": 1e-9, "reward": 0.5, "reward_std": 0.25, "frac_reward_zero_std": 0.125,
              "completions/mean_length": 5.94, "tokens_per_s": 900.4}
    assert progress_values(record) == {"loss": "0.0000", "reward": "0.500", "reward_std": "0.250",
                                       "frac_reward_zero_std": "0.12", "len": "5.9", "tok_s": "900"}
    assert progress_values(record | {"kl": 0.0123, "val_reward": 0.75}) == {
        "loss": "0.0000", "reward": "0.500", "reward_std": "0.250", "frac_reward_zero_std": "0.12", "kl": "0.0123",
        "len": "5.9", "tok_s": "900", "val_reward": "0.750"}
