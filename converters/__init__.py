"""Declarative, reversible weight-conversion tables (``table``) and their tensor ops (``ops``); each family's
table is in ``waypoint.families``, Meta's reference layout in ``converters.meta``."""

from waypoint.errors import CheckpointError
from waypoint.converters.ops import Chain, Identity, PerTensor, RopePermute, Split, Stack
from waypoint.converters.table import Converter, Group, Rule

__all__ = ["Chain", "CheckpointError", "Converter", "Group", "Identity", "PerTensor", "RopePermute", "Rule", "Split", "Stack"]
