"""Model families: one file each (``families/<name>.py`` defining ``FAMILY``), found here by discovery.

Everything outside this package asks it about a family (``family_of``, ``family_named``) and never names one:
a new family is one new file (plus, where its architecture differs, fields on the native model).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from waypoint.converters.table import Converter
from waypoint.errors import CheckpointError
from waypoint.families.config_names import in_config_names
from waypoint.families.family import Family
from waypoint.families.hf_config import HFConfig, check_fixed
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer

_ORDER = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")


def _discover() -> tuple[Family, ...]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "FAMILY", None), Family):
            found.append(module.FAMILY)
    return tuple(sorted(found, key=lambda f: (_ORDER.index(f.name) if f.name in _ORDER else len(_ORDER), f.name)))


FAMILIES: tuple[Family, ...] = _discover()
HF_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.hf_model_types)  # config.json model_type values read
MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)  # checkpointer model_type names


def family_of(config: Mapping[str, Any], source: str = "config.json") -> Family:
    """The family of an HF config.json (its ``model_type``; a config without one is Llama's)."""
    hf_type = config.get("model_type") or "llama"
    for family in FAMILIES:
        if hf_type in family.hf_model_types:
            return family
    raise CheckpointError(f"{source}: unknown model_type {hf_type!r}; known: {', '.join(HF_MODEL_TYPES)}")


def family_named(model_type: str) -> Family:
    """The family of a checkpointer ``model_type`` (``QWEN3``), a family name or an HF model_type (``qwen3``)."""
    name = str(model_type)
    for family in FAMILIES:
        if name.upper() in family.model_types or name in (family.name, *family.hf_model_types):
            return family
    raise CheckpointError(f"unknown model_type {model_type!r}; known: {', '.join(MODEL_TYPES)}")


def text_config(family: Family, config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal repo's text model config (its ``nested_config``), with the outer ``tie_word_embeddings`` where the
    outer config sets it (the one transformers' ``*ForConditionalGeneration`` ties by); any other config as it is."""
    if not (family.nested_config and isinstance(config.get(family.nested_config), Mapping)):
        return config
    inner = dict(config[family.nested_config])
    if config.get("tie_word_embeddings") is not None:
        inner["tie_word_embeddings"] = config["tie_word_embeddings"]
    return inner


def model_args_from_hf_config(config: Mapping[str, Any]) -> ModelArgs:
    """ModelArgs from an HF config.json of a known family, read as its transformers class reads it; what the
    native model cannot reproduce (an unknown model_type, rope type or activation, an architecture flag) is
    a ValueError naming it."""
    hf_type = config.get("model_type") or "llama"
    family = next((f for f in FAMILIES if hf_type in f.hf_model_types), None)
    if family is None:
        raise ValueError(f"unknown model_type {hf_type!r}; known: {', '.join(HF_MODEL_TYPES)}")
    outer, config = config, text_config(family, config)
    cfg = HFConfig(config, family.defaults)
    check_fixed(cfg, family.fixed, hf_type)
    try:
        args = family.model_args(cfg)
    except ValueError as e:  # ModelArgs' own checks name its fields: the file's names instead
        raise type(e)(in_config_names(str(e), config)) from e
    vision = family.vision(outer) if family.vision is not None and config is not outer else None
    return replace(args, vision=vision) if vision is not None else args


def checked_model_args(config: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
    """``model_args_from_hf_config`` with its problems as one-line CheckpointErrors naming ``source``."""
    try:
        return model_args_from_hf_config(config)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{source}: {e.args[0] if e.args else e}") from e


def detect_model_type(config: Mapping[str, Any], source: str = "config.json") -> str:
    """The checkpointer model_type of an HF config (LLAMA3, QWEN3, MIXTRAL, ...)."""
    family = family_of(config, source)
    config = text_config(family, config)
    return family.model_type_of(HFConfig(config, family.defaults)) if family.model_type_of else family.model_types[0]


def get_converter(model_type: str, config: Mapping[str, Any], source: str = "config.json") -> Converter:
    """The converter for a checkpoint of ``model_type`` with this config.json."""
    return family_named(model_type).converter(checked_model_args(config, source))


def hf_config_for(args: ModelArgs, model_type: str) -> dict[str, Any]:
    """A config.json for a model that came with none (a Meta or native checkpoint), from its ModelArgs."""
    return family_named(model_type).hf_config(args)


def read_hf_config(config: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    """A parsed HF config from a ``config.json`` path, its directory, or the dict itself."""
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    return json.loads(path.read_text())


def from_hf_config(config: Mapping[str, Any] | str | os.PathLike, attn_dropout: float | None = None) -> Transformer:
    """The native model for an HF config; ``attn_dropout`` overrides the config's ``attention_dropout``."""
    args = model_args_from_hf_config(read_hf_config(config))
    return Transformer(args if attn_dropout is None else replace(args, attn_dropout=attn_dropout))



__all__ = ["FAMILIES", "HF_MODEL_TYPES", "MODEL_TYPES", "Family", "checked_model_args", "detect_model_type", "family_named",
           "family_of", "from_hf_config", "get_converter", "hf_config_for", "model_args_from_hf_config",
           "read_hf_config"]
