"""recipe_state.pt: everything beside the model that an exact resume needs.

:class:`RecipeState` is the position (the next optimizer step, and the samples of the epoch's seeded permutation
already seen), the LR scheduler, every random number generator (:func:`capture_rng`), the optimizer keyed by
parameter name (:func:`optimizer_state`: whole in a single process's file, or its tensors in a torchrun step's
shards), the resolved config and the versions. Tensors and plain Python values only, so it loads with
``torch.load(weights_only=True)``. A config recorded before a class moved is read under the class's current name
(:func:`current_names`), so old checkpoints resume.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim import Optimizer

from waypoint.checkpointers.file_formats import load_pickle
from waypoint.checkpointers.load_model import load_sharded_into
from waypoint.checkpointers.sharded_checkpoint import load_sharded
from waypoint.errors import CheckpointError
from waypoint.run.object_store import local_copy

RECIPE_STATE_FILE = "recipe_state.pt"
FORMAT_VERSION = 1
# Import names before everything moved under `waypoint` (a saved config's `_target_: checkpointers.build_model`).
LEGACY_PACKAGES = ("checkpointers.", "converters.", "models.", "training.")
# builders and config readers that moved into their family's file (waypoint.families.<family>)
MOVED = {f"waypoint.models.{name}": f"waypoint.families.{family}.{name}" for family, names in (
    ("llama", ("llama2_7b", "llama2_13b", "llama2_70b", "llama3_8b", "llama3_1_8b")), ("mistral", ("mistral_7b",)),
    ("qwen2", ("qwen2_7b",)), ("gemma", ("gemma_2b", "gemma_7b")), ("phi3", ("phi3_mini_4k",))) for name in names}
MOVED["waypoint.models.from_hf_config"] = "waypoint.families.from_hf_config"
# modules that moved between packages (the text side, then the data side, out of waypoint.training)
MOVED_MODULES = {f"waypoint.training.{name}.": f"waypoint.text.{name}." for name in ("tokenizer", "chat_template", "stop_tokens")}
MOVED_MODULES.update({f"waypoint.training.{name}.": f"waypoint.data.{name}." for name in (
    "chat_dataset", "collate", "data_checks", "data_order", "instruct_dataset", "packing", "preference_dataset",
    "prompt_dataset", "records", "run_data", "tokenized", "vision_chat_dataset")})


@dataclass
class RecipeState:
    """The state to resume from. ``epoch``/``step_in_epoch`` name the next optimizer step to take; the data
    position is kept in samples of the epoch's permutation, so it holds on another number of processes.

    ``optimizer``: the whole optimizer state dict, or None when a sharded checkpoint's files hold its tensors
    (then ``optimizer_param_groups`` holds the rest); ``rng``: rank 0's random states, ``rng_per_rank`` every
    rank's under torchrun. Saved as a plain dict (``as_dict``), so it loads with ``weights_only=True``; where the
    step's model files hold the weights in a narrower dtype than they trained in, the dict also holds them as they
    trained (``model``), so that a resume stays exact. A preference run's also holds its reference log-probs
(``reference_logps``), verified with the step. ``trackers``: the experiment trackers' runs (name -> target and
run id, ``waypoint.run.trackers``), which a resumed run continues."""

    global_step: int
    epoch: int
    step_in_epoch: int
    steps_per_epoch: int
    total_steps: int
    epochs: int
    seed: int
    global_batch: int
    config: dict
    lr_scheduler: dict
    optimizer: dict | None
    rng: dict | None
    world_size: int = 1
    rng_per_rank: list | None = None
    optimizer_param_groups: list | None = None
    reference_logps: dict | None = None  # a preference run's reference table (waypoint.run.reference_logps)
    sampling_rng: Any = None  # an online-RL run's sampling generator (torch.Generator.get_state())
    trackers: dict | None = None  # the metric_loggers' runs, to continue on resume (waypoint.run.trackers)

    def as_dict(self) -> dict[str, Any]:
        plain = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "global_batch"}
        plain = {k: v for k, v in plain.items() if v is not None or k in ("optimizer", "rng")}
        return {"format_version": FORMAT_VERSION} | plain | {
            "data_position": {"epoch": self.epoch, "samples_seen_in_epoch": self.step_in_epoch * self.global_batch,
                              "global_batch_size": self.global_batch, "permutation_seed": self.seed},
            "versions": {"waypoint": _version("waypoint"), "torch": str(torch.__version__)}}


def capture_recipe_state(plan, global_step: int, epoch: int, step_in_epoch: int, scheduler, config: dict,
                         dist, trackers=None) -> RecipeState:
    """The recipe state after ``global_step`` (the ``step_in_epoch``-th of ``epoch``), for the checkpoint saved
    there: the next position, the scheduler, every rank's random states (a collective under torchrun), and with
    ``trackers`` (rank 0's ``waypoint.run.trackers.Trackers``) their runs. The optimizer state is added by what writes
    the step (whole, or in a sharded checkpoint's files)."""
    next_epoch, next_step = plan.next_position(epoch, step_in_epoch)
    rng = dist.gather(capture_rng())
    return RecipeState(global_step=global_step, epoch=next_epoch, step_in_epoch=next_step,
                       steps_per_epoch=plan.steps_per_epoch, total_steps=plan.total_steps, epochs=plan.epochs,
                       seed=plan.seed, global_batch=plan.global_batch, config=config,
                       lr_scheduler=scheduler.state_dict(), optimizer=None, rng=rng[0] if rng else None,
                       world_size=dist.world_size, rng_per_rank=rng if dist.enabled else None,
                       trackers=trackers.runs if trackers is not None else None)


def load_recipe_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / RECIPE_STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {checkpoint_dir} is a model checkpoint, not a resumable one")
    state = load_pickle(path)  # memory-mapped: optimizer tensors are paged in on use
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a recipe state (a {type(state).__name__})")
    if "format_version" not in state:  # a loop of the user's own: save_checkpoint(..., intermediate_checkpoint=True)
        raise CheckpointError(f"{path}: not a Waypoint recipe's state (no format_version; save_checkpoint("
                              "intermediate_checkpoint=True) writes a loop's own state there): resume it with that "
                              "loop, or start a new run (resume=false)")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {state.get('format_version')!r}, expected {FORMAT_VERSION}")
    state["config"] = current_names(state.get("config") or {})
    return state


def current_name(target: str) -> str:
    """``models.x`` -> ``waypoint.models.x``; a builder that moved -> its family's (``waypoint.families.llama.llama2_7b``);
    a module that moved -> its package's (``waypoint.training.tokenizer.x`` -> ``waypoint.text.tokenizer.x``)."""
    target = "waypoint." + target if target.startswith(LEGACY_PACKAGES) else target
    for old, new in MOVED_MODULES.items():
        if target.startswith(old):
            return new + target[len(old):]
    return MOVED.get(target, target)


def current_names(config: Any) -> Any:
    """A saved config with each ``_target_`` under its current import name (see ``current_name``)."""
    if isinstance(config, dict):
        return {k: (current_name(v) if k == "_target_" and isinstance(v, str) else current_names(v)) for k, v in config.items()}
    if isinstance(config, list):
        return [current_names(v) for v in config]
    return config


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


# -- random states ---------------------------------------------------------------------------------------------------
def capture_rng() -> dict:
    """Every random number generator's state, as tensors and plain values (loadable with weights_only=True)."""
    version, mt_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restore_position(recipe_state: Mapping, rank: int, world_size: int, global_batch: int) -> tuple[int, int, int, list[str]]:
    """Restore this rank's random states; return (global step, epoch, step in the epoch, lines to print).

    The position is kept in samples of the epoch's permutation, so it holds on another number of
    processes with the same global batch; random states then continue from rank 0's."""
    rng_states = recipe_state.get("rng_per_rank") or [recipe_state["rng"]]
    same_world = len(rng_states) == world_size
    restore_rng(rng_states[rank] if same_world else rng_states[0])
    position = recipe_state["data_position"]
    samples = position.get("samples_seen_in_epoch", recipe_state["step_in_epoch"] * global_batch)
    lines = [] if same_world else [f"note: {len(rng_states)} -> {world_size} processes: same samples per step; "
                                   "random states continue from rank 0's"]
    return recipe_state["global_step"], recipe_state["epoch"], samples // global_batch, lines


# -- the optimizer, keyed by parameter name (not position), so it loads into a model sharded another way ----------------
def optimizer_state(model: nn.Module, optimizer: Optimizer, whole: bool = False) -> dict[str, Any]:
    """``{"state": {param name: {...}}, "param_groups": [{..., "params": [names]}]}`` (``torch.distributed.checkpoint``'s
    form, the same for a plain and an FSDP2 model): the shards of a sharded model, or with ``whole`` whole tensors on
    rank 0 (every rank must call it; the others get an empty dict)."""
    sharded = any(hasattr(p, "device_mesh") for p in model.parameters())
    if whole and sharded:
        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return get_optimizer_state_dict(model, optimizer)


def load_whole_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load a whole (single-process) optimizer state, into a plain or a sharded model's optimizer."""
    if state["state"] and all(isinstance(k, int) for k in state["state"]):  # position-keyed: written before names
        optimizer.load_state_dict(state)
        return
    sharded = any(hasattr(p, "device_mesh") for p in model.parameters())
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=sharded))


def load_sharded_optimizer_state(model: nn.Module, optimizer: Optimizer, directory: str | Path,
                                 param_groups: list[dict]) -> None:
    """Load the optimizer tensors of a sharded checkpoint (any number of writers) and the saved param groups."""
    template = get_optimizer_state_dict(model, optimizer)  # allocates the state DCP reads into
    load_sharded({"optimizer": template["state"]}, directory)
    set_optimizer_state_dict(model, optimizer, {"state": template["state"], "param_groups": param_groups})


# -- a torchrun step's model ----------------------------------------------------------------------------------------------
def sharded_step_model(step_dir: str | Path, output_dir: str | Path | None = None, dtype=None):
    """(checkpointer of the run's input, its state dict, the run's model filled from the step's shards) for a
    torchrun step (``step_N/sharded/``): the run's model class and input from its recipe state, the weights from the
    shards; the checkpointer writes the input's format, files and key -> file map. ``scripts/convert.py`` and
    ``recipes/generate.py`` read such a step through it, as they read every other kind through the checkpointers."""
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
