"""A training run's progress on the console: a bar on a terminal, a plain line every few steps in a log.

``progress`` (``waypoint.console``: auto | bar | lines | off) chooses; ``progress_every_n_steps`` spaces the lines
(the last step always gets one, and so does a step the recipe marks ``always``: one with a held-out figure). A line
reads

    train step 40/300 (13%): loss 2.3456, lr 2.91e-03, tok_s 10234, 0:00:05 elapsed, 0:00:33 left

A recipe may give a ``note`` to print once, before the first line (or above the bar): how to read the figures.

Only the console changes: every step's record still goes to ``metrics.jsonl`` and the trackers.
"""

from __future__ import annotations

import time
from datetime import timedelta

from tqdm import tqdm

from waypoint.console import bar, progress_style


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class TrainingProgress:
    """``update(step, loss=..., lr=...)`` once per optimizer step (values already formatted), ``close()`` at the end;
    messages go through ``tqdm.write``, which keeps a bar whole. ``shown=False`` (ranks other than 0): nothing."""

    def __init__(self, total: int, initial: int, every_n_steps: int = 10, shown: bool = True, desc: str = "train",
                 note: str | None = None):
        self.style = progress_style() if shown else "off"
        self.total, self.every, self.desc, self.note = total, every_n_steps, desc, note
        self.initial, self.started = initial, time.perf_counter()
        self.bar = bar(total=total, initial=initial, desc=desc, dynamic_ncols=True, disable=self.style != "bar")

    def update(self, step: int, always: bool = False, **shown: str) -> None:
        """``always``: this step gets its line whatever ``every_n_steps`` says (a step with a held-out figure)."""
        if self.style == "off":
            return
        line_due = self.style == "lines" and (always or step % self.every == 0 or step == self.total)
        if self.note and (self.style == "bar" or line_due):
            tqdm.write(self.note)
            self.note = None
        if self.style == "bar":
            self.bar.set_postfix(**shown)
            self.bar.update()
        elif line_due:
            elapsed = time.perf_counter() - self.started
            left = elapsed / (step - self.initial) * (self.total - step)
            values = ", ".join(f"{key} {value}" for key, value in shown.items())
            print(f"{self.desc} step {step}/{self.total} ({step / self.total:.0%}): {values}, "
                  f"{_clock(elapsed)} elapsed, {_clock(left)} left", flush=True)

    def close(self) -> None:
        self.bar.close()
