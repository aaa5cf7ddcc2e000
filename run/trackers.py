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

A tracker never stops or stalls training. Each call to one (starting its run, logging, finishing) is bounded by its
section's ``timeout_s`` (default :data:`TIMEOUT_S`; the call runs in a thread of its own that is given up on then,
so a server that accepts connections and never answers costs that long once). A tracker whose call fails or times
out, at start, on resume or mid-run, is dropped with one ``warning:`` line and the run goes on without it:
``metrics.jsonl`` has every step, and when the run is resumed the tracker gets the steps its run lacks from it (a
dropped run's id stays in the checkpoints, so the resumed run continues it; one that never started starts anew and
gets the whole history). A mistake in its config is no outage: an unknown option, a value its ``check_options``
refuses (an MLflow ``tracking_uri`` of no scheme MLflow knows), a missing package, a ``CheckpointError`` from
``start`` (a tracking URI MLflow cannot open) are one ``error:`` line before training, as before anything is read
or written where the config check finds them.

A tracker class takes its options as keyword arguments (a typo among them is one line when the config is checked,
:func:`tracker_problem`; ``timeout_s`` is the section's, not the class's), may name the package it needs
(``requires = (import name, waypoint extra)``) and a ``check_options(options) -> str | None``, and has
``start(name, config, run_id, output_dir, report) -> run id``, ``logged_through() -> int | None``, ``log(rows)``
with rows of (step, {key: number}) and ``finish(final_model)`` (None: the run stopped before its end, to be
resumed); optionally ``abandon()``, told without a network call that it is dropped (no more calls come: it may mark
its run stopped from a thread of its own, never waited for by training), and a ``timeout_s`` attribute, which start()
may pass on to its library's own timeouts.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from waypoint.errors import CheckpointError, first_line

EXAMPLE = "{wandb: {_target_: waypoint.run.tracker_wandb.WandbLogger, project: NAME}}"
TIMEOUT = "timeout_s"  # every tracker section's: the longest one call to the tracker may take
TIMEOUT_S = 60.0
GOES_ON = "the run goes on without it (metrics.jsonl has every step; a resumed run sends it the steps it lacks)"


class TrackerTimeout(Exception):
    """A call to a tracker that did not return within its ``timeout_s``."""


def bounded(call: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``call()`` in a daemon thread of its own, waited for at most ``timeout_s`` seconds: its value, or its error
    raised here, or :class:`TrackerTimeout` (the thread is given up on: it ends when its call does, or with the
    process)."""
    done, outcome = threading.Event(), {}

    def work() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=work, name=f"waypoint-tracker {what}", daemon=True).start()
    if not done.wait(timeout_s):
        raise TrackerTimeout(f"no answer within {timeout_s:g} s ({TIMEOUT}, while {what})")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class Trackers:
    """The open trackers of a run, each with the last step its run holds (``marks``); what ``MetricsLog`` sends
    every record to. A tracker whose call fails or times out is dropped (``dropped``) with a warning line."""

    def __init__(self, trackers: Mapping[str, Any], targets: Mapping[str, str], marks: Mapping[str, int],
                 report: Callable[[str], None] = print, timeouts: Mapping[str, float] | None = None) -> None:
        self.trackers, self.targets, self.marks, self.report = dict(trackers), dict(targets), dict(marks), report
        self.timeouts = {name: (timeouts or {}).get(name, TIMEOUT_S) for name in self.trackers}
        self.dropped: dict[str, Any] = {}
        self.closed = False
        self._live: set[str] = set()  # the trackers this process has sent to

    @property
    def runs(self) -> dict[str, dict[str, str]]:
        """name -> {target, run_id}: what each step checkpoint keeps, so that a resumed run continues these runs (a
        tracker dropped mid-run too: resumed, its run gets the steps it lacks)."""
        every = {**self.dropped, **self.trackers}
        return {name: {"target": self.targets[name], "run_id": str(tracker.run_id)} for name, tracker in every.items()
                if tracker.run_id is not None}

    def replay(self, records: Iterable[Mapping[str, Any]]) -> None:
        """At the start: the records already in ``metrics.jsonl`` (those up to the resumed step), for the trackers
        that lack them."""
        records = list(records)
        for name, tracker in list(self.trackers.items()):
            rows = [row for row in map(numbers, records) if row and row[0] > self.marks[name]]
            if rows:
                self.report(f"note: metric_loggers.{name}: sending steps {rows[0][0]}..{rows[-1][0]} from metrics.jsonl "
                            "(its run lacks them)")
                self._send(name, tracker, rows)

    def write(self, record: Mapping[str, Any]) -> None:
        row = numbers(record)
        if row is None:
            return
        for name, tracker in list(self.trackers.items()):
            if row[0] > self.marks[name] or (row[0] == self.marks[name] and name in self._live):
                self._send(name, tracker, [row])

    def _send(self, name: str, tracker, rows: list[tuple[int, dict[str, float]]]) -> None:
        first, last = rows[0][0], rows[-1][0]
        try:
            bounded(lambda: tracker.log(rows), self.timeouts[name], f"logging step {last}")
        except Exception as e:
            steps = f"step {last}" if first == last else f"steps {first}..{last}"
            self.drop(name, f"cannot log {steps} ({first_line(e)})")
            return
        self.marks[name] = last
        self._live.add(name)  # more numbers at the same step (val_loss beside loss) go on to this run

    def drop(self, name: str, why: str) -> None:
        """Go on without tracker ``name``: a warning line, no more calls to it."""
        tracker = self.trackers.pop(name)
        self.dropped[name] = tracker
        abandon(tracker)
        self.report(f"warning: metric_loggers.{name}: {why}; {GOES_ON}")

    def close(self, final_model: str | None = None) -> None:
        """Finish each tracker's run, with the final model's path (None: stopped before the end, to be resumed)."""
        if self.closed:
            return
        self.closed = True
        for name, tracker in self.trackers.items():
            try:
                bounded(lambda: tracker.finish(final_model), self.timeouts[name], "finishing its run")
            except Exception as e:  # the model is saved: a tracker's hiccup now is worth a line, not a failed run
                abandon(tracker)
                self.report(f"warning: metric_loggers.{name}: could not finish its run ({first_line(e)})")


def abandon(tracker) -> None:
    """Tell a dropped tracker that no more calls come (its ``abandon()``, if it has one; never a network call)."""
    try:
        getattr(tracker, "abandon", lambda: None)()
    except Exception:  # noqa: BLE001 - dropping it anyway
        pass


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
    trackers, targets, marks, timeouts = {}, {}, {}, {}
    try:
        for name, section in sections.items():
            section = dict(section)
            timeout_s = float(section.pop(TIMEOUT, None) or TIMEOUT_S)
            target = section["_target_"]
            where = f"metric_loggers.{name}"
            try:
                tracker = instantiate(section, _convert_="all")
            except Exception as e:
                raise CheckpointError(f"{where}: {first_line(e.__cause__ or e)}") from None
            tracker.timeout_s = timeout_s
            earlier = (saved or {}).get(name)
            run_id = earlier["run_id"] if earlier and earlier.get("target") == target else None
            if earlier and run_id is None:
                report(f"note: {where}: its _target_ changed ({earlier.get('target')} -> {target}); starting a new run")
            _flush()  # what the run printed so far (the load report) is seen while a tracker is waited for
            try:
                package = getattr(tracker, "requires", None)
                if package:  # imported here, not counted in timeout_s, which bounds the talking to its server
                    importlib.import_module(package[0])
                started = bounded(lambda: tracker.start(name=name, config=dict(config), run_id=run_id,
                                                        output_dir=output_dir, report=report), timeout_s, "starting its run")
                held = bounded(tracker.logged_through, timeout_s, "reading the step its run holds") \
                    if run_id is not None and started == run_id else 0
            except CheckpointError:
                raise
            except ModuleNotFoundError as e:
                if (e.name or "").split(".")[0] != getattr(tracker, "requires", ("",))[0]:
                    _went_wrong(tracker, where, e, report)
                    continue
                raise CheckpointError(needs_package(where, target)) from None
            except Exception as e:  # a server down or silent, a network outage: training goes on without it
                _went_wrong(tracker, where, e, report)
                continue
            trackers[name], targets[name], timeouts[name] = tracker, target, timeout_s
            if run_id is None or started != run_id:  # a new run holds nothing yet
                marks[name] = 0
                continue
            marks[name] = held if held is not None else resumed_step
            if marks[name] > resumed_step:
                report(f"note: {where}: steps {resumed_step + 1}..{marks[name]} were logged before the run stopped; "
                       "they are not sent again (the run keeps the values logged then)")
    except BaseException:
        for name, tracker in trackers.items():
            try:
                bounded(lambda: tracker.finish(None), timeouts[name], "finishing its run")
            except Exception:
                abandon(tracker)
        raise
    return Trackers(trackers, targets, marks, report, timeouts) if trackers else None


def _went_wrong(tracker, where: str, e: BaseException, report: Callable[[str], None]) -> None:
    abandon(tracker)
    report(f"warning: {where}: cannot start its run ({first_line(e)}); {GOES_ON}")


def _flush() -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


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
        timeout_s = section.get(TIMEOUT)
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not math.isfinite(timeout_s) or timeout_s <= 0):
            return f"{where}.{TIMEOUT}={timeout_s}: expected null or a number of seconds > 0 (default {TIMEOUT_S:g})"
        options = {k: v for k, v in section.items() if k not in ("_target_", TIMEOUT)}
        known = _parameters(target)
        for key in options:
            if known is not None and key not in known:
                near = difflib.get_close_matches(str(key), known + [TIMEOUT], n=1, cutoff=0.6)
                hint = f"did you mean {near[0]}? " if near else ""
                return f"{where}.{key}: no such option of {target.__name__} ({hint}it takes {', '.join(known + [TIMEOUT])})"
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
