"""Every numeric and enum option checked before anything is read or written: one line naming the key,
the value and what it should be.

A table: dotted key -> (required, check). A check returns None when the value is fine, or what was
expected (``"an integer >= 1"``). Options the table does not name belong to instantiated objects
(``optimizer.betas``, ``dataset.template``...), whose own errors name them.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from waypoint.checkpointers.quantization import OUTPUT_QUANTIZATION
from waypoint.console import STYLES as PROGRESS_STYLES
from waypoint.errors import CheckpointError
from waypoint.models.dtypes import DTYPE_NAMES
from waypoint.models.nf4 import QUANTIZE_BASE
from waypoint.run.object_store import url_scheme
from waypoint.run.trackers import tracker_problem
from waypoint.training.preference_loss import LOSS_TYPES

Check = Callable[[Any], "str | None"]


class Problem(str):
    """What a check returns as the whole line, where it names a key below the table's own (a section of sections:
    ``metric_loggers.wandb.projekt: no such option ...``)."""


def metric_loggers(v) -> str | None:
    problem = tracker_problem(v)
    return None if problem is None else Problem(problem)


TRAINING_EVAL_KEYS = {"tasks", "every_n_steps", "include_path", "limit", "max_length", "max_gen_toks"}


def training_eval(v) -> str | None:
    """``eval``: null, or lm-eval tasks scored while training (``waypoint.evaluation.during_training``)."""
    expected = "null or a section {tasks: [...], every_n_steps: N} (limit, include_path, max_length, max_gen_toks optional)"
    if v is None:
        return None
    if not isinstance(v, Mapping) or not v.get("tasks") or not isinstance(v.get("tasks"), (str, list)):
        return expected
    unknown = sorted(set(v) - TRAINING_EVAL_KEYS)
    if unknown:
        return Problem(f"eval.{unknown[0]}: no such option of eval (its options: {', '.join(sorted(TRAINING_EVAL_KEYS))})")
    steps = v.get("every_n_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        return Problem(f"eval.every_n_steps={steps}: expected an integer >= 1")
    return None


def integer(minimum: int) -> Check:
    def check(v):
        return None if isinstance(v, int) and not isinstance(v, bool) and v >= minimum else f"an integer >= {minimum}"
    return check


def number(minimum: float, inclusive: bool = True, below: float | None = None, at_most: float | None = None) -> Check:
    """A finite number in the range: inf and nan (Hydra reads ``key=inf``, ``key=nan`` as floats) are never an
    option's value; a run given one would only stop at its first step with a nan loss."""
    def check(v):
        real = isinstance(v, (int, float)) and not isinstance(v, bool)
        fits = real and math.isfinite(v) and (v >= minimum if inclusive else v > minimum)
        if fits and (below is None or v < below) and (at_most is None or v <= at_most):
            return None
        upper = f" and < {below}" if below is not None else f" and <= {at_most}" if at_most is not None else ""
        finite = "finite " if real and not math.isfinite(v) else ""
        return f"a {finite}number {'>=' if inclusive else '>'} {minimum}{upper}"
    return check


def optional(check: Check) -> Check:
    def optional_check(v):
        return None if v is None else (None if check(v) is None else f"null or {check(v)}")
    return optional_check


def one_of(*choices: str) -> Check:
    def check(v):
        return None if isinstance(v, str) and v in choices else f"one of {', '.join(choices)}"
    return check


def boolean(v) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def resume(v) -> str | None:
    return None if isinstance(v, bool) or (isinstance(v, str) and v) else "auto, true, false or the path of a step_N checkpoint"


def signals(v) -> str | None:
    names = v if isinstance(v, (list, tuple)) else None
    if names is not None and all(isinstance(n, str) and isinstance(getattr(signal, n, None), signal.Signals) for n in names):
        return None
    return "a list of signal names such as [SIGTERM, SIGUSR1]"


def device(v) -> str | None:
    import torch

    try:
        dev = torch.device(v) if isinstance(v, str) else None
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        return "cpu, cuda or cuda:N"
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            return "cpu (this machine has no CUDA device)"
        if dev.index is not None and dev.index >= count:
            return f"cuda:0 .. cuda:{count - 1} (this machine has {count} CUDA device{'s' if count > 1 else ''}) or cpu"
    return None


def output_dir(v) -> str | None:
    """A local directory or an object-store URL (any scheme, in any case: ``S3://`` is ``s3://``); a ``file://`` URL
    would become a local folder named ``file:``, and the hub (``hf://``) is where inputs come from."""
    if not isinstance(v, str) or not v or url_scheme(v) == "hf":
        return "a local directory or an object-store URL such as s3://bucket/prefix"
    return "a local path without file:// (or an object-store URL such as s3://bucket/prefix)" if url_scheme(v) == "file" else None


def local_directory(what: str) -> Check:
    """A local directory (a URL, which the writer would make into a folder named after its scheme, is refused)."""
    def check(v):
        return None if isinstance(v, str) and v and url_scheme(v) is None else f"a local directory for {what}, not a URL"
    return check


def strings(v) -> str | None:
    return None if isinstance(v, (list, tuple)) and v and all(isinstance(s, str) for s in v) else "a non-empty list of names"


DTYPES = one_of(*DTYPE_NAMES)

COMMON: dict[str, tuple[bool, Check]] = {
    "output_dir": (True, output_dir),
    "resume": (True, resume),
    "overwrite": (True, boolean),
    "seed": (True, integer(0)),
    "device": (True, device),
    "dtype": (True, DTYPES),
    "output_dtype": (False, optional(DTYPES)),
    "checkpointer.output_quantization": (False, optional(one_of(*OUTPUT_QUANTIZATION))),
    "strict": (True, boolean),
    "epochs": (True, integer(1)),
    "max_steps_per_epoch": (True, optional(integer(1))),
    "batch_size": (True, integer(1)),
    "gradient_accumulation_steps": (True, integer(1)),
    "clip_grad_norm": (True, optional(number(0, inclusive=False))),
    "enable_activation_checkpointing": (True, boolean),
    "save_every_n_steps": (True, optional(integer(1))),
    "save_every_epoch": (True, boolean),
    "keep_last_n_checkpoints": (True, optional(integer(1))),
    "preemption_signals": (True, signals),
    "requeue": (True, boolean),
    "async_checkpoint": (False, boolean),
    "verify_export": (False, boolean),
    "fused_loss": (False, boolean),
    "on_nonfinite": (False, one_of("stop", "skip_step")),
    "optimizer.lr": (False, number(0)),
    "optimizer.weight_decay": (False, number(0)),
    "lr_scheduler.num_warmup_steps": (False, integer(0)),
    "dataset.max_seq_len": (False, integer(1)),
    "packed": (False, boolean),
    "freeze_vision": (False, boolean),
    "log_dir": (False, optional(local_directory("TensorBoard event files"))),
    "progress": (False, one_of(*PROGRESS_STYLES)),
    "progress_every_n_steps": (False, integer(1)),
    "metric_loggers": (False, metric_loggers),
    "eval": (False, training_eval),
    "quantize_base": (False, lambda v: None if v is None else "null (a 4-bit base is frozen: QLoRA is recipes/lora_finetune.py)"),
    "validation": (False, lambda v: None if v is None or isinstance(v, Mapping) else "a section {source or fraction, every_n_steps}"),
    **{key: (True, lambda v: None if isinstance(v, Mapping) and v.get("_target_") else "a section with a _target_")
       for key in ("checkpointer", "model", "tokenizer", "dataset", "optimizer", "lr_scheduler")},
}

LORA: dict[str, tuple[bool, Check]] = {
    "lora.targets": (True, strings),
    "lora.rank": (True, integer(1)),
    "lora.alpha": (True, number(0, inclusive=False)),
    "lora.dropout": (True, number(0, below=1)),
    "max_lora_rank": (False, integer(1)),
    "save_merged": (False, one_of("final", "every", "never")),
    "save_adapter_weights_only": (False, boolean),
    "quantize_base": (False, optional(one_of(*QUANTIZE_BASE))),
    "nf4.block_size": (False, lambda v: None if integer(2)(v) is None and v % 2 == 0 else "an even integer >= 2"),
    "nf4.scaler_block_size": (False, integer(1)),
    "nf4.output": (False, boolean),
}

def preference_loss(v) -> str | None:
    """``loss``: what its keys allow together (each key's range is checked on its own): label smoothing belongs to the
    sigmoid and simpo losses only (TRL ignores it for the others, with a warning)."""
    if not isinstance(v, Mapping):
        return "a section {type, beta, label_smoothing, gamma}"
    smoothing, kind = v.get("label_smoothing"), v.get("type")
    if isinstance(smoothing, (int, float)) and smoothing and kind in LOSS_TYPES and kind not in ("sigmoid", "simpo"):
        return Problem(f"loss.label_smoothing applies to the sigmoid and simpo losses, not {kind}; set loss.label_smoothing=0")
    return None


# recipes/dpo_finetune.py, beside COMMON (and LORA when it has a lora section)
PREFERENCE: dict[str, tuple[bool, Check]] = {
    "loss": (True, preference_loss),
    "loss.type": (True, one_of(*LOSS_TYPES)),
    "loss.beta": (True, number(0, inclusive=False)),
    "loss.label_smoothing": (False, number(0, below=0.5)),
    "loss.gamma": (False, number(0)),
    "dataset.max_length": (True, integer(2)),
    "dataset.max_prompt_length": (False, optional(integer(1))),
    "reference_batch_size": (False, optional(integer(1))),
    "lora": (False, lambda v: None if v is None or isinstance(v, Mapping)
             else "null (full fine-tuning) or a section {targets, rank, alpha, dropout}"),
    "quantize_base": (False, optional(one_of(*QUANTIZE_BASE))),
}

_MISSING = object()


def check_options(cfg: DictConfig, table: Mapping[str, tuple[bool, Check]] = COMMON) -> None:
    """Raise a one-line CheckpointError for the first option that is missing or out of range."""
    problems = option_problems(cfg, table)
    if problems:
        raise CheckpointError(problems[0])


def option_problems(cfg: DictConfig, table: Mapping[str, tuple[bool, Check]] = COMMON) -> list[str]:
    """One line for each option that is missing or out of range (``waypoint validate`` prints them all)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    problems = []
    for key, (required, check) in table.items():
        value = _lookup(config, key)
        if value is _MISSING:
            if required:
                problems.append(f"the config lacks {key}: add it to the config file, or pass +{key}=VALUE")
            continue
        expected = check(value)
        if expected is not None:
            problems.append(expected if isinstance(expected, Problem) else f"{key}={_show(value)}: expected {expected}")
    return problems + _section_problems(config)


# Sections a recipe builds by their _target_ with the section's keys: a key the class does not take is named here,
# before anything is read or written (else Python's TypeError about __init__, once the recipe reaches it)
BUILT_SECTIONS = ("dataset", "tokenizer", "optimizer", "lr_scheduler")


def constructor_options(target: str) -> list[str] | None:
    """The keyword options the class or function ``target`` (a dotted path) takes; None when it takes any
    (``**kwargs``) or cannot be looked up here (the recipe then says what is wrong)."""
    import importlib
    import inspect

    module, _, name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(found).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]


def unknown_option_line(target: str, key: str, options: list[str]) -> str:
    """``Class has no option 'key' (did you mean ...?)``."""
    import difflib

    near = difflib.get_close_matches(key, options, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(near)}?)" if near else f" (it takes {', '.join(options)})"
    return f"{target.rpartition('.')[2]} has no option {key!r}{hint}"


def _section_problems(config: Mapping) -> list[str]:
    problems = []
    for section in BUILT_SECTIONS:
        node = config.get(section)
        if not isinstance(node, Mapping) or not isinstance(node.get("_target_"), str):
            continue
        options = constructor_options(node["_target_"])
        for key in node if options is not None else ():
            if not key.startswith("_") and key not in options:
                problems.append(f"{section}.{key}: {unknown_option_line(node['_target_'], key, options)}")
    return problems


def _lookup(config: Mapping, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if not isinstance(value, (dict, list)) else repr(value)


def text(v) -> str | None:
    if isinstance(v, (bool, int, float)):  # Hydra reads key=42 and key=true as a number and a boolean
        return "a non-empty string (text Hydra reads as a number or true/false is quoted: key='\"42\"')"
    return None if isinstance(v, str) and v else "a non-empty string"


def chat_template(v) -> str | None:
    """A built-in template's name or a template file (a missing ``.jinja`` file is named when it is read)."""
    from waypoint.text.chat_template import BUILTIN_TEMPLATES

    if v is None or (isinstance(v, str) and (v in BUILTIN_TEMPLATES or v.endswith(".jinja") or Path(v).is_file())):
        return None
    return f"null (the checkpoint's own), {', '.join(sorted(BUILTIN_TEMPLATES))} or a .jinja file"


# recipes/generate.py
GENERATE: dict[str, tuple[bool, Check]] = {
    "checkpoint_dir": (True, text),
    "adapter_dir": (False, optional(text)),
    "prompt": (False, optional(text)),
    "image": (False, optional(text)),  # an image file the first message is about (a vision-language checkpoint)
    "system": (False, optional(text)),
    "chat": (True, boolean),
    "chat_template": (False, chat_template),
    "plain_text": (False, boolean),
    "max_new_tokens": (True, integer(1)),
    "temperature": (True, number(0)),
    "top_k": (True, integer(0)),
    "top_p": (True, number(0, inclusive=False, at_most=1)),
    "repetition_penalty": (True, number(0, inclusive=False)),
    "seed": (True, integer(0)),
    "device": (True, device),
    "dtype": (True, DTYPES),
}


def task_names(v) -> str | None:
    """recipes/eval.py's ``tasks``: a non-empty list of names (or one string of comma-separated names)."""
    if isinstance(v, str) and v.strip(","):
        return None
    return strings(v) and "a non-empty list of task names or task YAML files, such as [hellaswag, arc_easy]"


def folders(v) -> str | None:
    if v is None or (isinstance(v, str) and v) or (isinstance(v, (list, tuple)) and all(isinstance(p, str) and p for p in v)):
        return None
    return "null, a folder of task YAML files, or a list of them"


def document_limit(v) -> str | None:
    if v is None or integer(1)(v) is None or (isinstance(v, float) and 0 < v < 1):
        return None
    return "null, an integer >= 1 (documents per task) or a fraction 0 < x < 1"


def json_file(v) -> str | None:
    return None if v is None or (isinstance(v, str) and v.endswith(".json")) else "null or the path of a new .json file"


# recipes/eval.py
EVAL: dict[str, tuple[bool, Check]] = {
    "checkpoint_dir": (True, text),
    "adapter_dir": (False, optional(text)),
    "tasks": (True, task_names),
    "include_path": (False, folders),
    "num_fewshot": (False, optional(integer(0))),
    "limit": (False, document_limit),
    "batch_size": (True, integer(1)),
    "max_length": (False, optional(integer(2))),
    "max_gen_toks": (True, integer(1)),
    "add_bos_token": (False, optional(boolean)),
    "bootstrap_iters": (True, integer(0)),
    "output": (False, json_file),
    "seed": (True, integer(0)),
    "device": (True, device),
    "dtype": (True, DTYPES),
}
