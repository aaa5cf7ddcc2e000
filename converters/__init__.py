"""Weight converters between checkpoint layouts and the native model."""

from waypoint.converters.errors import CheckpointError
from waypoint.converters.ops import Chain, Identity, PerTensor, RopePermute, Split
from waypoint.converters.registry import CONVERTERS, HF_MODEL_TYPES, detect_model_type, get_converter
from waypoint.converters.table import Converter, Group, Rule

__all__ = ["CONVERTERS", "HF_MODEL_TYPES", "Chain", "CheckpointError", "Converter", "Group", "Identity", "PerTensor",
           "RopePermute", "Rule", "Split", "detect_model_type", "get_converter"]
