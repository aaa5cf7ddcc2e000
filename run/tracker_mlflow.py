"""MLflow as a ``metric_loggers`` tracker (``pip install 'waypoint[mlflow]'``; ``waypoint.run.trackers``).

    metric_loggers:
      mlflow: {_target_: waypoint.run.tracker_mlflow.MLflowLogger, tracking_uri: null, experiment: null}

``tracking_uri``: any MLflow tracking URI (``http://host:5000``, ``sqlite:///path.db``, ``databricks``...); null:
``$MLFLOW_TRACKING_URI``, else a SQLite database in the run's ``output_dir`` (``sqlite:///<output_dir>/mlflow.db``;
``mlflow ui --backend-store-uri`` that URI shows it; an object-store run's is in its local mirror, not uploaded).
``experiment``: null: ``$MLFLOW_EXPERIMENT_NAME``, else ``waypoint``. ``run_name``: null: output_dir's name.
``tags``: more run tags. A ``tracking_uri`` of no scheme MLflow knows is one line when the config is checked
(:func:`uri_problem`), one MLflow cannot open (a file store MLflow 3 refuses, a database driver not installed) one
line at start; a server that is down or does not answer only drops the tracker (``waypoint.run.trackers``).

The resolved config goes in as the run's parameters, flattened to dotted keys (``optimizer.lr``); each record's
numbers as metrics at its step, through ``log_batch``; the final model's path as the ``final_model`` tag. A run
stopped to be resumed is left ``KILLED`` and set ``RUNNING`` again when it resumes (one that ends in an error,
``FAILED``); so is one the training run dropped (a call that failed or timed out: ``abandon``), marked from a thread
of its own that training never waits for. It keeps the parameters it started with (MLflow cannot change one), and a
note names those the resumed config changed.

MLflow appends every value it is given, so a step sent twice would be there twice: each ``log_batch`` also sets the
run tag ``waypoint.logged_through`` to its last step, in the same transaction in a database store, and a resumed run
sends only the steps past it (``waypoint.run.trackers``). ``get_metric_history`` then holds one value per step.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from waypoint.errors import CheckpointError, first_line

MARK_TAG = "waypoint.logged_through"  # the last step the run holds
MAX_PARAMS = 100  # parameters per log_batch
MAX_METRICS = 1000  # metrics per log_batch
QUIET = ("mlflow.store.db.utils", "alembic.runtime.migration", "alembic")  # "creating initial database tables..."
# the schemes of MLflow's own tracking stores (a database's with its driver: postgresql+psycopg2); plugins add theirs
SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")
URI_FORMS = "http(s)://HOST:PORT, sqlite:///PATH.db, postgresql://..., mysql://..., mssql://..., databricks, file:PATH or a PATH"


class MLflowLogger:
    requires = ("mlflow", "mlflow")  # (import name, waypoint extra)

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None, run_name: str | None = None,
                 tags: dict[str, str] | None = None) -> None:
        self.tracking_uri, self.experiment, self.run_name, self.tags = tracking_uri, experiment, run_name, dict(tags or {})
        self.client = None
        self.run_id: str | None = None
        self.held = 0
        self.abandoned = False  # dropped by the run (a call failed or timed out): nothing more is sent but its status
        self.ending: str | None = None  # the status finish() ends the run with, once it is called
        self._marking: threading.Thread | None = None  # a dropped run's status being set (abandon)
        self._mark_lock = threading.Lock()

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> str | None:
        for key in ("tracking_uri", "experiment", "run_name"):
            value = options.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                return f"{key}={value}: expected null or a non-empty string"
        problem = uri_problem(options.get("tracking_uri"))
        if problem:
            return f"tracking_uri={options['tracking_uri']}: {problem}"
        tags = options.get("tags")
        if tags is not None and not isinstance(tags, Mapping):
            return f"tags={tags}: expected a map of tag: value"
        return None

    def start(self, name: str, config: Mapping[str, Any], run_id: str | None, output_dir: Path,
              report: Callable[[str], None]) -> str:
        for logger in QUIET:
            logging.getLogger(logger).setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        given = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        uri = given or f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"
        where = (f"metric_loggers.{name}.tracking_uri={uri}" if self.tracking_uri else
                 f"$MLFLOW_TRACKING_URI={uri} (metric_loggers.{name}.tracking_uri is null)" if given else
                 f"metric_loggers.{name}: {uri}")
        problem = uri_problem(uri)
        if problem:
            raise CheckpointError(f"{where}: {problem}")
        try:  # no network yet: the store for the URI (a local database is created)
            client = MlflowClient(tracking_uri=uri)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] == "mlflow":
                raise
            raise CheckpointError(f"{where}: MLflow needs the {e.name} package for it (pip install {e.name})") from None
        except Exception as e:
            hint = ("this MLflow refuses file stores; use sqlite:///PATH.db, or set MLFLOW_ALLOW_FILE_STORE=true"
                    if "MLFLOW_ALLOW_FILE_STORE" in str(e) else f"{first_line(e)} ({type(e).__name__})")
            raise CheckpointError(f"{where}: MLflow cannot open it: {hint}") from None
        if self.abandoned:
            return ""
        self.uri, self.client = uri, client
        run = self._existing(run_id, name, report) if run_id else None
        if run is None:
            experiment = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "waypoint"
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(experiment_id, run_name=self.run_name or Path(output_dir).resolve().name,
                                         tags={str(k): str(v) for k, v in self.tags.items()})
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        self.held = int(run.data.tags.get(MARK_TAG, 0))
        if not self.abandoned:
            atexit.register(self._failed)  # a process that ends without finish(): an error stopped the run
        self._log_params(flatten(config), run.data.params, name, report)
        if self.abandoned:  # given up on while its run started: that run is a dropped one too
            self._mark_dropped()
        return self.run_id

    def _existing(self, run_id: str, name: str, report: Callable[[str], None]):
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException:
            report(f"note: metric_loggers.{name}: run {run_id} is not in {self.uri}; starting a new run")
            return None

    def _log_params(self, params: dict[str, str], held: Mapping[str, str], name: str, report: Callable[[str], None]) -> None:
        from mlflow.entities import Param

        new = [Param(k, v) for k, v in params.items() if k not in held]
        for i in range(0, len(new), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=new[i:i + MAX_PARAMS])
        changed = sorted(k for k, v in params.items() if k in held and held[k] != v)
        if changed:
            report(f"note: metric_loggers.{name}: the run keeps the parameters it started with; changed since: {', '.join(changed)}")

    def logged_through(self) -> int | None:
        return self.held

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        batch: list[Metric] = []
        for i, (step, values) in enumerate(rows):
            batch += [Metric(key, value, now, step) for key, value in values.items()]
            last = i == len(rows) - 1
            if last or len(batch) + len(rows[i + 1][1]) > MAX_METRICS:  # a step's numbers stay in one batch
                self.client.log_batch(self.run_id, metrics=batch, tags=[RunTag(MARK_TAG, str(step))])
                self.held, batch = step, []

    def finish(self, final_model: str | None) -> None:
        if self.client is None or self.run_id is None:
            return
        self.ending = "FINISHED" if final_model is not None else "KILLED"
        if final_model is not None:
            self.client.set_tag(self.run_id, "final_model", final_model)
        self.client.set_terminated(self.run_id, status=self.ending)
        self.client = None

    def abandon(self) -> None:
        """Dropped (a call failed or timed out): no more calls from the run. Its MLflow run is marked ``KILLED`` (a
        finish() given up on: the status it was ending it with), not left ``RUNNING``, from a thread of its own: the
        run never waits for it (a silent server would hold it), and the process waits for it at exit at most
        ``timeout_s``. A resumed run sets it ``RUNNING`` again and continues it."""
        self.abandoned = True
        atexit.unregister(self._failed)
        self._mark_dropped()

    def _mark_dropped(self) -> None:
        with self._mark_lock:
            if self._marking is not None or self.client is None or self.run_id is None:
                return  # marked already, finished, or no run started
            self._marking = threading.Thread(target=_terminate, args=(self.client, self.run_id, self.ending or "KILLED"),
                                             name="waypoint-tracker mlflow: marking its dropped run", daemon=True)
            self._marking.start()
        atexit.register(self._marking.join, getattr(self, "timeout_s", None) or 60.0)

    def _failed(self) -> None:
        if self.client is not None and not self.abandoned:
            try:
                self.client.set_terminated(self.run_id, status="FAILED")
            except Exception:  # leaving: nothing more to be done about it
                pass
            self.client = None


def _terminate(client, run_id: str, status: str) -> None:
    """``client.set_terminated(run_id, status)``, whatever comes of it (a dropped tracker's server may be gone)."""
    try:
        client.set_terminated(run_id, status=status)
    except Exception:  # noqa: BLE001 - nothing more to be done about a run the training run went on without
        pass


def uri_problem(uri: str | None) -> str | None:
    """What is wrong with a tracking URI, as the end of a line; None when MLflow has a store for its scheme (or the
    URI is a path). Checked without importing MLflow (plugins' schemes from their entry points)."""
    if uri is None:
        return None
    if uri in ("databricks", "databricks-uc", "uc"):
        return None
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    if match is None or len(match.group(1)) == 1:
        return None  # a path (a Windows one's drive letter too)
    scheme = match.group(1).lower()
    if scheme.split("+")[0] in SCHEMES or scheme in _plugin_schemes():
        return None
    host = f"; did you mean http://{uri}?" if re.match(r"^[A-Za-z0-9.-]+:\d+/?$", uri) else ""
    return f"not a tracking URI MLflow knows (scheme {scheme}:{host}); use {URI_FORMS}; null: a SQLite database in output_dir"


def _plugin_schemes() -> set[str]:
    from importlib.metadata import entry_points

    try:
        return {e.name.lower() for e in entry_points(group="mlflow.tracking_store")}
    except Exception:  # noqa: BLE001 - a broken distribution's metadata: no plugins then
        return set()


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optimizer": {"lr": 0.001}}`` -> ``{"optimizer.lr": "0.001"}``: MLflow's parameters, each a string (lists
    and null as JSON), cut to the longest value MLflow keeps."""
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as longest
    except ImportError:
        longest = 500
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            flat[f"{prefix}{key}"] = text[:longest]
    return flat
