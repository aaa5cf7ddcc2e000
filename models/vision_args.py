"""What a vision-language model's image side is: :class:`VisionArgs`, a field of ``ModelArgs`` (``vision``), None in
a text model. Its own module, read by the tower, the projector and the transformer that places their output."""

from __future__ import annotations

from dataclasses import dataclass

from waypoint.models.args import ACTIVATIONS

TOWERS = ("siglip",)  # Gemma 3's (models.siglip); Qwen3.5's has its own args (models.qwen3_5_vision)


@dataclass(frozen=True)
class VisionArgs:
    tower: str  # which tower: "siglip"
    dim: int  # the tower's width
    n_layers: int
    n_heads: int
    hidden_dim: int  # its MLP's
    image_size: int  # the square images it takes, in pixels
    patch_size: int
    image_token_id: int  # the token the processor repeats where an image's embeddings go
    tokens_per_image: int  # how many of them an image becomes (the projector pools the patches to this many)
    channels: int = 3
    norm_eps: float = 1e-6  # the tower's LayerNorms
    activation: str = "gelu_pytorch_tanh"
    projector_eps: float = 1e-6  # the projector's RMSNorm
    image_attention: str = "bidirectional"  # an image's tokens attend to each other both ways (Gemma 3); or "causal"

    def __post_init__(self) -> None:
        if self.tower not in TOWERS:
            raise ValueError(f"vision tower {self.tower!r} is not supported; supported: {', '.join(TOWERS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"vision activation={self.activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if self.dim % self.n_heads:
            raise ValueError(f"vision hidden size {self.dim} is not a multiple of its {self.n_heads} heads")
        side, pooled = self.image_size // self.patch_size, round(self.tokens_per_image ** 0.5)
        if self.image_size % self.patch_size or pooled * pooled != self.tokens_per_image or side % pooled:
            raise ValueError(f"{self.tokens_per_image} tokens per image do not pool from a {side}x{side} patch grid "
                             f"({self.image_size}-pixel images, {self.patch_size}-pixel patches)")
        if self.image_attention not in ("bidirectional", "causal"):
            raise ValueError(f"image_attention={self.image_attention!r}: bidirectional or causal")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def vision_args(value):
    """``ModelArgs.vision`` as given, or rebuilt by its ``tower`` from the dict a JSON round trip (a native checkpoint)
    leaves: SigLIP's :class:`VisionArgs`, Qwen3.5's ``models.qwen3_5_vision.QwenVisionArgs``."""
    if not isinstance(value, dict):
        return value
    if value.get("tower") == "qwen3_5":
        from waypoint.models.qwen3_5_vision import QwenVisionArgs

        return QwenVisionArgs(**value)
    if value.get("tower") == "gemma4":
        from waypoint.models.gemma4_vision import Gemma4VisionArgs

        return Gemma4VisionArgs(**value)
    return VisionArgs(**value)
