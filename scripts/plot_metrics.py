"""Plot a training run's metrics.jsonl (or compare several runs) into one PNG.

    python scripts/plot_metrics.py OUTPUT_DIR [OUTPUT_DIR ...] [--out plot.png] [--smooth 0.9]

Panels against the optimizer step: the training loss (raw, light, and smoothed by an exponential moving average
debiased as TensorBoard's is; ``--smooth 0`` turns it off) with the validation loss as markers when the log has
any, the learning rate, the throughput (tokens/s), the gradient norm (before clipping), and the MoE auxiliary
loss and a preference run's reward accuracy and margin (TRL's ``rewards/accuracies``, ``rewards/margins``) when
present. An online RL run (its records have ``reward``: recipes/grpo_finetune.py) shows what learning moves instead:
the mean reward, smoothed, in the large panel with ``val_reward`` as markers, then ``reward_std``,
``frac_reward_zero_std`` (the share of groups whose completions all scored the same: they teach nothing), the
completions' mean length, ``kl`` when logged, and the loss in a small panel (near 0 on-policy by construction).
A share is drawn on a 0-1 axis; any other axis spans at least a fifth of its series' magnitude
(``waypoint.run.metric_panels``), so a flat series reads as flat, not as a jump in its last digits. Several
OUTPUT_DIRs are a comparison: one colour per run, named by its directory in the legend, on the same axes. The PNG
goes to ``OUTPUT_DIR/metrics.png`` for one run; ``--out`` names it (required for several). Its path is printed. An
argument may also name the .jsonl file itself.

A resumed run appends to the log of the run it continues. Where a resumed run began is marked by a thin vertical
line labelled "resumed", found from the records: the step sequence repeating or restarting (a log written without
cutting the lines past the resumed step), a gap in it or a log that starts past step 1 (resumed from a checkpoint
of another run), or a record carrying ``"resumed": true``. A resume at the very step the run stopped, in a log
that MetricsLog cut back to the checkpoint (what the recipes write), leaves records that read like an
uninterrupted run, so it is not marked.

Lines that are not a step record (not JSON, no integer ``step``, none of ``loss``, ``val_loss`` and ``val_reward``)
are skipped with a note; an unreadable last line without its newline (a run still writing it) is skipped silently.
Where a step appears twice, its last record counts (the resumed run's).

Needs matplotlib (``pip install 'waypoint[plot]'``); it draws with the non-interactive Agg backend.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect);
# a checkout that is not installed puts its root there instead, for the `waypoint` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataclasses import dataclass, field  # noqa: E402 (imports inspect: only once this folder is off the path)

from waypoint.errors import CheckpointError  # noqa: E402
from waypoint.cli.command import OneLineParser, run_command  # noqa: E402
from waypoint.run.metric_panels import PANELS, RL_PANELS, Panel, y_limits  # noqa: E402

METRICS_FILE = "metrics.jsonl"
TRAIN_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "aux_loss", "rewards/accuracies", "rewards/margins", "reward",
                "reward_std", "frac_reward_zero_std", "kl", "completions/mean_length")
NAN = float("nan")


class PlotError(CheckpointError):
    """Input this script cannot plot; reported in one ``error:`` line by ``run_command``."""


@dataclass
class Run:
    """One run's log, ready to plot: per-step series (NaN where a record lacks the field), sorted by step."""

    name: str
    path: Path
    steps: list[int] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=dict)  # TRAIN_FIELDS -> values aligned with steps
    smoothed: list[float] = field(default_factory=list)  # ema(series["loss"])
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_reward_steps: list[int] = field(default_factory=list)  # online RL's held-out reward
    val_reward: list[float] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)  # the first step each resumed segment wrote
    skipped: int = 0  # lines that are not step records

    def has(self, key: str) -> bool:
        return any(math.isfinite(v) for v in self.series.get(key, []))


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average debiased by ``1 - weight**n`` (n: the values taken in
    so far), so the start is not pulled towards zero. A non-finite value gives NaN and leaves the average as it was."""
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(NAN)
            continue
        last = last * weight + (1 - weight) * v
        n += 1
        out.append(last / (1 - weight ** n) if weight > 0 else v)
    return out


def _number(value) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return NAN


def metrics_path(arg: str | Path) -> Path:
    path = Path(arg)
    return path if path.suffix == ".jsonl" or path.is_file() else path / METRICS_FILE


def read_run(arg: str | Path, smooth: float = 0.9, name: str | None = None) -> Run:
    """Read one metrics.jsonl (``arg``: an output_dir or the file) into a :class:`Run`."""
    path = metrics_path(arg)
    run = Run(name=name or path.parent.name or str(path.parent), path=path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PlotError(f"{path}: no such file (is {path.parent} a training run's output_dir?)") from None
    except OSError as e:
        raise PlotError(f"{path}: cannot read ({e.strerror or e})") from None
    lines = data.splitlines(keepends=True)
    train: dict[int, dict] = {}  # step -> record, the last one written for it
    val: dict[int, float] = {}
    val_reward: dict[int, float] = {}
    prev = None  # the step of the previous training record, in file order
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            if not (i == len(lines) - 1 and not line.endswith(b"\n")):  # not a torn last line
                run.skipped += 1
            continue
        is_train, val_loss = "loss" in record, _number(record.get("val_loss"))
        if not is_train and "val_loss" not in record and "val_reward" not in record:
            run.skipped += 1
            continue
        if "val_loss" in record:
            val[step] = val_loss
        if "val_reward" in record:
            val_reward[step] = _number(record["val_reward"])
        if is_train:
            if (prev is None and step > 1) or (prev is not None and step != prev + 1) or record.get("resumed") is True:
                run.resumes.append(step)
            train[step] = record
            prev = step
    if not train and not val and not val_reward:
        if run.skipped:
            raise PlotError(f"{path}: no step records ({run.skipped} unreadable line{'s' * (run.skipped != 1)})")
        raise PlotError(f"{path}: empty (no step has been logged yet)")
    run.steps = sorted(train)
    run.series = {key: [_number(train[s].get(key)) for s in run.steps] for key in TRAIN_FIELDS}
    run.smoothed = ema(run.series["loss"], smooth)
    run.val_steps = sorted(val)
    run.val_loss = [val[s] for s in run.val_steps]
    run.val_reward_steps = sorted(val_reward)
    run.val_reward = [val_reward[s] for s in run.val_reward_steps]
    run.resumes = sorted(set(run.resumes))
    return run


def run_names(paths: list[Path]) -> list[str]:
    """Each run's directory name, or as many trailing path parts as it takes to tell runs apart."""
    dirs = [p.resolve().parent for p in paths]
    for depth in range(1, max(len(d.parts) for d in dirs) + 1):
        names = ["/".join(d.parts[-depth:]) for d in dirs]
        if len(set(names)) == len(names) or len(set(dirs)) < len(dirs):
            return names
    return [str(d) for d in dirs]


def read_runs(args: list[str | Path], smooth: float = 0.9, report=None) -> list[Run]:
    """Every run's :class:`Run`, named for the legend; ``report`` gets a one-line note per file with skipped lines."""
    names = run_names([metrics_path(a) for a in args])
    runs = [read_run(a, smooth, name) for a, name in zip(args, names)]
    for run in runs:
        if run.skipped and report:
            report(f"note: {run.path}: skipped {run.skipped} line{'s' * (run.skipped != 1)} that "
                   f"{'are not step records' if run.skipped != 1 else 'is not a step record'}")
    return runs


def load_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        reason = "not installed" if (e.name or "").split(".")[0] == "matplotlib" else f"cannot be imported ({e})"
        raise PlotError(f"matplotlib is {reason}: pip install 'waypoint[plot]'") from None
    return plt


def broken(steps: list[int], values: list[float]) -> tuple[list[float], list[float]]:
    """``steps, values`` with a NaN where steps are missing, so the line breaks there instead of bridging the gap."""
    xs, ys = [], []
    for i, (step, value) in enumerate(zip(steps, values)):
        if i and step > steps[i - 1] + 1:
            xs.append(step - 0.5)
            ys.append(NAN)
        xs.append(step)
        ys.append(value)
    return xs, ys


def plot(runs: list[Run], out: Path, smooth: float) -> Path:
    """Draw ``runs`` into the PNG ``out``: the loss on top, or an online RL run's reward (a run with ``reward``)."""
    plt = load_pyplot()
    from matplotlib.lines import Line2D

    rl = any(run.has("reward") for run in runs)
    head = "reward" if rl else "loss"  # the large panel's series
    panels = [p for p in (RL_PANELS if rl else PANELS) if any(run.has(p.key) for run in runs)]
    rows = 1 + (len(panels) + 1) // 2
    fig = plt.figure(figsize=(13, 3.6 + 2.7 * (rows - 1)), dpi=110)
    grid = fig.add_gridspec(rows, 2, height_ratios=[1.5] + [1] * (rows - 1))
    head_ax = fig.add_subplot(grid[0, :])
    axes = {}
    for i, panel in enumerate(panels):
        row, col = 1 + i // 2, i % 2
        span = slice(0, 2) if i == len(panels) - 1 and len(panels) % 2 else col
        axes[panel.key] = fig.add_subplot(grid[row, span], sharex=head_ax)

    several = len(runs) > 1
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    val = [(run.val_reward_steps, run.val_reward) if rl else (run.val_steps, run.val_loss) for run in runs]
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        values = run.series[head]
        if smooth > 0:
            head_ax.plot(*broken(run.steps, values), color=colour, alpha=0.25, linewidth=0.9)
            head_ax.plot(*broken(run.steps, run.smoothed if head == "loss" else ema(values, smooth)), color=colour,
                         linewidth=1.8)
        else:
            head_ax.plot(*broken(run.steps, values), color=colour, linewidth=1.4)
        if val[i][0]:
            head_ax.plot(*val[i], color=colour, marker="o", markersize=5, linestyle=":",
                         linewidth=1, markeredgecolor="black", markeredgewidth=0.6)
        for key, ax in axes.items():
            if run.has(key):
                ax.plot(*broken(run.steps, run.series[key]), color=colour, linewidth=1.2)
        for step in run.resumes:
            for ax in [head_ax, *axes.values()]:
                ax.axvline(step - 0.5, color=colour if several else "0.35", linewidth=0.8, linestyle="--", alpha=0.8)
            head_ax.annotate("resumed" + (f" ({run.name})" if several else ""), xy=(step - 0.5, 1),
                             xycoords=("data", "axes fraction"), xytext=(3, -4), textcoords="offset points",
                             rotation=90, va="top", ha="left", fontsize=8, color=colour if several else "0.25")

    head_values = [v for run, (_, held_out) in zip(runs, val) for v in run.series[head] + held_out]
    finite = [v for v in head_values if math.isfinite(v)]
    if head == "loss" and finite and min(finite) > 0 and max(finite) / min(finite) >= 4:
        head_ax.set_yscale("log")
    elif limits := y_limits(head_values, Panel(head, head, head)):
        head_ax.set_ylim(*limits)
    what = "mean reward of the step's completions" if rl else "loss"
    head_ax.set_title(what + (f" (smoothed: debiased EMA, weight {smooth:g})" if smooth > 0 else ""))
    head_ax.set_ylabel(head)
    head_ax.set_xlabel("step")
    # the line styles' swatches: in the run's colour for one run; for several (a colour each, named above), neutral
    grey = "0.3" if several else colours[0]
    handles = [Line2D([], [], color=colours[i % len(colours)], linewidth=2.5, label=run.name)
               for i, run in enumerate(runs)] if several else []
    series = "reward" if rl else "training loss"
    if smooth > 0:
        handles += [Line2D([], [], color=grey, alpha=0.3, label=series),
                    Line2D([], [], color=grey, linewidth=1.8, label=f"{series}, smoothed")]
    else:
        handles += [Line2D([], [], color=grey, label=series)]
    if any(steps for steps, _ in val):
        handles.append(Line2D([], [], color=grey, marker="o", linestyle=":", markeredgecolor="black",
                              label="val_reward (held-out prompts)" if rl else "validation loss"))
    head_ax.legend(handles=handles, loc="lower right" if rl else "upper right", fontsize=9, framealpha=0.85)
    for panel in panels:
        ax = axes[panel.key]
        ax.set_title(panel.title)
        ax.set_ylabel(panel.ylabel)
        ax.set_xlabel("step")
        if panel.key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if limits := y_limits([v for run in runs for v in run.series[panel.key]], panel):
            ax.set_ylim(*limits)
    for ax in [head_ax, *axes.values()]:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{runs[0].name}: {runs[0].path.name}" if not several else f"{len(runs)} runs compared",
                 fontsize=13)
    fig.tight_layout()
    try:
        fig.savefig(out, format="png")
    except OSError as e:
        raise PlotError(f"{out}: cannot write ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out


def smoothing(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 0 and below 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser.for_script(__doc__)
    parser.add_argument("runs", nargs="+", metavar="OUTPUT_DIR", help="a training run's output_dir (or its metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="the PNG to write (default: OUTPUT_DIR/metrics.png; required for several)")
    parser.add_argument("--smooth", type=smoothing, default=0.9,
                        help="weight of the loss's exponential moving average, 0 <= w < 1 (default 0.9; 0: none)")
    args = parser.parse_args(argv)
    if len(args.runs) > 1 and args.out is None:
        parser.error("several runs: name the PNG with --out")

    def run() -> int:
        load_pyplot()  # a missing matplotlib is reported before anything is read
        runs = read_runs(args.runs, args.smooth, report=lambda line: print(line, file=sys.stderr))
        out = args.out or runs[0].path.parent / "metrics.png"
        print(plot(runs, out, args.smooth))
        return 0
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
