"""Model builders: the published Llama-family shapes, and shapes read from an HF ``config.json``."""

from __future__ import annotations

import json
from dataclasses import replace
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from models.transformer import ModelArgs, Transformer

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """'bf16' / 'bfloat16' / 'torch.bfloat16' / torch.bfloat16 -> torch.bfloat16; None stays None."""
    if name is None or isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def llama2_7b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, hidden_dim=11008, max_seq_len=4096))


def llama2_13b() -> Transformer:
    return Transformer(ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, hidden_dim=13824, max_seq_len=4096))


def llama2_70b() -> Transformer:
    return Transformer(ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, hidden_dim=28672, max_seq_len=4096))


def llama3_8b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=14336, rope_theta=500000.0, max_seq_len=8192))


def mistral_7b() -> Transformer:
    return Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, hidden_dim=14336, rope_theta=10000.0, max_seq_len=32768))


def _rope_theta(config: Mapping[str, Any]) -> float:
    # transformers v5 writes {"rope_parameters": {"rope_theta": ..., "rope_type": "default"}}; v4 a top-level rope_theta.
    params = config.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(config.get("rope_theta", 10000.0))


def model_args_from_hf_config(config: Mapping[str, Any]) -> ModelArgs:
    """ModelArgs from the fields of a Llama-family HF ``config.json``."""
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    missing = [k for k in required if k not in config]
    if missing:
        raise KeyError(f"config.json lacks {', '.join(missing)}")
    n_heads = config["num_attention_heads"]
    return ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        hidden_dim=config["intermediate_size"],
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=_rope_theta(config),
        max_seq_len=config.get("max_position_embeddings", 4096),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        attn_dropout=float(config.get("attention_dropout", 0.0) or 0.0),
    )


def hf_config_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The weights' dtype as recorded in config.json (``dtype`` in v5, ``torch_dtype`` before)."""
    return parse_dtype(config.get("dtype") or config.get("torch_dtype"))


def read_hf_config(config: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    """A parsed HF config from a ``config.json`` path, its directory, or the dict itself."""
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    return json.loads(path.read_text())


def from_hf_config(config: Mapping[str, Any] | str | os.PathLike, attn_dropout: float | None = None) -> Transformer:
    """The model for an HF config; ``attn_dropout`` overrides the config's ``attention_dropout``."""
    args = model_args_from_hf_config(read_hf_config(config))
    if attn_dropout is not None:
        args = replace(args, attn_dropout=attn_dropout)
    return Transformer(args)
