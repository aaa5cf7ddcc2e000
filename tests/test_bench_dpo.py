"""benchmarks/bench_dpo.py: --workdir is made when it does not exist (a path that cannot be a directory is one line),
and tokens/s is reported both ways, labelled, beside the median step time it goes with."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from benchmarks import bench_dpo
from tests.conftest import ROOT


def test_a_workdir_that_does_not_exist_is_made_and_an_existing_one_is_used_as_it_is(tmp_path, capsys):
    missing = tmp_path / "a" / "b"
    assert bench_dpo.prepare_workdir(str(missing)) == (missing, tmp_path / "a") and missing.is_dir()
    assert capsys.readouterr().out.strip() == f"created --workdir {missing} (it did not exist)"
    (missing / "mine.txt").write_text("the user's")
    assert bench_dpo.prepare_workdir(str(missing)) == (missing, None)  # used, not emptied, nothing said
    assert capsys.readouterr().out == "" and (missing / "mine.txt").read_text() == "the user's"
    assert bench_dpo.prepare_workdir(None) == (None, None)


def test_a_workdir_that_cannot_be_a_directory_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for workdir, why in ((afile, "exists and is not a directory"), (afile / "under", "cannot create it")):
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_dpo.py"), "--quick", "--workdir", str(workdir)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and run.stderr.strip().startswith(f"error: --workdir {workdir}: {why}"), run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


def test_tokens_per_s_is_given_for_the_median_step_and_over_all_steps():
    """A slow step moves the sum, not the median: the two tokens/s differ, each labelled; the goal names its own."""
    figures = bench_dpo.throughput([1.0, 1.0, 4.0], [100, 100, 100])
    assert figures == {"median_s": 1.0, "median_tokens_per_s": 100.0, "tokens_per_s": 50.0}


def test_the_report_labels_both_and_says_which_the_goal_uses(capsys):
    def row(median_s, med, total):
        return {"median_s": median_s, "median_tokens_per_s": med, "tokens_per_s": total, "peak_mb": 100.0,
                "before_mb": 10.0, "absolute_mb": 110.0, "losses": [0.69, 0.6], "ref_pass_s": 1.0}
    runs = {"ours": [row(1.0, 200.0, 180.0)], "trl": [row(2.0, 100.0, 40.0)]}
    bench_dpo.report(runs, SimpleNamespace(device="cpu", pairs_per_step=2, warmup=1, steps=2))
    out = capsys.readouterr().out
    header, ours = out.splitlines()[0], out.splitlines()[1]
    assert "tok/s med" in header and "tok/s all" in header and "tok/s med (rounds)" in header
    assert ours.split()[3:6] == ["1.000", "200", "180"] and "2.00x" in ours and "4.50x" in ours
    assert "tok/s all: all timed steps' tokens over their summed time (the goal's)" in out
    assert "goal, waypoint vs TRL both precomputed: >= 1.5x TRL's tokens/s over all timed steps: 4.50x PASS" in out


def test_a_workdir_it_made_is_removed_again_and_one_it_did_not_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_dpo, "run_rounds", lambda impls, args, workdir: None)
    bench_dpo.main(["--quick", "--impls", "ours", "--workdir", str(tmp_path / "a" / "b")])
    assert list(tmp_path.iterdir()) == []  # a/b made, then a/b and a removed: nothing of its own left behind
    bench_dpo.main(["--quick", "--impls", "ours", "--workdir", str(tmp_path)])
    assert tmp_path.is_dir()
