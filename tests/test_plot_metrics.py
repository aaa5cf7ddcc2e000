"""scripts/plot_metrics.py: reading metrics.jsonl (resumes, validation records, malformed lines), the debiased EMA,
the PNG, a comparison of runs, and the one-line errors."""

from __future__ import annotations

import json
import math
import struct
import sys

import pytest

pytest.importorskip("matplotlib")

from scripts import plot_metrics  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def record(step, loss, **extra):
    return {"step": step, "epoch": 0, "loss": loss, "lr": 1e-3 * step, "grad_norm": 1.0 + step,
            "tokens_per_s": 700.0 + step} | extra


def write_log(directory, lines):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "metrics.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def resumed_log(tmp_path, name="run"):
    """Steps 1-6, a malformed line, then a resumed run that repeats from step 5 (a log not cut back), with
    validation records at steps 4 and 8 and a torn last line."""
    lines = [record(s, 10.0 - s) for s in range(1, 7)]
    lines.insert(4, {"step": 4, "val_loss": 7.5})
    lines.append("{this is not json")
    lines += [record(s, 20.0 - s) for s in range(5, 9)]
    lines.append({"step": 8, "val_loss": 12.5})
    path = write_log(tmp_path / name, lines)
    with open(path, "a") as f:
        f.write('{"step": 9, "lo')  # a run still writing its last line
    return path


def test_ema_is_tensorboards_debiased_average():
    values = [4.0, 2.0, float("nan"), 1.0]
    w = 0.5
    # by hand: last = 0.5*0 + 0.5*4 = 2, debias 1 - 0.5 = 0.5 -> 4; last = 0.5*2 + 0.5*2 = 2, debias 0.75 -> 8/3;
    # nan skipped; last = 0.5*2 + 0.5*1 = 1.5, debias 1 - 0.125 = 0.875 -> 12/7
    got = plot_metrics.ema(values, w)
    assert got[0] == pytest.approx(4.0) and got[1] == pytest.approx(8 / 3) and math.isnan(got[2])
    assert got[3] == pytest.approx(12 / 7)
    assert plot_metrics.ema([3.0, 5.0], 0.0) == [3.0, 5.0]


def test_read_runs_finds_the_resume_validation_and_skipped_lines(tmp_path):
    path = resumed_log(tmp_path)
    notes = []
    (run,) = plot_metrics.read_runs([tmp_path / "run"], smooth=0.9, report=notes.append)
    assert run.name == "run" and run.path == path
    assert run.steps == list(range(1, 9))
    # steps 5 and 6 come from the resumed run, which wrote them last
    assert run.series["loss"] == [9.0, 8.0, 7.0, 6.0, 15.0, 14.0, 13.0, 12.0]
    assert run.series["tokens_per_s"] == [700.0 + s for s in range(1, 9)]
    assert all(math.isnan(v) for v in run.series["aux_loss"]) and not run.has("aux_loss")
    assert run.resumes == [5]
    assert (run.val_steps, run.val_loss) == ([4, 8], [7.5, 12.5])
    assert run.skipped == 1  # the bad line; the torn last one is not counted
    assert notes == [f"note: {path}: skipped 1 line that is not a step record"]
    expected, last = [], 0.0
    for n, v in enumerate(run.series["loss"], 1):
        last = 0.9 * last + 0.1 * v
        expected.append(last / (1 - 0.9 ** n))
    assert run.smoothed == pytest.approx(expected)
    assert run.smoothed[0] == pytest.approx(9.0)  # debiased: starts at the first value, not at a tenth of it


def test_gaps_late_starts_and_markers_are_resumes_but_a_continuous_log_is_not(tmp_path):
    continuous = write_log(tmp_path / "a", [record(s, 1.0) for s in range(1, 5)])
    assert plot_metrics.read_run(continuous).resumes == []
    gap = write_log(tmp_path / "b", [record(s, 1.0) for s in (1, 2, 3, 7, 8)])
    assert plot_metrics.read_run(gap).resumes == [7]
    late = write_log(tmp_path / "c", [record(s, 1.0) for s in (51, 52)] + [record(53, 1.0, resumed=True)])
    assert plot_metrics.read_run(late).resumes == [51, 53]
    moe = write_log(tmp_path / "d", [record(s, 1.0, aux_loss=0.01 * s) for s in (1, 2)])
    assert plot_metrics.read_run(moe).series["aux_loss"] == [0.01, 0.02]


def test_broken_lines_do_not_bridge_missing_steps():
    xs, ys = plot_metrics.broken([1, 2, 5], [1.0, 2.0, 3.0])
    assert xs == [1, 2, 4.5, 5] and ys[:2] == [1.0, 2.0] and math.isnan(ys[2]) and ys[3] == 3.0


def test_one_run_writes_a_png_next_to_the_log(tmp_path, capsys):
    resumed_log(tmp_path)
    assert plot_metrics.main([str(tmp_path / "run"), "--smooth", "0.6"]) == 0
    out = tmp_path / "run" / "metrics.png"
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert "skipped 1 line" in captured.err
    width, height = png_size(out)
    assert 800 <= width <= 3000 and 600 <= height <= 3000
    assert out.stat().st_size > 20_000


def drawn_figure(monkeypatch, argv):
    """The figure ``main(argv)`` draws, kept open for the test."""
    plt = plot_metrics.load_pyplot()
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    assert plot_metrics.main(argv) == 0
    return kept[0]


@pytest.mark.parametrize("smooth", ["0.6", "0"])
def test_one_runs_legend_swatches_have_the_colour_of_its_lines(tmp_path, monkeypatch, capsys, smooth):
    from matplotlib.colors import to_rgb

    resumed_log(tmp_path)
    write_log(tmp_path / "run", [record(s, 5.0 / s, **({"val_loss": 4.0 / s} if s % 3 == 0 else {})) for s in range(1, 9)])
    loss_ax = drawn_figure(monkeypatch, [str(tmp_path / "run"), "--smooth", smooth]).axes[0]
    drawn = {to_rgb(line.get_color()) for line in loss_ax.get_lines() if line.get_xdata() is not None and len(line.get_xdata())}
    swatches = [to_rgb(h.get_color()) for h in loss_ax.get_legend().legend_handles]
    assert len(drawn) == 1 and len(swatches) >= 2 and set(swatches) == drawn, (drawn, swatches)


def test_two_runs_are_compared_in_one_png(tmp_path, capsys):
    resumed_log(tmp_path, "first")
    write_log(tmp_path / "second", [record(s, 5.0 / s, aux_loss=0.01) for s in range(1, 12)])
    runs = plot_metrics.read_runs([tmp_path / "first", tmp_path / "second" / "metrics.jsonl"])
    assert [r.name for r in runs] == ["first", "second"] and [r.steps[-1] for r in runs] == [8, 11]
    out = tmp_path / "compare.png"
    assert plot_metrics.main([str(tmp_path / "first"), str(tmp_path / "second"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert png_size(out)[0] >= 800
    # runs in directories of the same name are told apart by their parents
    write_log(tmp_path / "x" / "run", [record(1, 1.0)])
    write_log(tmp_path / "y" / "run", [record(1, 1.0)])
    assert [r.name for r in plot_metrics.read_runs([tmp_path / "x" / "run", tmp_path / "y" / "run"])] == ["x/run", "y/run"]


def test_several_runs_need_out(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plot_metrics.main([str(tmp_path / "a"), str(tmp_path / "b")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: several runs: name the PNG with --out") and err.count("\n") == 1


@pytest.mark.parametrize("case", ["missing", "empty", "garbage"])
def test_an_unusable_log_is_one_line_naming_the_file(tmp_path, capsys, case):
    path = tmp_path / "run" / "metrics.jsonl"
    if case != "missing":
        path.parent.mkdir()
        path.write_text("" if case == "empty" else "nope\n[1, 2]\n")
    assert plot_metrics.main([str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: ") and "\n" not in err
    assert {"missing": "no such file", "empty": "empty", "garbage": "no step records (2 unreadable lines)"}[case] in err
    assert not (tmp_path / "run" / "metrics.png").exists()


def test_without_matplotlib_the_error_says_what_to_install(tmp_path, capsys, monkeypatch):
    resumed_log(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert plot_metrics.main([str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: matplotlib is not installed: pip install 'waypoint[plot]'"
    assert not (tmp_path / "run" / "metrics.png").exists()


def test_bad_smoothing_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        plot_metrics.main([str(tmp_path), "--smooth", "1"])
    assert "--smooth" in capsys.readouterr().err


def grpo_record(step, reward, length):
    return {"step": step, "epoch": 0, "loss": (-1) ** step * 1e-9, "lr": 1e-2, "grad_norm": 0.5 + 0.1 * step,
            "tokens_per_s": 900.0 + step, "reward": reward, "reward_std": 0.3 - 0.02 * step,
            "frac_reward_zero_std": 0.125 * step, "completions/mean_length": length, "entropy": 6.0}


def test_an_online_rl_run_shows_its_reward_first_and_what_learning_moves(tmp_path, monkeypatch, capsys):
    """A GRPO log (records with reward; val_reward records of their own): the large panel is the reward, smoothed, with
    val_reward as markers; below it reward_std, frac_reward_zero_std and the completion length before the loss, which
    stays near 0 by construction. A flat series gets an axis that shows it flat: the length's 5.94-6.00 is not drawn
    across the whole panel, the loss's 1e-9 either, and a share is drawn on 0-1."""
    from waypoint.run.metric_panels import RL_PANELS

    lengths = [5.94, 5.97, 6.0, 6.0, 6.0, 6.0]
    lines = [grpo_record(s, 0.1 * s, length) for s, length in enumerate(lengths, 1)]
    lines.insert(4, {"step": 4, "val_reward": 0.45, "val_completions/mean_length": 6.0})
    lines.append({"step": 6, "val_reward": 0.7, "val_completions/mean_length": 6.0})
    write_log(tmp_path / "run", lines)
    figure = drawn_figure(monkeypatch, [str(tmp_path / "run")])
    assert "skipped" not in capsys.readouterr().err  # the val_reward records are step records
    head, *below = figure.axes
    assert head.get_title().startswith("mean reward") and head.get_ylabel() == "reward"
    assert all(head.get_position().height > ax.get_position().height for ax in below)
    drawn = [(list(line.get_xdata()), list(line.get_ydata())) for line in head.get_lines()]
    assert ([1, 2, 3, 4, 5, 6], pytest.approx([0.1 * s for s in range(1, 7)])) in drawn
    assert ([4, 6], [0.45, 0.7]) in drawn
    panels = {p.key: ax for ax in below for p in RL_PANELS if ax.get_title() == p.title}
    assert list(panels) == ["reward_std", "frac_reward_zero_std", "completions/mean_length", "loss", "lr",
                            "tokens_per_s", "grad_norm"]
    for key, ax in panels.items():
        (line,) = ax.get_lines()
        assert list(line.get_ydata()) == pytest.approx([r[key] for r in lines if "loss" in r]), key
    length_low, length_high = panels["completions/mean_length"].get_ylim()
    assert length_high - length_low >= 0.2 * 6.0 and length_low <= 5.94 and length_high >= 6.0
    loss_low, loss_high = panels["loss"].get_ylim()
    assert loss_high - loss_low >= 0.2 and loss_low < 0 < loss_high
    share_low, share_high = panels["frac_reward_zero_std"].get_ylim()
    assert share_low <= 0 and share_high >= 1 and share_high - share_low < 1.1


def test_a_flat_series_gets_an_axis_a_fifth_of_its_size_and_a_share_zero_to_one():
    from waypoint.run.metric_panels import Panel, y_limits

    plain, share, floor = Panel("x", "x", "x"), Panel("s", "s", "s", share=True), Panel("l", "l", "l", min_span=0.2)
    assert y_limits([5.94, 6.0, float("nan")], plain) == pytest.approx((5.37, 6.57))
    assert y_limits([0.05, 0.06], plain) == pytest.approx((0.049, 0.061))
    assert y_limits([1.0, 4.0], plain) is None  # not flat: matplotlib's own axis
    assert y_limits([0.0, 0.0], plain) is None and y_limits([float("nan")], plain) is None
    assert y_limits([-1e-9, 1e-9], floor) == pytest.approx((-0.1, 0.1))
    assert y_limits([0.01, 0.02], floor) == (0.0, 0.2)  # widened, but not below 0 for values that are not
    assert y_limits([0.25, 0.25], share) == pytest.approx((-0.03, 1.03))
