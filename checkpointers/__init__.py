"""Checkpointers: read a checkpoint in its own format, write it back the same way."""

from checkpointers.hf_checkpointer import HFCheckpointer
from checkpointers.load_model import load_into, load_model
from converters.errors import CheckpointError

__all__ = ["CheckpointError", "HFCheckpointer", "load_into", "load_model"]
