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
    tokens_per_image: int  # mm_tokens_per_image as the config gives it; an image becomes ``image_tokens`` of them
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
            raise ValueError(f"vision_config.hidden_size {self.dim} is not a multiple of its num_attention_heads "
                             f"{self.n_heads}")
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size:
            raise ValueError(f"vision_config.image_size {self.image_size} is not a multiple of its patch_size "
                             f"{self.patch_size}")
        if self.tokens_per_image < 1 or int(self.tokens_per_image ** 0.5) > side:  # transformers': a 0 kernel
            raise ValueError(f"mm_tokens_per_image={self.tokens_per_image} does not pool from vision_config's "
                             f"{side}x{side} patch grid (image_size {self.image_size}, patch_size {self.patch_size}): "
                             f"set it to at least 1 and at most {side * side} (one token a patch)")
        if self.image_attention not in ("bidirectional", "causal"):
            raise ValueError(f"image_attention={self.image_attention!r}: bidirectional or causal")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool_kernel(self) -> int:
        """The projector's average-pooling kernel (and stride), as transformers' ``Gemma3MultiModalProjector``: the
        patches per side over ``int(sqrt(tokens_per_image))``, floored."""
        return self.patches_per_side // int(self.tokens_per_image ** 0.5)

    @property
    def image_tokens(self) -> int:
        """The tokens an image becomes (what the processor's ``image_seq_length`` must give it): ``tokens_per_image``
        when that is a square whose root divides the patch grid, else what the pooling leaves, as transformers (2 on
        a 4x4 grid: a 4x4 kernel, 1 token; 4 on a 5x5 grid: a 2x2 kernel over the first 4x4 patches, 4 tokens)."""
        return (self.patches_per_side // self.pool_kernel) ** 2


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
