"""Evaluate a checkpoint with lm-evaluation-harness: task names or local task files, lm-eval's table, a JSON file.

    python recipes/eval.py --config configs/eval.yaml checkpoint_dir=outputs/tiny/step_300 tasks=[tiny_choice]
    python recipes/eval.py --config configs/eval.yaml checkpoint_dir=BASE adapter_dir=outputs/run/step_N tasks=[hellaswag]

``checkpoint_dir`` is any checkpoint the checkpointers read (HF, Meta, native; a run's ``step_N`` or its ``merged/``;
a torchrun run's sharded step; on disk or an object-store URL), ``adapter_dir`` a PEFT LoRA adapter merged onto it
for the evaluation (``pip install 'waypoint[eval]'`` brings lm-eval). The model runs through lm-eval's model class
``waypoint`` (``waypoint.evaluation.harness_lm``), whose loglikelihoods, rolling loglikelihoods and greedy
generations are those of lm-eval's own ``hf`` backend on the same checkpoint.

``tasks`` are lm-eval's names (a task, group or tag; a glob such as ``mmlu_*``), names of tasks in the folders of
``include_path`` (the shipped assets/eval_tasks: tiny_choice, tiny_generate, tiny_wikitext), or task YAML files.
lm-eval's own tasks read their datasets from the hub (or its cache) as lm-eval does.

The results are printed as lm-eval's table and written as lm-eval's results JSON to ``output``, or, without one, to
``eval_results.json`` in the adapter's (else the checkpoint's) directory; a name that is taken is never written
over: ``eval_results_2.json``, ``_3`` ... (an ``output`` that exists is refused). A checkpoint read from a URL or
the hub cache has its results in the current directory.

What is refused, in one ``error:`` line, before the weights are read: lm-eval not installed, an unknown task name
(with the nearest ones), a task file or ``include_path`` that does not exist, an ``output`` that exists, a step or
adapter failing its ``MANIFEST.json``, and every option out of range; an adapter whose tensors do not fit the base
is refused, naming the tensor, once the base is read.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

if importlib.util.find_spec("waypoint") is None:  # a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from waypoint.cli.command import run_command  # noqa: E402
from waypoint.cli.config import parse_config  # noqa: E402
from waypoint.cli.option_checks import EVAL  # noqa: E402
from waypoint.errors import CheckpointError  # noqa: E402

INSTALL = "pip install 'waypoint[eval]'"


class QuietCustomDatasets(logging.Filter):
    """Drops lm-eval's note, on every task with a ``custom_dataset`` (the shipped local tasks), about passing
    kwargs through --metadata, which this recipe has no use for."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def require_lm_eval() -> None:
    """lm-eval importable, or one line saying how to install it."""
    try:
        for module in ("lm_eval", "lm_eval.api.task"):  # lm_eval, and what it needs of its dependencies
            importlib.import_module(module)
    except ImportError as e:
        raise CheckpointError(f"lm-evaluation-harness (lm_eval) is not installed ({e.name or e}): {INSTALL}") from None


CHECKS = EVAL  # the options this recipe's config must get right (`waypoint validate` checks them too)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv, description=__doc__.splitlines()[0], example="configs/eval.yaml", checks=CHECKS)

    def run() -> int:
        require_lm_eval()
        import yaml
        from lm_eval import simple_evaluate
        from lm_eval.utils import make_table

        from waypoint.evaluation.harness_lm import WaypointLM
        from waypoint.evaluation.results import results_path, write_results
        from waypoint.evaluation.tasks import resolve, yaml_problem

        logging.getLogger("lm_eval.api.task").addFilter(QuietCustomDatasets())
        manager, tasks = resolve(cfg.tasks, cfg.get("include_path"))
        path = results_path(cfg.get("output"), cfg.get("adapter_dir") or cfg.checkpoint_dir)
        lm = WaypointLM.from_checkpoint(cfg.checkpoint_dir, cfg.get("adapter_dir"), cfg.device, cfg.dtype,
                                        max_length=cfg.get("max_length"), batch_size=cfg.batch_size,
                                        max_gen_toks=cfg.max_gen_toks, add_bos_token=cfg.get("add_bos_token"),
                                        seed=cfg.seed)
        try:
            results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, num_fewshot=cfg.get("num_fewshot"),
                                      limit=cfg.get("limit"), bootstrap_iters=cfg.bootstrap_iters, log_samples=False,
                                      batch_size=cfg.batch_size, device=cfg.device,  # recorded in the results' config
                                      random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
                                      fewshot_random_seed=cfg.seed)
        except yaml.YAMLError as e:  # a file a task includes (the files given were checked before the model was read)
            raise CheckpointError(yaml_problem(e)) from None
        print(make_table(results))
        if results.get("groups"):
            print(make_table(results, "groups"))
        written = write_results(results, path, explicit=bool(cfg.get("output")))
        print(f"results: {written}", file=sys.stderr)
        return 0
    return run_command(run, also=(ValueError,))


if __name__ == "__main__":
    sys.exit(main())
