"""Non-finite values never reach a checkpoint.

A step whose loss or gradient norm is nan or inf either stops the run before the weights are
updated (``on_nonfinite: stop``, the default: the newest committed checkpoint stays the last good
one) or has its update skipped (``skip_step``); either way the line says the step, the loss, the
gradient norm and, when it is cheap to tell, the first parameter that is not finite. A checkpoint
is never written from non-finite weights (:func:`check_weights_finite`, before each save).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from waypoint.errors import CheckpointError
from waypoint.models.quantized_base import is_quantized_base


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # this rank's piece of a sharded (FSDP2) parameter


def clip_gradients(parameters: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """The gradients' total norm, clipped to ``max_norm`` (None: not clipped) as ``clip_grad_norm_`` does, but left
    as they are when the norm is not finite, so that :func:`first_nonfinite` can still name where it started."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    from waypoint.training.fsdp import grad_norm_value

    with_grads = [p for p in parameters if p.grad is not None]
    norm = get_total_norm([p.grad for p in with_grads])
    value = grad_norm_value(norm)
    if max_norm and math.isfinite(value):
        clip_grads_with_norm_(with_grads, max_norm, norm)
    return value


def first_nonfinite(model: nn.Module) -> str:
    """Where the first non-finite value is (weights first, then gradients; this rank's pieces), or ``""``."""
    weights = first_nonfinite_weights(model)
    if weights:
        return weights
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()):
                return f"the gradient of {name} is the first that is not finite"
    return ""


def step_is_finite(step: int, loss: float, grad_norm: float, model: nn.Module, policy: str, say: Callable[[str], None],
                   updated: bool) -> bool:
    """True when step ``step`` may update the weights. ``updated``: whether this process has updated them yet
    (if not, non-finite weights came from the checkpoint it loaded)."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return True
    where = first_nonfinite(model)
    if where.startswith("the weights") and not updated:
        where += " as loaded from the checkpoint"
    what = f"step {step}: loss {loss:.6g}, grad norm {grad_norm:.6g}" + (f"; {where}" if where else "")
    if policy == "skip_step":
        say(f"warning: {what}; update skipped (on_nonfinite=skip_step)")
        return False
    raise CheckpointError(f"{what}; stopped before updating the weights, so the newest checkpoint is the last good one "
                          "(on_nonfinite=skip_step skips such steps instead)")


def check_weights_finite(model: nn.Module, step: int, any_rank: Callable[[bool], bool] = bool) -> None:
    """Refuse to checkpoint non-finite weights. ``any_rank``: ``Distributed.any``, so every rank stops together."""
    where = first_nonfinite_weights(model)
    if any_rank(bool(where)):
        raise CheckpointError(f"step {step}: not saving a checkpoint, {where or 'the weights of another rank are not finite'}; "
                              "the newest checkpoint is the last good one")


def first_nonfinite_weights(model: nn.Module) -> str:
    """Which parameter's weights (this rank's pieces) are the first that are not finite, or ``""``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_quantized_base(p):  # a frozen 4-bit base weight (NF4, MXFP4): training never changes it
                continue
            if not bool(torch.isfinite(_local(p)).all()):
                return f"the weights of {name} are not finite"
    return ""
