"""Which vision tower (and projector) a vision-language model's ``ModelArgs.vision`` builds: one entry per tower."""

from __future__ import annotations

from torch import nn

# the native model's image side (models.transformer): what LoRA does not adapt and NF4 does not quantize
IMAGE_SIDE = ("vision.", "projector.")


def vision_tower(args) -> nn.Module | None:
    """SigLIP (Gemma 3), Qwen3.5's ViT with its merger or Gemma 4's tower with its embedder; None for a text model."""
    if args is None:
        return None
    if args.tower == "qwen3_5":
        from waypoint.models.qwen3_5_vision import QwenVisionTower

        return QwenVisionTower(args)
    if args.tower == "gemma4":
        from waypoint.models.gemma4_vision import Gemma4VisionTower

        return Gemma4VisionTower(args)
    from waypoint.models.siglip import SiglipVision

    return SiglipVision(args)


def image_projector(args, text_dim: int) -> nn.Module | None:
    """Gemma 3's projector into the text's width; None where the tower projects itself (Qwen3.5's merger)."""
    if args is None or args.tower != "siglip":
        return None
    from waypoint.models.image_projector import ImageProjector

    return ImageProjector(args, text_dim)


def freeze_tower(tower: nn.Module) -> None:
    """The tower's own parameters frozen, its projection into the text's width (``PROJECTOR``: Qwen3.5's merger,
    Gemma 4's embedder) left to train, as Gemma 3's separate projector is (``freeze_vision``)."""
    for name, parameter in tower.named_parameters():
        parameter.requires_grad_(name.startswith(getattr(tower, "PROJECTOR", ())))
