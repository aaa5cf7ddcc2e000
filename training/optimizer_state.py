"""Optimizer state keyed by parameter name (not position), so it loads into a model sharded another way.

``torch.distributed.checkpoint.state_dict`` gives the same FQN-keyed form for a plain and an FSDP2
model: whole tensors in a single process, DTensors under FSDP2. A checkpoint's optimizer state comes
either whole (``recipe_state.pt`` of a single-process run) or sharded (DCP files of a multi-process run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim import Optimizer

from waypoint.checkpointers.sharded_checkpoint import load_sharded


def optimizer_state(model: nn.Module, optimizer: Optimizer, whole: bool = False) -> dict[str, Any]:
    """``{"state": {param name: {...}}, "param_groups": [{..., "params": [names]}]}``: the shards of a sharded
    model, or with ``whole`` whole tensors on rank 0 (every rank must call it; the others get an empty dict)."""
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
