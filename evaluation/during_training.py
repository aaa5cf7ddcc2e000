"""``eval: {tasks: [...], every_n_steps: N}`` in a training config: lm-evaluation-harness tasks run on the model as it
trains, every ``N`` optimizer steps and after the last, their scores logged as any other record (``metrics.jsonl``,
TensorBoard, every experiment tracker) under ``eval/<task>/<metric>`` at the step.

The model is evaluated where it is (eval mode, no gradients; a LoRA model with its adapters on) through the same
``WaypointLM`` that ``recipes/eval.py`` uses, so the scores are those ``recipes/eval.py`` gives on the step's
checkpoint. The random states (Python's, NumPy's, torch's) are put back afterwards, so a run that evaluates trains
bit for bit as one that does not, and resumes as exactly. One process only: under torchrun every rank holds a shard
of the model, and evaluating a step's checkpoint with ``recipes/eval.py`` is the way. Tasks are resolved at start,
so an unknown one is a one-line error before the first step.

Only the scores are kept, so lm-eval's description of the environment for its results file (``add_env_info``:
torch's ``collect_env``, which runs ``pip list``, ``nvidia-smi`` and more in subprocesses; 1.3 s each time on a
CPU machine, 4 s the first) is not gathered at each evaluation; ``recipes/eval.py`` writes it as lm-eval does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
from dataclasses import dataclass

import torch

from waypoint.errors import CheckpointError

PREFIX = "eval/"


@dataclass
class TrainingEval:
    manager: object  # lm-eval's TaskManager, knowing every task asked for
    tasks: list[str]
    every_n_steps: int
    limit: int | float | None = None
    max_length: int | None = None
    max_gen_toks: int = 256

    @classmethod
    def from_config(cls, section, world_size: int) -> TrainingEval | None:
        """The config's ``eval`` section (None or empty: no evaluation while training)."""
        if not section:
            return None
        if world_size > 1:
            raise CheckpointError("eval: evaluating while training is single-process; under torchrun set eval=null and "
                                  "run recipes/eval.py on a step (checkpoint_dir=OUTPUT_DIR/step_N)")
        if importlib.util.find_spec("lm_eval") is None:
            raise CheckpointError("eval: needs lm-evaluation-harness (pip install 'waypoint[eval]'), or set eval=null")
        from waypoint.evaluation.tasks import resolve

        manager, tasks = resolve(section["tasks"], section.get("include_path"))
        return cls(manager, tasks, int(section["every_n_steps"]), section.get("limit"), section.get("max_length"),
                   int(section.get("max_gen_toks") or 256))

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.every_n_steps == 0 or step == total_steps

    def run(self, model: torch.nn.Module, tokenizer) -> dict[str, float]:
        """The tasks' scores on ``model`` now, ``{"eval/<task>/<metric>": value}``; the model and the random states
        as they were."""
        from lm_eval import simple_evaluate

        from waypoint.evaluation.harness_lm import WaypointLM

        states = random.getstate(), _numpy_state(), torch.get_rng_state(), _cuda_states()
        training = model.training
        try:
            with torch.no_grad(), _without_env_info():
                lm = WaypointLM(model, tokenizer, max_length=self.max_length, max_gen_toks=self.max_gen_toks)
                results = simple_evaluate(model=lm, tasks=self.tasks, task_manager=self.manager, limit=self.limit,
                                          bootstrap_iters=0, log_samples=False)
        finally:
            model.train(training)
            random.setstate(states[0])
            _set_numpy_state(states[1])
            torch.set_rng_state(states[2])
            if states[3] is not None:
                torch.cuda.set_rng_state_all(states[3])
        return scores(results)


@contextlib.contextmanager
def _without_env_info():
    """lm-eval's ``simple_evaluate`` without its ``add_env_info`` (the module doc), where lm-eval has that step."""
    from lm_eval import evaluator

    if not callable(getattr(evaluator, "add_env_info", None)):
        yield
        return
    gather = evaluator.add_env_info
    evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        evaluator.add_env_info = gather


def scores(results: dict) -> dict[str, float]:
    """lm-eval's results as ``{"eval/<task>/<metric>": value}``: each of a task's metrics (its ``higher_is_better``
    names: not the standard errors, not the sample counts)."""
    found = {}
    for task, metrics in (results.get("results") or {}).items():
        names = set((results.get("higher_is_better") or {}).get(task) or ())
        for key, value in metrics.items():
            metric = key.split(",")[0]
            if metric in names and isinstance(value, (int, float)) and not isinstance(value, bool):
                found[f"{PREFIX}{task}/{metric}"] = float(value)
    return found


def _cuda_states():
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _numpy_state():
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


def _set_numpy_state(state) -> None:
    if state is not None:
        import numpy

        numpy.random.set_state(state)


__all__ = ["TrainingEval", "scores"]
