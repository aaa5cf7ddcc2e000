"""LoRA on a vision-language model's image side: the tower's linears and Gemma 3's projector, named in ``lora.targets``
as ``vision.NAME`` (native names or transformers'), each adapted only where a target names it.

The tower's linears (SigLIP's, Qwen3.5's blocks and merger, Gemma 4's) take a ``models.lora.LoRALinear``; Gemma 4's
clamp their inputs and outputs (``models.gemma4_vision.ClippedLinear``) and take a ``ClippedLoRALinear``, which keeps
the clamps around the adapted product.

Gemma 3's projector (``models.image_projector``) is no linear layer but one bare matrix W [vision dim, text dim] that
the pooled patches are multiplied by (transformers' ``mm_input_projection_weight``, an ``nn.Parameter``), which PEFT's
``target_modules`` cannot name. PEFT (>= 0.17) adapts it by ``target_parameters`` (its ``ParamWrapper``), reading the
matrix as [out, in] and adding ``alpha / r * lora_B @ lora_A`` to it: ``lora_A`` [r, text dim], ``lora_B``
[vision dim, r], under the projector module's keys (``model.multi_modal_projector.lora_A.weight``).
:class:`LoRAProjector` holds exactly those two, so its merge is every LoRA's ``W + alpha / r * B @ A``; it computes
``x @ W + alpha / r * (x @ B) @ A``, never forming the sum. PEFT's ParamWrapper refuses dropout, and so does this."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from waypoint.errors import CheckpointError
from waypoint.models.image_projector import ImageProjector
from waypoint.models.lora_experts import HALF
from waypoint.models.lora_factors import LoRAFactors

VISION = "vision."  # targets on a vision-language model's image side: vision.NAME
PROJECTOR = "projector"  # Gemma 3's projector: the native model's module, and its target (vision.projector)
# SigLIP's, Qwen3.5's and Gemma 4's linears, and Gemma 3's projector
VISION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "fc1", "fc2", "gate_proj", "up_proj", "down_proj",
                  PROJECTOR)
VISION_HF_NAMES = {"out_proj": "o_proj", "qkv": "qkv_proj", "proj": "o_proj", "linear_fc1": "fc1", "linear_fc2": "fc2",
                   "mm_input_projection_weight": PROJECTOR}


def vision_targets(targets: Iterable[str]) -> list[str]:
    """The image side's targets among ``targets`` (``vision.NAME``, NAME native or transformers': ``vision.qkv``,
    ``vision.linear_fc1``, ``vision.mm_input_projection_weight``), as the native module names."""
    names = [t.removeprefix(VISION) for t in targets if t.startswith(VISION)]
    names = list(dict.fromkeys(VISION_HF_NAMES.get(t, t) for t in names))
    unknown = [t for t in names if t not in VISION_TARGETS]
    if unknown:
        raise CheckpointError(f"unknown lora target(s) {', '.join(VISION + t for t in unknown)}; the vision tower's: "
                              f"{', '.join(VISION + t for t in VISION_TARGETS)} (or transformers' names: "
                              f"{', '.join(VISION + t for t in VISION_HF_NAMES)})")
    return names


def image_side_modules(model: nn.Module, tower: list[str]) -> list[tuple[str, nn.Module]]:
    """(path, module) of every linear of ``model``'s tower and of its projector that ``tower`` (:func:`vision_targets`)
    names; a target that names nothing in this model is a one-line error listing what it has."""
    if tower and getattr(model, "vision", None) is None:
        raise CheckpointError(f"lora target {VISION}{tower[0]} adapts a vision tower, which this model does not have")
    candidates = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
                  and name.startswith(VISION) and name.rsplit(".", 1)[-1] in VISION_TARGETS]
    if isinstance(getattr(model, PROJECTOR, None), ImageProjector):
        candidates.append((PROJECTOR, model.projector))
    have = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, _ in candidates))
    absent = [t for t in tower if t not in have]
    if absent:
        raise CheckpointError(f"lora target {VISION}{absent[0]}: this model's image side has no {absent[0]}; its "
                              f"targets: {', '.join(VISION + t for t in have)}")
    return [(name, m) for name, m in candidates if name.rsplit(".", 1)[-1] in tower]


class LoRAProjector(ImageProjector, LoRAFactors):
    """Gemma 3's projector with a trainable low-rank update of its matrix, in PEFT's form (the module doc)."""

    def __init__(self, base: ImageProjector, rank: int, alpha: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)  # the base's norm and matrix, as they are
        if rank < 1:
            raise CheckpointError(f"lora rank must be at least 1, got {rank}")
        if dropout:
            raise CheckpointError(f"lora.dropout must be 0 with the target {VISION}{PROJECTOR} (PEFT adapts the projector's "
                                  "bare matrix by target_parameters, whose ParamWrapper refuses dropout); set lora.dropout: 0")
        self.args, self.norm, self.weight = base.args, base.norm, base.weight
        self.weight.requires_grad_(False)
        self.rank, self.alpha, self.dropout_p = int(rank), float(alpha), 0.0
        self.scaling = self.alpha / self.rank
        vision_dim, text_dim = base.weight.shape
        dtype = torch.float32 if base.weight.dtype in HALF else base.weight.dtype  # as LoRALinear's
        self.lora_A = nn.Linear(text_dim, self.rank, bias=False, device="meta", dtype=dtype)  # weight [r, text dim]
        self.lora_B = nn.Linear(self.rank, vision_dim, bias=False, device="meta", dtype=dtype)  # weight [vision dim, r]
        self.place_factors(base.weight)

    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().project(tokens)
        if self.disabled:
            return out
        x = tokens.to(self.lora_B.weight.dtype)
        return out + ((x @ self.lora_B.weight) @ self.lora_A.weight * self.scaling).to(out.dtype)

    def extra_repr(self) -> str:
        return f"matrix={tuple(self.weight.shape)}, rank={self.rank}, alpha={self.alpha}"
