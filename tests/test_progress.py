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
