"""Filling a meta-device model from a native state dict, and the one-call ``load_model``.

The model is built on the meta device (no memory) and its parameters are
*assigned* the loaded tensors (``load_state_dict(assign=True)``), which are
memory-mapped views of the files: loading peaks at about one copy of the model.
Build the optimizer after this, so it holds the parameters the model really uses.
"""

from __future__ import annotations

import os
from dataclasses import replace
from collections.abc import Mapping
from pathlib import Path

import torch

from checkpointers.extra_state import is_extra_state_key
from converters import CheckpointError
from models import ModelArgs, Transformer, from_hf_config, model_args_from_hf_config, parse_dtype


def _fold(keys: list[str]) -> str:
    return f"{keys[0]!r}" + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")


def load_into(model: Transformer, state: Mapping[str, torch.Tensor], dtype: torch.dtype | str | None = None,
              device: torch.device | str | None = None) -> Transformer:
    """Assign ``state`` to ``model``'s parameters (strict; shapes checked first; one-line errors naming the key).

    Tensors keep their dtype unless ``dtype`` is given; ``*._extra_state`` entries go to the modules'
    ``set_extra_state`` (a checkpoint older than a module's extra state loads with its defaults).
    """
    dtype = parse_dtype(dtype)
    expected = {k: v for k, v in model.state_dict().items() if not is_extra_state_key(k)}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(k for k in state.keys() - expected.keys() if not is_extra_state_key(k) or k not in model.state_dict())
    if missing:
        raise CheckpointError(f"checkpoint lacks model key {_fold(missing)}")
    if unexpected:
        raise CheckpointError(f"checkpoint has key {_fold(unexpected)} that the model does not")
    for key, want in expected.items():
        if state[key].shape != want.shape:
            raise CheckpointError(f"{key}: checkpoint shape {tuple(state[key].shape)} does not fit the model's {tuple(want.shape)}")
    def place(value):
        if not isinstance(value, torch.Tensor):
            return value
        return value.to(device=device, dtype=dtype if dtype is not None and value.is_floating_point() else None)

    model.load_state_dict({k: place(v) for k, v in state.items()}, strict=True, assign=True)
    model.tie_weights()
    model.reset_rope()
    return model


def detect_format(path: str | os.PathLike) -> str:
    """'hf', 'meta' or 'native', from the files in a checkpoint directory."""
    from checkpointers.native_checkpointer import MODEL_FILE

    path = Path(path)
    if (path / MODEL_FILE).is_file():
        return "native"
    if (path / "config.json").is_file():
        return "hf"
    if (path / "params.json").is_file() and any(path.glob("consolidated.*.pth")):
        return "meta"
    raise CheckpointError(f"{path}: not a recognised checkpoint directory (no config.json, params.json + "
                          f"consolidated.*.pth, or {MODEL_FILE})")


def checkpointer_for(path: str | os.PathLike, output_dir: str | os.PathLike | None = None, **kwargs):
    """The checkpointer that reads ``path``'s format (writing to ``output_dir``, default ``path``)."""
    from checkpointers.hf_checkpointer import HFCheckpointer
    from checkpointers.meta_checkpointer import MetaCheckpointer
    from checkpointers.native_checkpointer import NativeCheckpointer

    cls = {"hf": HFCheckpointer, "meta": MetaCheckpointer, "native": NativeCheckpointer}[detect_format(path)]
    return cls(path, output_dir=output_dir if output_dir is not None else path, **kwargs)


def model_args_for(checkpointer) -> ModelArgs:
    """The ModelArgs a loaded checkpointer describes (Meta's come from params.json and the tensors)."""
    if getattr(checkpointer, "model_args", None) is not None:
        return checkpointer.model_args
    return model_args_from_hf_config(checkpointer.config)


def build_model(checkpoint_dir: str | os.PathLike, attn_dropout: float | None = None) -> Transformer:
    """The model (on the current default device: build it under ``torch.device("meta")``) that a checkpoint
    directory of any format describes; for configs: ``model: {_target_: checkpointers.build_model, ...}``."""
    fmt = detect_format(checkpoint_dir)
    if fmt == "hf":
        return from_hf_config(checkpoint_dir, attn_dropout=attn_dropout)
    checkpointer = checkpointer_for(checkpoint_dir)
    if fmt == "meta":
        with torch.device("cpu"):
            checkpointer.load_checkpoint()  # memory-mapped: shapes are read, not the weights
    args = model_args_for(checkpointer)
    return Transformer(replace(args, attn_dropout=attn_dropout) if attn_dropout is not None else args)


def load_model(path: str | os.PathLike, dtype: torch.dtype | str | None = None) -> Transformer:
    """The ready native model for a checkpoint directory (format and family detected from its files)."""
    checkpointer = checkpointer_for(path)
    state = checkpointer.load_checkpoint()["model"]
    with torch.device("meta"):
        model = Transformer(model_args_for(checkpointer))
    return load_into(model, state, dtype)
