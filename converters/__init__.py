"""Weight converters between checkpoint layouts and the native model."""

from converters.errors import CheckpointError
from converters.ops import Chain, Identity, PerTensor, RopePermute, Split
from converters.registry import CONVERTERS, HF_MODEL_TYPES, detect_model_type, get_converter
from converters.table import Converter, Group, Rule

__all__ = ["CONVERTERS", "HF_MODEL_TYPES", "Chain", "CheckpointError", "Converter", "Group", "Identity", "PerTensor",
           "RopePermute", "Rule", "Split", "detect_model_type", "get_converter"]
