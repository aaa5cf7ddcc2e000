"""Gemma 4's vision tower and its embedder into the text's width, as transformers' ``Gemma4VisionModel`` then
``Gemma4MultimodalEmbedder`` compute them (``Gemma4Model.get_image_features``): images of any size in, the embeddings
the language model places at its ``<|image|>`` tokens out.

``forward(pixel_values [images, patches, 3*P*P], image_position_ids [images, patches, 2]) -> [tokens, out_dim]``, both
as the processor gives them (``vision.gemma4_images``): each image's patches in raster order, (x, y) each patch's
column and row, padded to one length with (-1, -1). An image of h x w patches becomes ``h*w / k**2`` tokens
(k = ``pooling_kernel_size``: each k x k block of patches averaged), in raster order, the images one after another.

Parameter names (transformers' on the right, under ``model.vision_tower.``; the last under ``model.embed_vision.``)::

    patch_embedding.weight                     patch_embedder.input_proj               (no bias)
    position_embedding                         patch_embedder.position_embedding_table [2, n_positions, dim]: x's, y's
    layers.{i}.sa_norm.weight                  encoder.layers.{i}.input_layernorm
    layers.{i}.attn.{q,k,v,o}_proj.weight      encoder.layers.{i}.self_attn.{q,k,v,o}_proj.linear
    layers.{i}.attn.{q,k}_norm.weight          encoder.layers.{i}.self_attn.{q,k}_norm
    layers.{i}.post_attn_norm.weight           encoder.layers.{i}.post_attention_layernorm
    layers.{i}.mlp_norm.weight                 encoder.layers.{i}.pre_feedforward_layernorm
    layers.{i}.mlp.{gate,up,down}_proj.weight  encoder.layers.{i}.mlp.{gate,up,down}_proj.linear
    layers.{i}.post_mlp_norm.weight            encoder.layers.{i}.post_feedforward_layernorm
    std_bias, std_scale                        std_bias, std_scale        (buffers, with ``standardize``)
    projection.weight                          embedding_projection       (model.embed_vision.; no bias)

With ``clipped_linears`` (``use_clipped_linears``) each of the seven linears also holds four scalar buffers,
``{input,output}_{min,max}`` (transformers' beside its ``linear``): the input clamped before, the output after.
(The converter's rules: ``families.gemma4_vision_rules``; everything sits under the native model's ``vision.``.)

What is computed as transformers does, so that results agree to rounding: pixels scaled to [-1, 1] by ``2 * (x - 0.5)``
here (the processor only rescales); a patch's position embedding is its column's row of table 0 plus its row's of
table 1; the 2-D rotary embedding turns the first half of each head by the column, the second by the row (rotate-half
within each half), cos/sin in float32 then cast to the model's dtype; q and k RMS-normed per head with weights, v
without, attention scale 1.0; sandwich norms around attention and MLP (Gemma 4's RMSNorm: ``weight * x``, in float32,
``models.attention.RMSNorm(fp32_weight=True)``); an image's patches attend only to each other (transformers' padding
mask); the pooled tokens are scaled by ``sqrt(dim)`` and standardized in (at least) float32, then a weightless RMSNorm
and the projection. Padding never enters: the tower works on the images' real patches only, packed.

In the language model (transformers' ``Gemma4Model.forward``) these rows replace the image tokens' embeddings as they
are (the text's embeddings are scaled by ``sqrt(hidden)``, these are not); positions stay 1-D, one a token; every
placeholder (``placeholder_ids``: image, video, audio), with its media or without, is looked up as the pad token
(``pad_token_id``) in the embeddings and the per-layer ones, the per-layer part projected from the embeddings seeing the
placed image rows; attention over image tokens as ``image_attention`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.models.args import ACTIVATIONS
from waypoint.models.attention import RMSNorm

IMAGE_ATTENTION = ("causal", "sliding_bidirectional")


@dataclass(frozen=True)
class Gemma4VisionArgs:
    dim: int  # the tower's width (hidden_size)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int  # its MLP's (intermediate_size)
    out_dim: int  # the embedder's output: the language model's hidden size
    n_positions: int = 10240  # position_embedding_size: rows of each axis's table
    patch_size: int = 16
    pooling_kernel_size: int = 3  # k: each k x k block of patches becomes one token
    activation: str = "gelu_pytorch_tanh"
    rope_theta: float = 100.0
    norm_eps: float = 1e-6  # every RMSNorm's, the embedder's too
    clipped_linears: bool = False  # use_clipped_linears: the linears clamp their inputs and outputs (stored bounds)
    standardize: bool = False  # the pooled tokens (x - std_bias) * std_scale
    image_token_id: int = 0  # the language model's <|image|>, where the tokens go
    tower: str = "gemma4"  # which tower (ModelArgs.vision is rebuilt by this)
    # how the language model's image tokens attend (text_config.use_bidirectional_attention): "causal" (null, the
    # default) as text; "sliding_bidirectional" ("vision"): an image's tokens see each other both ways in the sliding
    # window layers only (inside their window), the full-attention layers staying causal
    image_attention: str = "causal"
    pad_token_id: int = 0  # what every placeholder is looked up as (transformers' Gemma4Model)
    # the other placeholders (Gemma4Config's video_token_id, audio_token_id; None: none), looked up as the pad token
    # like image_token_id whether or not their media came (this model reads no video or audio)
    video_token_id: int | None = 258884
    audio_token_id: int | None = 258881

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"vision activation={self.activation!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim={self.head_dim}: the 2-D rotary embedding needs a multiple of 4")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"vision: {self.n_heads} heads over {self.n_kv_heads} key/value heads")
        if self.image_attention not in IMAGE_ATTENTION:
            raise ValueError(f"image_attention={self.image_attention!r}: one of {', '.join(IMAGE_ATTENTION)}")

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The tokens the language model looks up as ``pad_token_id``: image, video and audio placeholders."""
        return tuple(i for i in (self.image_token_id, self.video_token_id, self.audio_token_id) if i is not None)


class ClippedLinear(nn.Linear):
    """A Linear without bias; with ``clipped``, its input and output clamped to stored bounds (buffers, +-inf until a
    checkpoint sets them), as ``Gemma4ClippableLinear``. LoRA on it keeps the clamps (``models.lora.ClippedLoRALinear``)."""

    BOUNDS = ("input_min", "input_max", "output_min", "output_max")

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for name in self.BOUNDS:
                self.register_buffer(name, torch.tensor(float("-inf") if name.endswith("_min") else float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return super().forward(x)
        x = super().forward(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(x, self.output_min, self.output_max)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each half of the head (column's, row's) rotated on its own, rotate-half layout within it."""
    out = []
    for part, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1)):
        a, b = part.chunk(2, -1)
        out.append(part * c + torch.cat((-b, a), -1) * s)
    return torch.cat(out, -1)


class VisionAttention(nn.Module):
    def __init__(self, args: Gemma4VisionArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        clip = args.clipped_linears
        self.q_proj = ClippedLinear(args.dim, args.n_heads * args.head_dim, clip)
        self.k_proj = ClippedLinear(args.dim, args.n_kv_heads * args.head_dim, clip)
        self.v_proj = ClippedLinear(args.dim, args.n_kv_heads * args.head_dim, clip)
        self.o_proj = ClippedLinear(args.n_heads * args.head_dim, args.dim, clip)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, fp32_weight=True)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, fp32_weight=True)
        self.v_norm = RMSNorm(args.head_dim, args.norm_eps, fp32_weight=True, weight=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q = _rotate(self.q_norm(self.q_proj(x).view(n, self.n_heads, -1)), cos, sin)
        k = _rotate(self.k_norm(self.k_proj(x).view(n, self.n_kv_heads, -1)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(n, self.n_kv_heads, -1))
        if self.n_kv_heads != self.n_heads:  # transformers' repeat_kv: query head j reads key/value head j // groups
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, patches, head_dim]
        out = [F.scaled_dot_product_attention(*qkv, scale=1.0).transpose(1, 2)  # an image sees only itself
               for qkv in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))]
        return self.o_proj(torch.cat(out, dim=1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, args: Gemma4VisionArgs) -> None:
        super().__init__()
        clip = args.clipped_linears
        self.gate_proj = ClippedLinear(args.dim, args.hidden_dim, clip)
        self.up_proj = ClippedLinear(args.dim, args.hidden_dim, clip)
        self.down_proj = ClippedLinear(args.hidden_dim, args.dim, clip)
        self.act = ACTIVATIONS[args.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, args: Gemma4VisionArgs) -> None:
        super().__init__()
        self.sa_norm, self.post_attn_norm, self.mlp_norm, self.post_mlp_norm = (
            RMSNorm(args.dim, args.norm_eps, fp32_weight=True) for _ in range(4))
        self.attn, self.mlp = VisionAttention(args), VisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.sa_norm(x), cos, sin, lengths))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))


class Gemma4VisionTower(nn.Module):
    """``(pixel_values [images, patches, 3*P*P], image_position_ids [images, patches, 2]) -> [tokens, out_dim]``: the
    tower, its pooling and the embedder, the images' tokens one after another (see the module doc)."""


    INPUTS = ("image_position_ids",)  # what its forward takes from the processor: each patch's (x, y), beside its pixel values
    PROJECTOR = ("projection.",)  # the embedder into the text's width: the projector, which trains when the tower is frozen
    def __init__(self, args: Gemma4VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embedding = nn.Linear(args.patch_dim, args.dim, bias=False)
        self.position_embedding = nn.Parameter(torch.ones(2, args.n_positions, args.dim))
        self.layers = nn.ModuleList(VisionBlock(args) for _ in range(args.n_layers))
        if args.standardize:
            self.register_buffer("std_bias", torch.zeros(args.dim))
            self.register_buffer("std_scale", torch.ones(args.dim))
        self.embed_norm = RMSNorm(args.dim, args.norm_eps, fp32_weight=True, weight=False)
        self.projection = nn.Linear(args.dim, args.out_dim, bias=False)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, 1, head_dim]: the column's angles (twice), then the row's (twice), in float32."""
        half = self.args.head_dim // 2  # each axis's share of the head; head_dim / 4 frequencies
        exponents = torch.arange(0, half, 2, dtype=torch.float, device=positions.device) / half
        inv_freq = 1.0 / (self.args.rope_theta ** exponents)
        angles = positions[..., None].float() * inv_freq  # [patches, 2, head_dim / 4]
        angles = torch.cat([angles[:, 0], angles[:, 0], angles[:, 1], angles[:, 1]], dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor) -> torch.Tensor:
        args, k = self.args, self.args.pooling_kernel_size
        if pixel_values.dim() != 3 or pixel_values.shape[-1] != args.patch_dim:
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: this tower takes [images, patches, "
                             f"{args.patch_dim}] (3 * patch_size**2)")
        if image_position_ids.shape != (*pixel_values.shape[:2], 2):
            raise ValueError(f"image_position_ids of shape {tuple(image_position_ids.shape)} for pixel_values of shape "
                             f"{tuple(pixel_values.shape)}: one (x, y) per patch")
        if pixel_values.shape[0] == 0:
            return self.projection.weight.new_zeros(0, args.out_dim)
        real = ~(image_position_ids == -1).all(-1)  # transformers' padding: both coordinates -1
        positions = image_position_ids[real].long()  # [patches, 2], the images' real patches packed
        lengths = real.sum(1).tolist()
        sides = (image_position_ids.amax(1) + 1).tolist()  # each image's (width, height) in patches
        for n, (width, height) in zip(lengths, sides):
            if n != width * height or width % k or height % k or max(width, height) > args.n_positions:
                raise ValueError(f"an image of {n} patches, {width}x{height}: the processor gives whole {k}x{k} blocks "
                                 f"of patches, at most {args.n_positions} a side (image_position_ids as it makes them)")
        widths = [int(width) for width, _ in sides]
        x = self.patch_embedding((2 * (pixel_values[real] - 0.5)).to(self.patch_embedding.weight.dtype))
        x = x + (self.position_embedding[0][positions[:, 0]] + self.position_embedding[1][positions[:, 1]])
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, lengths)
        return self.projection(self.embed_norm(self.pool(x, positions, lengths, widths)))

    def pool(self, x: torch.Tensor, positions: torch.Tensor, lengths: list[int], widths: list[int]) -> torch.Tensor:
        """Each k x k block of an image's patches averaged into one token (raster order), times ``sqrt(dim)``, then
        standardized: at least float32 from the sum on, then back in ``x``'s dtype (transformers' order)."""
        k = self.args.pooling_kernel_size
        compute = torch.promote_types(x.dtype, torch.float32)
        counts = [n // k ** 2 for n in lengths]
        image = torch.arange(len(lengths), device=x.device).repeat_interleave(torch.tensor(lengths, device=x.device))
        first = torch.tensor([0] + counts[:-1], device=x.device).cumsum(0)[image]  # each patch's image's first token
        blocks_wide = torch.tensor(widths, device=x.device)[image] // k
        block = positions // k
        token = first + block[:, 0] + blocks_wide * block[:, 1]  # the patch's block, raster order within its image
        pooled = torch.zeros(sum(counts), x.shape[-1], dtype=compute, device=x.device)
        pooled = pooled.index_add(0, token, x.to(compute) / k ** 2).to(x.dtype)
        pooled = pooled.to(compute) * self.args.dim ** 0.5
        if self.args.standardize:
            pooled = (pooled - self.std_bias.to(compute)) * self.std_scale.to(compute)
        return pooled.to(x.dtype)
