"""Weights & Biases as a ``metric_loggers`` tracker (``pip install 'waypoint[wandb]'``; ``waypoint.run.trackers``).

    metric_loggers:
      wandb: {_target_: waypoint.run.tracker_wandb.WandbLogger, project: demo, entity: null, tags: [], mode: offline}

A run's W&B run: its name (null: output_dir's name), project (null: ``$WANDB_PROJECT``, else ``waypoint``), entity,
group, tags and notes from the config, the resolved config as the run's config, each record's numbers at its step
(``wandb.log(..., step=step)``), and the final model's path as ``final_model`` in the run's summary. ``mode``:
``online``, ``offline`` (no network: ``wandb sync`` uploads the run later) or ``disabled``; null: ``$WANDB_MODE``,
else online. ``dir``: where W&B keeps its files, its ``wandb/`` folder (null: ``$WANDB_DIR``, else the run's
``output_dir``, so that nothing lands in the current directory). W&B's own ``init_timeout`` and ``finish_timeout``
are the section's ``timeout_s`` (``waypoint.run.trackers``): a server that does not answer gives up the upload at the
end (the run's files keep it, for ``wandb sync``) rather than holding the process.

A resumed run continues its W&B run: ``wandb.init(id=..., resume="allow")`` with the id from the checkpoint, and
says which step the run holds (``waypoint.run.trackers`` sends only what comes after): online, the step W&B's server
has (``run.step``); offline, the last step in the run's offline files (``waypoint.run.wandb_files``), since a kill
loses what W&B's service had not yet written. Offline, each process writes its own ``offline-run-*-<id>``
directory under ``dir``, all of one W&B run, each step in one of them only; ``wandb sync`` uploads them (resume
offline where the earlier ones are: another machine's are not seen). An offline run's ``finish`` returns once its
file is written (W&B writes it after ``run.finish()`` returns), so that a run resumed in the same process reads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MODES = ("online", "offline", "disabled")
CLOSE_WAIT_S = 10.0  # the longest finish() waits for an offline run's file (written anyway at the latest at exit)


class WandbLogger:
    requires = ("wandb", "wandb")  # (import name, waypoint extra)

    def __init__(self, project: str | None = None, entity: str | None = None, name: str | None = None,
                 tags: list[str] | None = None, group: str | None = None, notes: str | None = None,
                 mode: str | None = None, dir: str | None = None) -> None:
        self.options = dict(project=project, entity=entity, name=name, tags=list(tags or []) or None, group=group,
                            notes=notes, mode=mode, dir=dir)
        self.run = None
        self.run_id: str | None = None
        self.abandoned = False  # dropped by the run (a call failed or timed out)

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> str | None:
        mode = options.get("mode")
        if mode is not None and mode not in MODES:
            return f"mode={mode}: expected null or one of {', '.join(MODES)}"
        tags = options.get("tags")
        if tags is not None and not (isinstance(tags, (list, tuple)) and all(isinstance(t, str) for t in tags)):
            return f"tags={tags}: expected a list of strings"
        for key in ("project", "entity", "name", "group", "notes", "dir"):
            value = options.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                return f"{key}={value}: expected null or a non-empty string"
        return None

    def start(self, name: str, config: Mapping[str, Any], run_id: str | None, output_dir: Path,
              report: Callable[[str], None]) -> str:
        import wandb

        options = {k: v for k, v in self.options.items() if v is not None}
        options.setdefault("name", Path(output_dir).resolve().name)
        options.setdefault("project", os.environ.get("WANDB_PROJECT") or "waypoint")
        for key in ("mode", "dir", "entity"):  # the environment as it is now (W&B reads it once a process)
            if key not in options and os.environ.get(f"WANDB_{key.upper()}"):
                options[key] = os.environ[f"WANDB_{key.upper()}"]
        options.setdefault("dir", str(Path(output_dir).resolve()))  # not ./wandb: the current directory is the user's
        Path(options["dir"]).mkdir(parents=True, exist_ok=True)
        timeout_s = getattr(self, "timeout_s", None)
        settings = wandb.Settings(init_timeout=timeout_s, finish_timeout=timeout_s) if timeout_s else None
        # create_new: a run already active in this process (the user's own, or one of ours dropped earlier, which W&B
        # finishes only at exit) is not handed back as ours; W&B's default returns it, and our steps would go there
        run = wandb.init(id=run_id, resume="allow", config=dict(config), settings=settings, reinit="create_new", **options)
        if self.abandoned:  # given up on while W&B started: no run of ours to keep open
            run.finish()
            return ""
        self.run, self.run_id = run, run.id
        return self.run_id

    def logged_through(self) -> int | None:
        """The last step the run holds: online, as W&B's server has it; offline, as its earlier offline files do
        (this process's own directory aside); disabled: None."""
        if self.run is None or getattr(self.run, "disabled", False):
            return None
        if self.run.offline:
            from waypoint.run.wandb_files import last_offline_step

            own = Path(self.run.dir).parent  # <dir>/wandb/offline-run-<time>-<id>
            return last_offline_step(own.parent, self.run_id, skip=own)
        return max(int(self.run.step) - 1, 0) if self.run.resumed else 0

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            self.run.log(values, step=step)

    def abandon(self) -> None:
        """Dropped: no more calls. W&B finishes the run at exit itself, bounded by ``finish_timeout``."""
        self.abandoned = True

    def finish(self, final_model: str | None) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        if final_model is not None:
            run.summary["final_model"] = final_model
        else:  # stopped to be resumed: W&B shows it as preempted, not crashed
            mark = getattr(run, "mark_preempting", None)
            if mark is not None:
                mark()
        offline = run.offline and not getattr(run, "disabled", False)
        sync_file = run.settings.sync_file
        run.finish()
        if offline:  # finish() returns before W&B's service writes the file: a run resumed in this process reads it
            from waypoint.run.wandb_files import wait_closed

            wait_closed(sync_file, CLOSE_WAIT_S)
