"""Checkpointers: read a checkpoint in its own format, write it back the same way."""

from waypoint.checkpointers.base import Checkpointer
from waypoint.checkpointers.hf_checkpointer import HFCheckpointer
from waypoint.checkpointers.load_model import build_model, checkpointer_for, detect_format, load_into, load_model
from waypoint.checkpointers.meta_checkpointer import MetaCheckpointer
from waypoint.checkpointers.native_checkpointer import NativeCheckpointer
from waypoint.errors import CheckpointError

__all__ = ["CheckpointError", "Checkpointer", "HFCheckpointer", "MetaCheckpointer", "NativeCheckpointer", "build_model",
           "checkpointer_for", "detect_format", "load_into", "load_model"]
