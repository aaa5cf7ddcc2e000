"""Model types: which converter serves a checkpoint, detected from its HF config.json."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from converters.errors import CheckpointError
from converters.llama import llama_converter
from converters.table import Converter

CONVERTERS: dict[str, Callable[[Mapping[str, Any]], Converter]] = {
    "LLAMA2": llama_converter,
    "LLAMA3": llama_converter,
    "LLAMA3_2": llama_converter,
    "MISTRAL": llama_converter,
}


def detect_model_type(config: Mapping[str, Any], source: str = "config.json") -> str:
    """LLAMA2 / LLAMA3 / MISTRAL from an HF config's ``model_type`` and shapes."""
    hf_type = config.get("model_type")
    if hf_type == "mistral":
        return "MISTRAL"
    if hf_type == "llama":
        rope = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
        return "LLAMA3" if config.get("vocab_size", 0) >= 128000 or rope >= 500000 else "LLAMA2"
    raise CheckpointError(
        f"{source}: cannot detect the model type from model_type={hf_type!r}; "
        f"set checkpointer.model_type to one of {', '.join(CONVERTERS)}")


def get_converter(model_type: str, config: Mapping[str, Any]) -> Converter:
    key = str(model_type).upper()
    if key not in CONVERTERS:
        raise CheckpointError(f"unknown model_type {model_type!r}; known: {', '.join(CONVERTERS)}")
    return CONVERTERS[key](config)
