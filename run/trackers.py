"""Experiment trackers beside ``metrics.jsonl``: the config's ``metric_loggers``, each record sent to each once.

The config names them by a name of the user's choosing, each a Hydra section (``_target_`` and its options)::

    metric_loggers:
      wandb: {_target_: waypoint.run.tracker_wandb.WandbLogger, project: demo, mode: offline}
      mlflow: {_target_: waypoint.run.tracker_mlflow.MLflowLogger}   # tracking_uri null: output_dir/mlflow.db

(``+metric_logger=wandb``, ``+metric_logger=[wandb,mlflow]`` add the sections kept in ``configs/metric_logger/``.)
``metrics.jsonl`` is always written, whatever trackers there are (``waypoint.run.metrics``), and TensorBoard stays
the config's ``log_dir``. Each tracker gets the resolved config once, as its parameters, then every record that
``MetricsLog.write`` gets (its numbers, at its ``step``; val_loss records too), and the final model's path when the
run ends. Only rank 0 has trackers (the recipes give them to rank 0's ``MetricsLog`` alone).

Resume. A tracker's run id is kept in each step checkpoint's ``recipe_state.pt`` (``trackers``: name -> target and
run id, from :attr:`Trackers.runs`), so a resumed run continues the same tracker run, never a new one. Steps are
sent live, as they are trained, so a killed run may have sent steps past the checkpoint its rerun resumes from; the
tracker keeps them (MLflow and W&B histories cannot be rewritten), and the rerun must not send them again. A kill
may also lose steps the tracker was still holding in memory (W&B's service buffers its file). So on resume each
tracker says the last step its run holds, its mark, as its own store has it:

- MLflow: a run tag (``waypoint.logged_through``) written in the same ``log_batch`` as the metrics, one transaction
  in a database store, so the mark is exact and travels with the run;
- W&B online: the resumed run's step, from the W&B server; offline: the last step in the run's offline files
  (``waypoint.run.wandb_files``), what W&B will upload.

Steps up to the mark are not sent again (a note says which, and that the run keeps the values the interrupted run
logged for them, the same values, training being bit-exact, but for timings such as tokens_per_s); steps past the
mark up to the resumed checkpoint (a tracker added to the config on resume, or sends a kill lost) are sent from
``metrics.jsonl`` first; then the resumed run's own steps. Read back, each step is there once (a step the run held
keeps what it had: a val_loss of that step the kill came before is not sent later). A tracker that cannot tell
(``logged_through()`` None) is taken to hold the resumed step. A fresh run (no checkpoint, or ``resume=false``)
starts new tracker runs. Sending only the steps a committed checkpoint covers was the other way: the trackers would
lag training by a checkpoint interval (an epoch, by default), and a kill between a commit and its send would still
need the tracker's word on what it holds.

A tracker class takes its options as keyword arguments (a typo among them is one line when the config is checked,
:func:`tracker_problem`), may name the package it needs (``requires = (import name, waypoint extra)``) and a
``check_options(options) -> str | None``, and has ``start(name, config, run_id, output_dir, report) -> run id``,
``logged_through() -> int | None``, ``log(rows)`` with rows of (step, {key: number}) and ``finish(final_model)``
(None: the run stopped before its end, to be resumed).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from waypoint.errors import CheckpointError, first_line

EXAMPLE = "{wandb: {_target_: waypoint.run.tracker_wandb.WandbLogger, project: NAME}}"


class Trackers:
    """The open trackers of a run, each with the last step its run holds (``marks``); what ``MetricsLog`` sends
    every record to."""

    def __init__(self, trackers: Mapping[str, Any], targets: Mapping[str, str], marks: Mapping[str, int],
                 report: Callable[[str], None] = print) -> None:
        self.trackers, self.targets, self.marks, self.report = dict(trackers), dict(targets), dict(marks), report
        self.closed = False
        self._live: set[str] = set()  # the trackers this process has sent to

    @property
    def runs(self) -> dict[str, dict[str, str]]:
        """name -> {target, run_id}: what each step checkpoint keeps, so that a resumed run continues these runs."""
        return {name: {"target": self.targets[name], "run_id": str(tracker.run_id)} for name, tracker in self.trackers.items()}

    def replay(self, records: Iterable[Mapping[str, Any]]) -> None:
        """At the start: the records already in ``metrics.jsonl`` (those up to the resumed step), for the trackers
        that lack them."""
        records = list(records)
        for name, tracker in self.trackers.items():
            rows = [row for row in map(numbers, records) if row and row[0] > self.marks[name]]
            if rows:
                self.report(f"note: metric_loggers.{name}: sending steps {rows[0][0]}..{rows[-1][0]} from metrics.jsonl "
                            "(its run lacks them)")
                self._send(name, tracker, rows)

    def write(self, record: Mapping[str, Any]) -> None:
        row = numbers(record)
        if row is None:
            return
        for name, tracker in self.trackers.items():
            if row[0] > self.marks[name] or (row[0] == self.marks[name] and name in self._live):
                self._send(name, tracker, [row])

    def _send(self, name: str, tracker, rows: list[tuple[int, dict[str, float]]]) -> None:
        last = rows[-1][0]
        self.marks[name] = last
        self._live.add(name)  # more numbers at the same step (val_loss beside loss) go on to this run
        try:
            tracker.log(rows)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"metric_loggers.{name}: cannot log step {last} ({first_line(e)}); "
                                  "rerun the same command to resume, and the steps it lacks are sent again") from e

    def close(self, final_model: str | None = None) -> None:
        """Finish each tracker's run, with the final model's path (None: stopped before the end, to be resumed)."""
        if self.closed:
            return
        self.closed = True
        for name, tracker in self.trackers.items():
            try:
                tracker.finish(final_model)
            except Exception as e:  # the model is saved: a tracker's hiccup now is worth a line, not a failed run
                self.report(f"warning: metric_loggers.{name}: could not finish its run ({first_line(e)})")


def numbers(record: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(step, the record's numbers but its step): what a tracker logs of a ``metrics.jsonl`` record."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    values = {k: float(v) for k, v in record.items()
              if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return (step, values) if values else None


def open_trackers(sections: Mapping[str, Any] | None, config: Mapping[str, Any], saved: Mapping[str, Any] | None,
                  output_dir: str | os.PathLike, resumed_step: int, report: Callable[[str], None] = print) -> Trackers | None:
    """Start (or, with ``saved``, the recipe state's ``trackers``, continue) each tracker the config names; None
    when it names none. ``resumed_step``: the step the run continues from (0: a fresh run)."""
    if not sections:
        return None
    from omegaconf import OmegaConf

    if OmegaConf.is_config(sections):
        sections = OmegaConf.to_container(sections, resolve=True)
    problem = tracker_problem(sections)
    if problem:
        raise CheckpointError(problem)
    from hydra.utils import instantiate

    output_dir = Path(output_dir)
    trackers, targets, marks = {}, {}, {}
    try:
        for name, section in sections.items():
            target = section["_target_"]
            where = f"metric_loggers.{name}"
            try:
                tracker = instantiate(dict(section), _convert_="all")
            except Exception as e:
                raise CheckpointError(f"{where}: {first_line(e.__cause__ or e)}") from None
            earlier = (saved or {}).get(name)
            run_id = earlier["run_id"] if earlier and earlier.get("target") == target else None
            if earlier and run_id is None:
                report(f"note: {where}: its _target_ changed ({earlier.get('target')} -> {target}); starting a new run")
            try:
                started = tracker.start(name=name, config=dict(config), run_id=run_id, output_dir=output_dir, report=report)
            except CheckpointError:
                raise
            except ModuleNotFoundError as e:
                if (e.name or "").split(".")[0] != getattr(tracker, "requires", ("",))[0]:
                    raise CheckpointError(f"{where}: cannot start its run ({first_line(e)})") from e
                raise CheckpointError(needs_package(where, target)) from None
            except Exception as e:
                raise CheckpointError(f"{where}: cannot start its run ({first_line(e)})") from e
            trackers[name], targets[name] = tracker, target
            if run_id is None or started != run_id:  # a new run holds nothing yet
                marks[name] = 0
                continue
            held = tracker.logged_through()
            marks[name] = held if held is not None else resumed_step
            if marks[name] > resumed_step:
                report(f"note: {where}: steps {resumed_step + 1}..{marks[name]} were logged before the run stopped; "
                       "they are not sent again (the run keeps the values logged then)")
    except BaseException:
        for tracker in trackers.values():
            try:
                tracker.finish(None)
            except Exception:
                pass
        raise
    return Trackers(trackers, targets, marks, report)


# -- the config's metric_loggers, checked before anything is read or written ------------------------------------------
def needs_package(where: str, target: str) -> str:
    module, extra = getattr(_locate(target), "requires", (target.split(".")[0], target.split(".")[0]))
    return f"{where}: needs the {module} package (pip install 'waypoint[{extra}]')"


def tracker_problem(sections: Any) -> str | None:
    """The first thing wrong with a ``metric_loggers`` value, as a whole line naming its key; None when it is fine."""
    if sections is None:
        return None
    if not isinstance(sections, Mapping):
        return f"metric_loggers={sections!r}: expected a map of name: tracker section, e.g. {EXAMPLE} (or +metric_logger=wandb)"
    for name, section in sections.items():
        where = f"metric_loggers.{name}"
        if not isinstance(section, Mapping) or not isinstance(section.get("_target_"), str) or not section["_target_"]:
            return f"{where}: expected a section with a _target_, e.g. {EXAMPLE}"
        target = _locate(section["_target_"])
        if target is None:
            return (f"{where}._target_={section['_target_']}: no such class; the trackers are "
                    "waypoint.run.tracker_wandb.WandbLogger and waypoint.run.tracker_mlflow.MLflowLogger")
        requires = getattr(target, "requires", None)
        if requires and importlib.util.find_spec(requires[0]) is None:
            return needs_package(where, section["_target_"])
        options = {k: v for k, v in section.items() if k != "_target_"}
        known = _parameters(target)
        for key in options:
            if known is not None and key not in known:
                near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                hint = f"did you mean {near[0]}? " if near else ""
                return f"{where}.{key}: no such option of {target.__name__} ({hint}it takes {', '.join(known)})"
        check = getattr(target, "check_options", None)
        problem = check(options) if check else None
        if problem:
            return f"{where}.{problem}"
    return None


def _locate(dotted: str):
    module, _, attribute = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute, None) if module else None
    except ImportError:
        return None


def _parameters(target) -> list[str] | None:
    """The keyword options ``target`` takes; None when it takes any (``**kwargs``)."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def kept_at(run_dir, step: str | os.PathLike) -> str:
    """Where a run's step is kept for good, for the trackers' ``final_model``: its object-store URL (``RunDir.store``),
    or its absolute local path."""
    return f"{run_dir.store.rstrip('/')}/{Path(step).name}" if run_dir.store else str(Path(step).resolve())
