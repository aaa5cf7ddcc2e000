"""SigLIP's vision tower (Gemma 3's), as transformers' ``SiglipVisionModel`` computes it, without its pooling head.

Parameter names under the model's ``vision.`` (transformers' on the right)::

    patch_embedding.{weight,bias}          embeddings.patch_embedding     (a Conv2d, stride = kernel = patch)
    position_embedding.weight              embeddings.position_embedding  (one row a patch)
    layers.{i}.norm1.{weight,bias}         encoder.layers.{i}.layer_norm1
    layers.{i}.attn.{q,k,v,o}_proj.*       encoder.layers.{i}.self_attn.{q,k,v,out}_proj
    layers.{i}.norm2.{weight,bias}         encoder.layers.{i}.layer_norm2
    layers.{i}.mlp.{fc1,fc2}.*             encoder.layers.{i}.mlp.{fc1,fc2}
    norm.{weight,bias}                     post_layernorm

Every patch attends to every patch of its image; the images of a batch are independent."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.models.args import ACTIVATIONS
from waypoint.models.vision_args import VisionArgs


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (p(x).view(batch, length, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as transformers
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, dim))


class SiglipMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, activation: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden_dim), nn.Linear(hidden_dim, dim)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipBlock(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = SiglipAttention(args.dim, args.n_heads)
        self.norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = SiglipMLP(args.dim, args.hidden_dim, args.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SiglipVision(nn.Module):
    """``pixel_values`` [images, channels, size, size] -> the last hidden state [images, patches, dim]."""


    INPUTS = ()  # what its forward takes from the processor: the pixel values alone
    PROJECTOR = ()  # Gemma 3's projector is a module of its own (models.image_projector)
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embedding = nn.Conv2d(args.channels, args.dim, kernel_size=args.patch_size, stride=args.patch_size)
        self.position_embedding = nn.Embedding(args.patches_per_side ** 2, args.dim)
        self.layers = nn.ModuleList(SiglipBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        size = self.args.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.args.channels, size, size):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: this tower takes "
                             f"[images, {self.args.channels}, {size}, {size}]")
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)
