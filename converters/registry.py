"""Model types: which converter serves a checkpoint, detected from its HF config.json."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from waypoint.converters.errors import CheckpointError
from waypoint.converters.llama import llama_converter
from waypoint.converters.phi3 import phi3_converter
from waypoint.converters.qwen2 import qwen2_converter
from waypoint.converters.table import Converter

CONVERTERS: dict[str, Callable[[Mapping[str, Any]], Converter]] = {
    "LLAMA2": llama_converter,
    "LLAMA3": llama_converter,
    "LLAMA3_2": llama_converter,
    "MISTRAL": llama_converter,  # Llama's keys; the sliding window is a ModelArgs field
    "QWEN2": qwen2_converter,
    "GEMMA": llama_converter,  # Llama's keys; norm, embedding scale and activation are ModelArgs fields
    "PHI3": phi3_converter,
}

# config.json's model_type -> the converter's model type (llama is told apart by its shapes below)
HF_MODEL_TYPES = {"llama": "LLAMA2", "mistral": "MISTRAL", "qwen2": "QWEN2", "gemma": "GEMMA", "phi3": "PHI3"}


def detect_model_type(config: Mapping[str, Any], source: str = "config.json") -> str:
    """LLAMA2 / LLAMA3 / MISTRAL / QWEN2 / GEMMA / PHI3 from an HF config's ``model_type`` (and Llama's shapes)."""
    hf_type = config.get("model_type")
    if hf_type == "llama":
        params = config.get("rope_parameters") or {}
        rope = params.get("rope_theta", config.get("rope_theta", 10000.0)) if isinstance(params, Mapping) else 10000.0
        return "LLAMA3" if config.get("vocab_size", 0) >= 128000 or (rope or 0) >= 500000 else "LLAMA2"
    if hf_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[hf_type]
    raise CheckpointError(
        f"{source}: unknown model_type {hf_type!r}; known: {', '.join(HF_MODEL_TYPES)} "
        f"(checkpointer model types {', '.join(CONVERTERS)})")


def get_converter(model_type: str, config: Mapping[str, Any]) -> Converter:
    key = str(model_type).upper()
    if key not in CONVERTERS:
        raise CheckpointError(f"unknown model_type {model_type!r}; known: {', '.join(CONVERTERS)}")
    return CONVERTERS[key](config)
