"""A checkpoint loaded for inference (recipes/generate.py, recipes/eval.py): any checkpoint the checkpointers read (HF,
Meta, native; a run's ``step_N`` or its ``merged/``; a torchrun run's sharded step; an object-store URL, copied to
the local cache first), with a PEFT LoRA adapter (ours or PEFT's) merged in where one is given.

A directory with a ``MANIFEST.json`` (every step and ``merged/`` a run writes) that fails verification is refused
in one line, as resume refuses it; so is an adapter whose tensors do not fit the base. An adapter whose
``adapter_config.json`` names another base, with tensors that fit, is merged with a ``warning:`` line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from waypoint.checkpointers import checkpointer_for, load_into
from waypoint.checkpointers.commit import MANIFEST, verify
from waypoint.checkpointers.peft_adapter import load_adapter, read_adapter_config, warn_other_base
from waypoint.checkpointers.sharded_checkpoint import holds_sharded_model
from waypoint.cli.hub_source import base_model_name
from waypoint.errors import CheckpointError
from waypoint.models import Transformer, parse_dtype
from waypoint.models.lora import merge_state_dict
from waypoint.run.object_store import local_copy
from waypoint.run.recipe_state import sharded_step_model
from waypoint.text.tokenizer import Tokenizer, load_tokenizer


def note(line: str) -> None:
    print(line, file=sys.stderr)


@dataclass
class Loaded:
    model: Transformer  # in eval mode, on its device
    tokenizer: Tokenizer
    directory: Path  # the checkpoint's local directory
    adapter_dir: Path | None  # the adapter's local directory, or None


def verified(directory: Path, key: str) -> Path:
    """``directory``, refused in one line when it has a MANIFEST.json that it fails (as resume refuses a step)."""
    if (directory / MANIFEST).is_file():
        checked = verify(directory)
        if not checked.ok:
            raise CheckpointError(f"{key}={directory}: fails its {MANIFEST} ({checked.problem}): damaged or incomplete; "
                                  "use another step, or copy it again")
    return directory


def open_checkpoint(checkpoint_dir: str, say: Callable[[str], None] = note
                    ) -> tuple[object, Path, Path, Callable[[], dict]]:
    """(the checkpointer, the checkpoint's local directory, the directory of its tokenizer, what reads the native
    state dict): a torchrun step's tokenizer is its run's input, and its weights are read from the shards."""
    directory = verified(local_copy(checkpoint_dir, say=say), "checkpoint_dir")
    if holds_sharded_model(directory):
        checkpointer, loaded, _ = sharded_step_model(directory)
        return checkpointer, directory, Path(checkpointer.checkpoint_dir), lambda: loaded["model"]
    checkpointer = checkpointer_for(directory, output_dir=directory.parent)
    return checkpointer, directory, directory, lambda: checkpointer.load_checkpoint()["model"]


def open_adapter(adapter_dir: str | None, say: Callable[[str], None] = note) -> Path | None:
    """``adapter_dir``'s local directory, verified, with its adapter_config.json checked; None without one."""
    if not adapter_dir:
        return None
    directory = verified(local_copy(adapter_dir, say=say), "adapter_dir")
    read_adapter_config(directory)  # a bad adapter fails before the weights are read
    return directory


def build(checkpointer, state: dict, adapter_dir: Path | None, device: str, dtype: str,
          say: Callable[[str], None] | None = note) -> Transformer:
    """The checkpoint's model, with ``adapter_dir``'s LoRA merged in, in ``dtype`` on ``device``, for inference. The
    load report (what was loaded, and the checkpointer's notes: a quantized input's tensors) goes to ``say`` as the
    training recipes print it (stderr by default: stdout is the model's reply)."""
    if adapter_dir is not None:
        tensors, config = load_adapter(adapter_dir, checkpointer.hf_converter(), state)  # each checked to fit
        warn_other_base(adapter_dir, config, checkpointer.checkpoint_dir, checkpointer.family,
                        base_model_name(checkpointer.checkpoint_dir))
        state = merge_state_dict(state, tensors, float(config["lora_alpha"]) / int(config["r"]))
    with torch.device("meta"):
        model = Transformer(checkpointer.model_args())
    report = load_into(model, state, parse_dtype(dtype))
    if say is not None:
        say("\n".join(report.lines() + checkpointer.notes))
    return model.to(device).eval()


def load_for_inference(checkpoint_dir: str, adapter_dir: str | None = None, device: str = "cpu", dtype: str = "fp32",
                       say: Callable[[str], None] = note) -> Loaded:
    """The model (adapter merged), its tokenizer and where they came from; the tokenizer and the adapter's config are
    read before the weights, so a bad one costs nothing."""
    checkpointer, directory, tokenizer_dir, read_state = open_checkpoint(checkpoint_dir, say)
    adapter = open_adapter(adapter_dir, say)
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build(checkpointer, read_state(), adapter, device, dtype, say)
    return Loaded(model, tokenizer, directory, adapter)
