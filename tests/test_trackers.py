"""Experiment trackers (metric_loggers): W&B offline and MLflow on a local SQLite store, the real libraries read
back through their own files and client. One tracker run per training run across kill-and-resume, each step in
its history once, with the values of metrics.jsonl; the config as parameters; the final model's path at the end;
bad tracker options as one line before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes import full_finetune, lora_finetune
from tests.conftest import ROOT, sigterm_at_step
from waypoint.run.wandb_files import history, parsed, run_files

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

STEPS = ["epochs=1", "max_steps_per_epoch=8", "save_every_n_steps=2", "keep_last_n_checkpoints=null"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline and quiet, its files in tmp_path/wb; MLflow at its default, the run's output_dir/mlflow.db."""
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
    (tmp_path / "wb").mkdir()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path / "wb" / "wandb"


def own_service():
    """This process's environment but its W&B service (a child would share it, as a process of the same job does)."""
    return {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}


def args(config, out, *overrides):
    return ["--config", str(ROOT / config), f"output_dir={out}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}",
            f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}", *overrides]


def metrics(out):
    """step -> {key: value} from metrics.jsonl (a val_loss record merged into its step's)."""
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.setdefault(record["step"], {}).update(record)
    return rows


def tracker_runs(step_dir):
    return torch.load(step_dir / "recipe_state.pt", weights_only=True)["trackers"]


def mlflow_run(out):
    """(client, the one run of experiment `waypoint` in output_dir/mlflow.db)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve() / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("waypoint").experiment_id])
    assert len(runs) == 1, "one MLflow run for the whole training run"
    return client, runs[0]


def mlflow_history(client, run, key):
    history = client.get_metric_history(run.info.run_id, key)
    return sorted((m.step, m.value) for m in history)


def wandb_history(wandb_dir, run_id):
    """Every history row of W&B run ``run_id`` across its offline files: (step, row)."""
    return sorted(row for path in run_files(wandb_dir, run_id) for row in history(path))


def wandb_records(wandb_dir, run_id, kind):
    return [getattr(r, kind) for path in run_files(wandb_dir, run_id) for r in parsed(path) if r.WhichOneof("record_type") == kind]


@pytest.mark.parametrize("overrides,hidden,expected", [
    (["+metric_logger=wandb", "+metric_loggers.wandb.projekt=demo"], None,
     "error: metric_loggers.wandb.projekt: no such option of WandbLogger (did you mean project?"),
    (["+metric_logger=wandb", "metric_loggers.wandb.mode=ofline"], None,
     "error: metric_loggers.wandb.mode=ofline: expected null or one of online, offline, disabled"),
    (["+metric_logger=mlflow", "metric_loggers.mlflow.experiment=42"], None,
     "error: metric_loggers.mlflow.experiment=42: expected null or a non-empty string"),
    (["+metric_loggers.x={_target_:waypoint.run.tracker_wandb.Nope}"], None,
     "error: metric_loggers.x._target_=waypoint.run.tracker_wandb.Nope: no such class"),
    (["+metric_logger=[wandb,mlflow]"], "wandb", "error: metric_loggers.wandb: needs the wandb package (pip install 'waypoint[wandb]')"),
    (["+metric_logger=mlflow"], "mlflow", "error: metric_loggers.mlflow: needs the mlflow package (pip install 'waypoint[mlflow]')"),
], ids=["typo", "mode", "experiment", "target", "no-wandb", "no-mlflow"])
def test_bad_tracker_config_is_one_line_and_touches_nothing(overrides, hidden, expected, tmp_path, capsys, monkeypatch):
    if hidden:
        monkeypatch.setitem(sys.modules, hidden, None)  # as if it were not installed
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        full_finetune.main(args("configs/tiny.yaml", out, *overrides))
    err = capsys.readouterr().err
    assert stop.value.code == 1 and len(err.strip().splitlines()) == 1 and err.startswith(expected), err
    assert not out.exists()


class Memory:
    """A tracker of one's own (any ``_target_`` with the tracker methods), its run's rows in a JSON file."""

    def __init__(self, path: str) -> None:
        self.path, self.run_id = Path(path), None

    def rows(self):
        return json.loads(self.path.read_text()) if self.path.exists() else []

    def start(self, name, config, run_id, output_dir, report):
        self.run_id = run_id or "new"
        return self.run_id

    def logged_through(self):
        return max((step for step, _ in self.rows()), default=0)

    def log(self, rows):
        self.path.write_text(json.dumps(self.rows() + [list(row) for row in rows]))

    def finish(self, final_model):
        self.path.write_text(json.dumps(self.rows() + [[None, final_model]]))


@pytest.mark.parametrize("held", [0, 2, 4, 6])
def test_a_resumed_tracker_gets_each_step_once_whatever_its_run_held(tmp_path, held):
    """Resumed from step 4 (metrics.jsonl holds 1..4, and a line of step 5 the checkpoint does not cover), a run
    that holds steps 1..``held``: the steps it lacks up to 4 come from metrics.jsonl, those it has are not sent again."""
    from waypoint.run.metrics import MetricsLog
    from waypoint.run.trackers import open_trackers

    lines = [{"step": s, "loss": float(s), "resumed": False} for s in range(1, 6)] + [{"step": 2, "val_loss": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(lines, key=lambda r: r["step"])))
    store = tmp_path / "memory.json"
    store.write_text(json.dumps([[s, {"loss": float(s)}] for s in range(1, held + 1)]))
    target = "tests.test_trackers.Memory"
    trackers = open_trackers({"mem": {"_target_": target, "path": str(store)}}, {"seed": 1},
                             {"mem": {"target": target, "run_id": "kept"}}, tmp_path, 4, report=lambda line: None)
    log = MetricsLog(tmp_path, keep_through_step=4, trackers=trackers)
    for step in (5, 6):
        log.write(step=step, epoch=0, loss=float(step), resumed=step == 5)
        log.write(step=step, val_loss=0.25)
    log.close(final_model="/m")
    *rows, final = json.loads(store.read_text())
    assert final == [None, "/m"] and trackers.runs == {"mem": {"target": target, "run_id": "kept"}}
    steps = [step for step, _ in rows]
    assert sorted(set(steps)) == list(range(1, 7)) and steps == sorted(steps), steps
    merged = {}
    for step, values in rows:
        assert not set(values) & set(merged.get(step, {})), f"step {step}: a key sent twice"
        merged.setdefault(step, {}).update(values)
    assert all(merged[s]["loss"] == s for s in range(1, 7)) and "resumed" not in merged[5]
    # a step the run held keeps what it had (here its loss alone): what else came at that step is not sent then
    assert [s for s in (2, 5, 6) if "val_loss" in merged[s]] == [s for s in (2, 5, 6) if s > held]


def test_the_offline_reader_reads_what_wandb_wrote(offline):
    import wandb

    run = wandb.init(project="p", id="reader1", config={"a": {"b": 1}})
    for step, values in ((1, {"loss": 1.0}), (2, {"loss": 2.0}), (2, {"val_loss": 0.5}), (5, {"loss": 5.0})):
        run.log(values, step=step)
    run.summary["final_model"] = "/m"
    run.finish()
    rows = wandb_history(offline, "reader1")
    assert [step for step, _ in rows] == [1, 2, 5] and rows[1][1]["loss"] == 2.0 and rows[1][1]["val_loss"] == 0.5
    assert [json.loads(i.value_json) for s in wandb_records(offline, "reader1", "summary") for i in s.update
            if i.key == "final_model"] == ["/m"]


def test_kill_and_resume_continue_each_tracker_run_with_each_step_once(tmp_path, offline):
    """SIGKILL right after step 5 is logged (checkpoints step_2, step_4): MLflow has steps 1..5, W&B what its
    service wrote before it died; the rerun resumes from step_4, continues both runs and sends each what it lacks."""
    out = tmp_path / "run"
    overrides = [*STEPS, "validation={fraction: 0.05, every_n_steps: 3}", "+metric_logger=[wandb,mlflow]",
                 "metric_loggers.wandb.project=trackers", "metric_loggers.wandb.tags=[tiny,resume]"]
    killed = subprocess.run([sys.executable, str(ROOT / "tests/interrupt.py"), "signal-at-step", "5", "SIGKILL", "--",
                             *args("configs/tiny.yaml", out, *overrides)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**own_service(), "PYTHONPATH": str(ROOT)})
    assert killed.returncode == -9, killed.stderr[-3000:]
    client, run = mlflow_run(out)
    assert [s for s, _ in mlflow_history(client, run, "loss")] == [1, 2, 3, 4, 5] and run.info.status == "RUNNING"

    assert full_finetune.main(args("configs/tiny.yaml", out, *overrides)) == 0
    expected = metrics(out)
    assert sorted(expected) == list(range(1, 9))
    runs = tracker_runs(out / "step_8")
    assert runs == tracker_runs(out / "step_4") and set(runs) == {"wandb", "mlflow"}, "the resumed run continues both"

    client, run = mlflow_run(out)
    assert run.info.run_id == runs["mlflow"]["run_id"] and run.info.status == "FINISHED"
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "epoch", "val_loss"):
        got = mlflow_history(client, run, key)
        assert [s for s, _ in got] == sorted(s for s, r in expected.items() if key in r), f"{key}: each step once"
    assert mlflow_history(client, run, "loss") == [(s, r["loss"]) for s, r in sorted(expected.items())]  # bit-exact
    assert run.data.params["optimizer.lr"] == "0.003" and run.data.params["metric_loggers.wandb.tags"] == '["tiny", "resume"]'
    assert run.data.tags["final_model"] == str((out / "step_8").resolve())

    run_id = runs["wandb"]["run_id"]
    rows = wandb_history(offline, run_id)
    assert [s for s, _ in rows] == list(range(1, 9)), "each step once across the run's offline files"
    assert [r["loss"] for _, r in rows] == [expected[s]["loss"] for s in range(1, 9)]
    assert [s for s, r in rows if "val_loss" in r] == [s for s, r in sorted(expected.items()) if "val_loss" in r]
    assert len(run_files(offline, run_id)) == 2, "the killed process's files and the resumed one's, one run"
    started = wandb_records(offline, run_id, "run")
    assert {r.run_id for r in started} == {run_id} and started[-1].project == "trackers"
    assert list(started[-1].tags) == ["tiny", "resume"] and started[-1].display_name == "run"
    finals = [json.loads(i.value_json) for s in wandb_records(offline, run_id, "summary") for i in s.update if i.key == "final_model"]
    assert finals == [str((out / "step_8").resolve())]


def test_preempted_run_resumes_its_run_and_a_tracker_added_on_resume_gets_the_history(tmp_path, offline, capsys):
    out = tmp_path / "run"
    first = ["epochs=1", "max_steps_per_epoch=6", "+metric_logger=mlflow"]
    with sigterm_at_step(3):
        assert full_finetune.main(args("configs/tiny.yaml", out, *first)) == 75
    client, run = mlflow_run(out)
    assert run.info.status == "KILLED" and [s for s, _ in mlflow_history(client, run, "loss")] == [1, 2, 3]
    assert set(tracker_runs(out / "step_3")) == {"mlflow"}
    capsys.readouterr()

    resumed = ["epochs=1", "max_steps_per_epoch=6", "+metric_logger=[mlflow,wandb]", "optimizer.lr=0.002"]
    assert full_finetune.main(args("configs/tiny.yaml", out, *resumed)) == 0
    printed = capsys.readouterr().out
    assert "note: metric_loggers.mlflow: the run keeps the parameters it started with; changed since: " in printed
    assert "note: metric_loggers.wandb: sending steps 1..3 from metrics.jsonl" in printed
    expected = metrics(out)
    client, run = mlflow_run(out)
    assert run.info.status == "FINISHED" and run.data.params["optimizer.lr"] == "0.003"
    assert mlflow_history(client, run, "loss") == [(s, r["loss"]) for s, r in sorted(expected.items())]
    runs = tracker_runs(out / "step_6")
    assert runs["mlflow"]["run_id"] == run.info.run_id
    rows = wandb_history(offline, runs["wandb"]["run_id"])
    assert [(s, r["loss"]) for s, r in rows] == [(s, r["loss"]) for s, r in sorted(expected.items())]


def test_lora_recipe_logs_to_its_tracker(tmp_path, offline):
    out = tmp_path / "lora"
    assert lora_finetune.main(args("configs/tiny_lora.yaml", out, "epochs=1", "max_steps_per_epoch=2",
                                   "save_merged=never", "+metric_logger=mlflow")) == 0
    client, run = mlflow_run(out)
    assert [s for s, _ in mlflow_history(client, run, "loss")] == [1, 2] and "lora.rank" in run.data.params
    assert run.data.tags["final_model"] == str((out / "step_2").resolve())
    assert tracker_runs(out / "step_2")["mlflow"]["run_id"] == run.info.run_id
