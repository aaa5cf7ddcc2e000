"""FSDP2 for the recipes: each transformer block is one unit of sharding, and the root holds the rest."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from waypoint.errors import CheckpointError
from waypoint.models import parse_dtype
from waypoint.models.transformer import TransformerBlock


def shard_model(model: nn.Module, mesh, mixed_precision: Mapping | None = None) -> nn.Module:
    """``fully_shard`` every :class:`TransformerBlock` (and Gemma 4's per-layer embeddings) and then the root, in place
    (on the meta device too).

    ``mixed_precision``: ``{param_dtype: bf16, reduce_dtype: fp32}`` computes in ``param_dtype`` and
    reduces gradients in ``reduce_dtype`` while the sharded parameters keep their own dtype; None
    computes in the parameters' dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if mixed_precision:
        unknown = set(mixed_precision) - {"param_dtype", "reduce_dtype"}
        if unknown:
            raise CheckpointError(f"mixed_precision: unknown option(s) {', '.join(sorted(unknown))} (param_dtype, reduce_dtype)")
        try:
            policy = MixedPrecisionPolicy(param_dtype=parse_dtype(mixed_precision.get("param_dtype")),
                                          reduce_dtype=parse_dtype(mixed_precision.get("reduce_dtype")))
        except ValueError as e:
            raise CheckpointError(f"mixed_precision: {e}") from None
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if not blocks:
        raise CheckpointError(f"{type(model).__name__} has no TransformerBlock to shard")
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    if getattr(model, "per_layer", None) is not None:  # Gemma 4's per-layer table (E4B: 5.6 GB in bf16) is a unit of
        fully_shard(model.per_layer, mesh=mesh, mp_policy=policy)  # its own: whole for its lookup, not the whole step
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 unit's parameters back into their shards: a forward without a backward (evaluation) leaves the
    root's unsharded, and the optimizer and its state dict know the sharded ones. Nothing to do unsharded."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 unit's parameters whole for the length of the block, and kept whole across its forwards: each rank
    may then run any number of forwards of its own (sampling, whose length differs from rank to rank) with no
    collective among them. One all-gather per unit on entry; back in their shards on exit. Unsharded: nothing."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    kept = []
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        kept.append(group.post_forward_mesh_info if group is not None else None)
        unit.set_reshard_after_forward(False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, mesh_info in zip(units, kept):
            group = unit._get_fsdp_state()._fsdp_param_group
            if group is not None:
                group.post_forward_mesh_info = mesh_info
            unit.reshard()


def grad_norm_value(norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s result as a number (a DTensor for a sharded model)."""
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
