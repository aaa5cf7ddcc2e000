"""Checkpointers: read a checkpoint in its own format, write it back the same way."""

from checkpointers.base import Checkpointer
from checkpointers.hf_checkpointer import HFCheckpointer
from checkpointers.load_model import build_model, checkpointer_for, detect_format, load_into, load_model
from checkpointers.meta_checkpointer import MetaCheckpointer
from checkpointers.native_checkpointer import NativeCheckpointer
from converters.errors import CheckpointError

__all__ = ["CheckpointError", "Checkpointer", "HFCheckpointer", "MetaCheckpointer", "NativeCheckpointer", "build_model",
           "checkpointer_for", "detect_format", "load_into", "load_model"]
