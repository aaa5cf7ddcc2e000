"""The model of a torchrun run's sharded step (``step_N/sharded/``): the run's model class and input from its
``recipe_state.pt``, the weights from the shards. ``scripts/convert.py`` and ``recipes/generate.py`` read such a
step through it, as they read every other kind (a checkpoint in the HF, Meta or native format, a run's ``step_N``
or ``merged/``) through the checkpointers, on disk or at an object-store URL (``local_copy``)."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate

from waypoint.checkpointers.load_model import load_sharded_into
from waypoint.checkpointers.object_store import local_copy
from waypoint.training.recipe_state import load_recipe_state


def sharded_step_model(step_dir: str | Path, output_dir: str | Path | None = None, dtype=None):
    """(checkpointer of the run's input, its state dict, the run's model filled from the step's shards) for a
    torchrun step; the checkpointer writes the input's format, files and key -> file map."""
    step_dir = Path(step_dir)
    config = load_recipe_state(step_dir)["config"]
    section = dict(config["checkpointer"])
    section["checkpoint_dir"] = str(local_copy(section["checkpoint_dir"], say=print))  # an s3:// input: its copy
    checkpointer = instantiate(section, output_dir=str(output_dir or step_dir.parent))
    checkpointer.load_checkpoint()  # the input's layout, for writing the same files
    with torch.device("meta"):
        model = instantiate(config["model"])
    load_sharded_into(model, step_dir, dtype=dtype or config.get("dtype"))
    return checkpointer, {"model": model.state_dict()}, model
