"""Weight converters between checkpoint layouts and the native model."""

from converters.errors import CheckpointError
from converters.ops import Identity, RopePermute
from converters.registry import CONVERTERS, detect_model_type, get_converter
from converters.table import Converter, Group, Rule

__all__ = ["CONVERTERS", "CheckpointError", "Converter", "Group", "Identity", "RopePermute", "Rule",
           "detect_model_type", "get_converter"]
