"""Checkpoint formats: read a checkpoint in its own format, write it back the same way, or convert it."""

from waypoint.checkpointers.base import Checkpointer, Conversion
from waypoint.checkpointers.formats import FORMATS, checkpointer_for, convert, detect_format, write_checkpoint
from waypoint.checkpointers.hf_checkpointer import HFCheckpointer
from waypoint.checkpointers.load_model import build_model, load_into, load_model
from waypoint.checkpointers.meta_checkpointer import MetaCheckpointer
from waypoint.checkpointers.native_checkpointer import NativeCheckpointer
from waypoint.errors import CheckpointError

__all__ = ["FORMATS", "CheckpointError", "Checkpointer", "Conversion", "HFCheckpointer", "MetaCheckpointer",
           "NativeCheckpointer", "build_model", "checkpointer_for", "convert", "detect_format", "load_into", "load_model",
           "write_checkpoint"]
