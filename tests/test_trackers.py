"""Experiment trackers (metric_loggers): W&B offline and MLflow on a local SQLite store, the real libraries read
back through their own files and client. One tracker run per training run across kill-and-resume, each step in
its history once, with the values of metrics.jsonl; the config as parameters; the final model's path at the end;
bad tracker options as one line before anything is written."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from recipes import full_finetune, lora_finetune
from tests.conftest import ROOT, TRACKERS, needs, sigterm_at_step
from tests.recipe_runs import run_recipe
from waypoint.run.wandb_files import BLOCK, closed, history, parsed, records, run_files, wait_closed

pytestmark = [TRACKERS, needs("wandb", "mlflow")]

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
    (["+metric_logger=mlflow", "metric_loggers.mlflow.tracking_uri=nosuchscheme://x"], None,
     "error: metric_loggers.mlflow.tracking_uri=nosuchscheme://x: not a tracking URI MLflow knows (scheme nosuchscheme:); "
     "use http(s)://HOST:PORT, sqlite:///PATH.db"),
    (["+metric_logger=mlflow", "metric_loggers.mlflow.tracking_uri=localhost:5000"], None,
     "error: metric_loggers.mlflow.tracking_uri=localhost:5000: not a tracking URI MLflow knows (scheme localhost:; "
     "did you mean http://localhost:5000?)"),
    (["+metric_logger=wandb", "metric_loggers.wandb.timeout_s=0"], None,
     "error: metric_loggers.wandb.timeout_s=0: expected null or a number of seconds > 0 (default 60)"),
], ids=["typo", "mode", "experiment", "target", "no-wandb", "no-mlflow", "uri-scheme", "uri-host", "timeout"])
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

    # dir and mode given, not only in the environment: an earlier test in this process (the recipes' trackers) leaves
    # W&B's settings singleton holding that test's WANDB_DIR
    run = wandb.init(project="p", id="reader1", config={"a": {"b": 1}}, dir=str(offline.parent), mode="offline",
                     reinit="create_new")  # a run an earlier test left active in this process is not returned
    for step, values in ((1, {"loss": 1.0}), (2, {"loss": 2.0}), (2, {"val_loss": 0.5}), (5, {"loss": 5.0})):
        run.log(values, step=step)
    run.summary["final_model"] = "/m"
    run.finish()
    assert wait_closed(run.settings.sync_file, 60), "W&B's service never wrote the run's file"
    rows = wandb_history(offline, "reader1")
    assert [step for step, _ in rows] == [1, 2, 5]
    assert rows[1][1]["loss"] == 2.0 and rows[1][1]["val_loss"] == 0.5
    assert [json.loads(i.value_json) for s in wandb_records(offline, "reader1", "summary") for i in s.update
            if i.key == "final_model"] == ["/m"]


@pytest.fixture
def late_stream_close(monkeypatch):
    """W&B's service closes a finished run's stream (and writes its file) a second after ``run.finish()`` returns,
    as on a busy machine: ``finish`` tells the service with a message it does not wait on."""
    from wandb.sdk.lib.service.service_connection import ServiceConnection

    inform, timers = ServiceConnection.inform_finish, []

    def later(self, run_id):
        timers.append(threading.Timer(1.0, inform, (self, run_id)))
        timers[-1].start()

    monkeypatch.setattr(ServiceConnection, "inform_finish", later)
    yield
    for timer in timers:
        timer.join()


def test_an_offline_run_is_on_disk_when_its_tracker_has_finished(offline, tmp_path, late_stream_close):
    """A run resumed in the same process reads the earlier run's file: the tracker's finish waits for W&B to write it
    (with W&B's own ``run.finish()`` alone the file still held only its header, and the reader found no steps)."""
    import wandb

    from waypoint.run.tracker_wandb import WandbLogger

    bare = wandb.init(project="p", id="bare1", dir=str(offline.parent), mode="offline", reinit="create_new")
    bare.log({"loss": 1.0}, step=1)
    bare.finish()
    assert not closed(bare.settings.sync_file) and wandb_history(offline, "bare1") == [], "W&B's file, unwritten yet"
    logger = WandbLogger()
    logger.start("t", {"seed": 1}, "ours2", tmp_path / "out", report=print)
    logger.log([(1, {"loss": 1.0}), (2, {"loss": 2.0})])
    logger.finish("/m")
    assert [s for s, _ in wandb_history(offline, "ours2")] == [1, 2]


def test_the_reader_finds_the_exit_record_in_the_last_blocks_and_not_in_a_torn_file(offline, tmp_path):
    import wandb

    run = wandb.init(project="p", id="long1", dir=str(offline.parent), mode="offline", reinit="create_new")
    for step in range(1, 301):  # a file of several 32 KiB blocks
        run.log({f"metric_{k}": float(step) for k in range(12)}, step=step)
    run.finish()
    path = Path(run.settings.sync_file)
    assert wait_closed(path, 60)
    whole = list(records(path))
    tail = list(records(path, last_blocks=2))
    assert path.stat().st_size > 3 * BLOCK and 0 < len(tail) < len(whole) and tail == whole[-len(tail):]
    assert [s for s, _ in wandb_history(offline, "long1")] == list(range(1, 301))
    for name, data in (("header", path.read_bytes()[:7]), ("torn", path.read_bytes()[:-5]), ("other", b"PK\x03\x04")):
        (tmp_path / name).write_bytes(data)
        assert not closed(tmp_path / name), name
    assert not closed(tmp_path / "missing")


def test_a_wandb_run_already_active_in_the_process_is_not_taken_for_ours(offline, tmp_path):
    """A run active in the process (the user's own, or a tracker of ours dropped earlier, which W&B finishes at exit)
    was handed back by ``wandb.init`` as the new run: a second training in one process logged into the first's run."""
    import wandb

    from waypoint.run.tracker_wandb import WandbLogger

    theirs = wandb.init(project="p", id="theirs1", dir=str(offline.parent), mode="offline", reinit="create_new")
    try:
        logger = WandbLogger()
        run_id = logger.start("t", {"seed": 1}, "ours1", tmp_path / "out", report=print)
        logger.log([(1, {"loss": 1.0})])
        logger.finish("/m")
    finally:
        theirs.finish()
    assert run_id == "ours1" and [s for s, _ in wandb_history(offline, "ours1")] == [1]
    assert wandb_history(offline, "theirs1") == []


def test_kill_and_resume_continue_each_tracker_run_with_each_step_once(tmp_path, offline, monkeypatch):
    """SIGKILL right after step 5 is logged (checkpoints step_2, step_4): MLflow has steps 1..5, W&B what its
    service wrote before it died; the rerun resumes from step_4, continues both runs and sends each what it lacks.
    W&B is given no dir (nor $WANDB_DIR): its files are in output_dir/wandb, none in the current directory."""
    monkeypatch.delenv("WANDB_DIR")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    out = tmp_path / "run"
    offline = out / "wandb"
    overrides = [*STEPS, "validation={fraction: 0.05, every_n_steps: 3}", "+metric_logger=[wandb,mlflow]",
                 "metric_loggers.wandb.project=trackers", "metric_loggers.wandb.tags=[tiny,resume]"]
    killed = run_recipe("full", args("configs/tiny.yaml", out, *overrides), fault=["signal-at-step", "5", "SIGKILL"],
                        cwd=here, env={"WANDB_SERVICE": None})  # its own W&B service, as a process of the same job has
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
    assert list(here.iterdir()) == [], "nothing written in the current directory"


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


def mlflow_status(out, deadline_s: float = 10.0, leaving: str = "RUNNING"):
    """The status of output_dir's one MLflow run, once it is not ``leaving`` (or ``deadline_s`` has passed)."""
    started = time.monotonic()
    while True:
        status = mlflow_run(out)[1].info.status
        if status != leaving or time.monotonic() - started > deadline_s:
            return status
        time.sleep(0.05)


def test_a_dropped_mlflow_run_is_marked_killed_and_a_resumed_run_finishes_it(tmp_path, offline):
    """MLflow's log_batch fails mid-run (a connection reset): the tracker is dropped with its warning line and its run
    marked KILLED, from a thread training does not wait for (it was left RUNNING, as if training were still sending to
    it); a resumed training run continues that run, RUNNING again, sends it what it lacks and finishes it."""
    from waypoint.run.metrics import MetricsLog
    from waypoint.run.trackers import open_trackers

    section = {"mlflow": {"_target_": "waypoint.run.tracker_mlflow.MLflowLogger"}}
    lines = []
    trackers = open_trackers(section, {"seed": 1}, None, tmp_path, 0, report=lines.append)
    log = MetricsLog(tmp_path, trackers=trackers)
    log.write(step=1, loss=1.0)

    def reset(*args, **kwargs):
        raise ConnectionResetError("Connection reset by peer")
    trackers.trackers["mlflow"].client.log_batch = reset
    log.write(step=2, loss=2.0)
    assert lines == ["warning: metric_loggers.mlflow: cannot log step 2 (Connection reset by peer); the run goes on "
                     "without it (metrics.jsonl has every step; a resumed run sends it the steps it lacks)"]
    assert mlflow_status(tmp_path) == "KILLED"
    log.close(final_model=None)  # stopped to be resumed: nothing more is sent to the dropped tracker
    client, run = mlflow_run(tmp_path)
    assert run.info.status == "KILLED" and [s for s, _ in mlflow_history(client, run, "loss")] == [1]

    trackers = open_trackers(section, {"seed": 1}, trackers.runs, tmp_path, 2, report=lines.append)
    assert mlflow_run(tmp_path)[1].info.status == "RUNNING"
    log = MetricsLog(tmp_path, keep_through_step=2, trackers=trackers)
    log.write(step=3, loss=3.0)
    log.close(final_model="/m")
    client, run = mlflow_run(tmp_path)
    assert run.info.status == "FINISHED" and mlflow_history(client, run, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]


# -- a tracker never hangs or stops training ----------------------------------------------------------------------------
@contextlib.contextmanager
def silent_server():
    """A port on 127.0.0.1 whose server accepts every connection and never answers (a hung tracking server); closed
    at the end, so that a request given up on ends too."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    accepted, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for connection in accepted:
            connection.close()
        server.close()


@contextlib.contextmanager
def deadline(seconds: int):
    """The block fails after ``seconds`` rather than hang the suite (SIGALRM interrupts a blocked read)."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a tracker hangs the run")
    before = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def test_a_silent_tracking_server_neither_hangs_nor_stops_training(tmp_path, offline, capsys, monkeypatch):
    """An MLflow server that accepts connections and never answers: the load report first, then one warning line
    once timeout_s is out, and the run trains to its end without it, metrics.jsonl complete. (It hung before: the
    tracking URI was taken for an object-store input to download, then MLflow waits 120 s a request, 7 retries.)"""
    import mlflow  # noqa: F401 - imported before the clock starts, as a run imports it before timeout_s counts

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the request given up on ends once the server closes
    out = tmp_path / "run"
    with silent_server() as port, deadline(90):
        started = time.monotonic()
        code = full_finetune.main(args("configs/tiny.yaml", out, "epochs=1", "max_steps_per_epoch=3", "+metric_logger=mlflow",
                                       f"metric_loggers.mlflow.tracking_uri=http://127.0.0.1:{port}",
                                       "metric_loggers.mlflow.timeout_s=0.5"))
        took = time.monotonic() - started
    printed = capsys.readouterr().out
    assert code == 0, printed
    warnings = [line for line in printed.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: metric_loggers.mlflow: cannot start its run (no answer within 0.5 s (timeout_s, while "
                        "starting its run)); the run goes on without it (metrics.jsonl has every step; a resumed run "
                        "sends it the steps it lacks)"], printed
    assert printed.index("loaded 39 tensors") < printed.index("warning: metric_loggers.mlflow"), "the load report first"
    assert sorted(metrics(out)) == [1, 2, 3] and (out / "step_3").is_dir()
    assert "trackers" not in torch.load(out / "step_3" / "recipe_state.pt", weights_only=True) or \
        not tracker_runs(out / "step_3"), "no tracker run was started: a resumed run starts one and sends it every step"
    assert took < 60, f"{took:.0f} s"


class SlowFinish(Memory):
    """A tracker whose server stops answering as its run is finished."""

    def __init__(self, path: str, port: int) -> None:
        super().__init__(path)
        self.port = port

    def finish(self, final_model):
        with socket.create_connection(("127.0.0.1", self.port)) as connection:
            connection.recv(1)


class Stalls(Memory):
    """A tracker whose server stops answering mid-run: its log of step ``at`` (once: a file beside its store says it
    happened) waits for an answer from ``port`` that never comes, or, with port 0, raises."""

    def __init__(self, path: str, at: int, port: int) -> None:
        super().__init__(path)
        self.at, self.port = at, port

    def log(self, rows):
        once = self.path.with_suffix(".stalled")
        if any(step == self.at for step, _ in rows) and not once.exists():
            once.touch()
            if not self.port:
                raise ConnectionResetError("Connection reset by peer")
            with socket.create_connection(("127.0.0.1", self.port)) as connection:
                connection.sendall(b"POST /log HTTP/1.1\r\nHost: x\r\n\r\n")
                connection.recv(1)  # never answered (then closed, at the end of the test)
        super().log(rows)


def test_a_tracker_silent_mid_run_is_dropped_and_a_resumed_run_sends_it_what_it_lacks(tmp_path, capsys):
    """Step 2 of 6 hangs in the tracker: one warning line, training goes on; preempted at step 4 and resumed, the run
    continues the tracker's run (its id kept in the checkpoints) and sends it steps 2..6: each step in it once. (A
    failed call stopped the run before, and a hung one held it for good.)"""
    out, store = tmp_path / "run", tmp_path / "stall.json"
    with silent_server() as port, deadline(90):
        section = f"+metric_loggers.stall={{_target_: tests.test_trackers.Stalls, path: '{store}', at: 2, port: {port}, " \
                  "timeout_s: 0.5}"
        with sigterm_at_step(4):
            assert full_finetune.main(args("configs/tiny.yaml", out, "epochs=1", "max_steps_per_epoch=6", section)) == 75
        printed = capsys.readouterr().out
        assert [line for line in printed.splitlines() if line.startswith("warning: ")] == [
            "warning: metric_loggers.stall: cannot log step 2 (no answer within 0.5 s (timeout_s, while logging step 2)); "
            "the run goes on without it (metrics.jsonl has every step; a resumed run sends it the steps it lacks)"], printed
        assert [step for step, _ in json.loads(store.read_text())] == [1], "nothing sent after it was dropped"
        assert sorted(metrics(out)) == [1, 2, 3, 4] and tracker_runs(out / "step_4")["stall"]["run_id"] == "new"

        assert full_finetune.main(args("configs/tiny.yaml", out, "epochs=1", "max_steps_per_epoch=6", section)) == 0
    assert "note: metric_loggers.stall: sending steps 2..4 from metrics.jsonl" in capsys.readouterr().out
    *rows, final = json.loads(store.read_text())
    assert [step for step, _ in rows] == [1, 2, 3, 4, 5, 6] and final == [None, str((out / "step_6").resolve())]
    expected = metrics(out)
    assert [values["loss"] for _, values in rows] == [expected[s]["loss"] for s in range(1, 7)]


def test_a_tracker_that_fails_is_dropped_with_a_warning_and_its_finish_is_bounded(tmp_path):
    """A tracker's log that raises (a connection reset) drops it with one warning line, the others go on; a finish
    that hangs is given up on after timeout_s with a warning (the model is saved by then)."""
    from waypoint.run.metrics import MetricsLog
    from waypoint.run.trackers import open_trackers

    lines = []
    with silent_server() as port, deadline(30):
        sections = {"bad": {"_target_": "tests.test_trackers.Stalls", "path": str(tmp_path / "bad.json"), "at": 2, "port": 0},
                    "slow": {"_target_": "tests.test_trackers.SlowFinish", "path": str(tmp_path / "slow.json"),
                             "port": port, "timeout_s": 0.3}}
        trackers = open_trackers(sections, {"seed": 1}, None, tmp_path, 0, report=lines.append)
        log = MetricsLog(tmp_path, trackers=trackers)
        for step in (1, 2, 3):
            log.write(step=step, loss=float(step))
        log.close(final_model="/m")
    assert lines == ["warning: metric_loggers.bad: cannot log step 2 (Connection reset by peer); the run goes on without "
                     "it (metrics.jsonl has every step; a resumed run sends it the steps it lacks)",
                     "warning: metric_loggers.slow: could not finish its run (no answer within 0.3 s (timeout_s, while "
                     "finishing its run))"]
    assert [step for step, _ in json.loads((tmp_path / "bad.json").read_text())] == [1]
    assert [step for step, _ in json.loads((tmp_path / "slow.json").read_text())] == [1, 2, 3]
    assert set(trackers.runs) == {"bad", "slow"}, "a dropped tracker's run is kept for a resumed run to continue"
