"""Qwen3.5's vision tower, as transformers' ``Qwen3_5VisionModel`` computes it: images of any size in, the merged
image embeddings the language model places at its ``<|image_pad|>`` tokens out.

``forward(pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]) -> [tokens, out_dim]`` where an image's
tokens are its ``t*h*w / merge**2`` patches merged in ``merge x merge`` blocks. transformers' vision model also
returns the unmerged last hidden state (``last_hidden_state``); the language model reads only the merged one
(``pooler_output``), and Qwen3.5 has no deepstack features (Qwen3-VL's), so this returns the merged one alone.

Parameter names (transformers' under ``model.visual.`` on the right, as ``save_pretrained`` writes them)::

    patch_embedding.{weight,bias}          patch_embed.proj      (a Conv3d whose kernel = stride = one patch: here a
                                                                  Linear over the flat patch, the kernel flattened)
    position_embedding.weight              pos_embed             (a square grid, resampled to each image's)
    layers.{i}.norm1.{weight,bias}         blocks.{i}.norm1
    layers.{i}.attn.qkv_proj.*             blocks.{i}.attn.qkv
    layers.{i}.attn.o_proj.*               blocks.{i}.attn.proj
    layers.{i}.norm2.{weight,bias}         blocks.{i}.norm2
    layers.{i}.mlp.{fc1,fc2}.*             blocks.{i}.mlp.linear_fc{1,2}
    merger.norm.{weight,bias}              merger.norm
    merger.{fc1,fc2}.*                     merger.linear_fc{1,2}

(the converter's rules: ``families.vision_rules.qwen_vision_rules``; the tower's keys sit under the model's ``vision.``)
The patch embedding is a
Linear because a Conv3d whose kernel covers its whole input is one: the same sums in another order (within ~1e-7 of
transformers' in fp32), and a plain matmul where cuDNN's 3-D convolutions are slow.

What is computed as transformers does, so that results agree to rounding: the learned positions are bilinearly
resampled (``align_corners=True``) from their ``sqrt(n_positions)`` square grid to each image's patch grid, with
transformers' float32 weights; the 2-D rotary embedding gives the first half of each head's rotated pairs the patch's
row and the second its column, cos/sin and the rotation in float32 whatever the model's dtype (as transformers, so a
float64 tower rotates in float32 too); each frame of each image attends only to itself (transformers' ``cu_seqlens``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.models.args import ACTIVATIONS


@dataclass(frozen=True)
class QwenVisionArgs:
    dim: int  # the tower's width (hidden_size)
    n_layers: int  # depth
    n_heads: int
    hidden_dim: int  # its MLP's (intermediate_size)
    out_dim: int  # the merged tokens' width: the language model's hidden size (out_hidden_size)
    n_positions: int  # learned positions, a square grid (num_position_embeddings)
    patch_size: int = 16
    temporal_patch_size: int = 2  # frames per patch; an image is repeated to fill them
    merge_size: int = 2  # spatial_merge_size: merge x merge patches become one token
    channels: int = 3
    activation: str = "gelu_pytorch_tanh"  # the blocks' MLP; the merger's GELU is always the exact one
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6  # transformers' LayerNorms here, fixed in its code
    image_token_id: int = 0  # the language model's <|image_pad|>, where the merged tokens go
    tower: str = "qwen3_5"  # which tower (ModelArgs.vision: models.vision_args.vision_args rebuilds it by this)
    image_attention: str = "causal"  # Qwen3.5's image tokens attend causally, as text

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"vision activation={self.activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ValueError(f"vision hidden size {self.dim} over {self.n_heads} heads: each head needs a multiple of 4 "
                             "dims (the 2-D rotary embedding)")
        if math.isqrt(self.n_positions) ** 2 != self.n_positions:
            raise ValueError(f"num_position_embeddings={self.n_positions} is not a square grid")

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal_patch_size * self.patch_size ** 2


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.scale = n_heads, (dim // n_heads) ** -0.5
        self.qkv_proj, self.o_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        length = x.shape[0]
        q, k, v = self.qkv_proj(x).view(length, 3, self.n_heads, -1).unbind(1)  # each [length, heads, head_dim]
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(t.dtype) for t in (q, k))
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, length, head_dim]
        out = [F.scaled_dot_product_attention(*qkv, scale=self.scale).transpose(1, 2)  # a frame sees only itself
               for qkv in zip(q.split(seqlens, 2), k.split(seqlens, 2), v.split(seqlens, 2))]
        return self.o_proj(torch.cat(out, dim=1).reshape(length, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, activation) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden_dim), nn.Linear(hidden_dim, dim), activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = VisionAttention(args.dim, args.n_heads)
        self.norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = VisionMLP(args.dim, args.hidden_dim, ACTIVATIONS[args.activation])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm each patch, then ``merge**2`` neighbouring patches (consecutive: the processor orders them so)
    concatenated -> ``out_dim`` through an MLP with exact GELU."""

    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.merged_dim = args.dim * args.merge_size ** 2
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.fc1, self.fc2 = nn.Linear(self.merged_dim, self.merged_dim), nn.Linear(self.merged_dim, args.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x).view(-1, self.merged_dim))))


def patch_rows_cols(grid_thw: torch.Tensor, merge: int, device=None) -> tuple[torch.Tensor, ...]:
    """Each patch's (row, column) in its image and that image's (height, width) in patches, in the processor's
    order: frame by frame, ``merge x merge`` blocks in raster order, raster order within a block."""
    rows, cols, heights, widths = [], [], [], []
    for t, h, w in grid_thw.tolist():
        block = (h // merge, merge, w // merge, merge)
        rows.append(torch.arange(h, device=device).view(-1, merge, 1, 1).expand(block).transpose(1, 2).flatten().repeat(t))
        cols.append(torch.arange(w, device=device).view(1, 1, -1, merge).expand(block).transpose(1, 2).flatten().repeat(t))
        heights.append(torch.full((t * h * w,), h, device=device))
        widths.append(torch.full((t * h * w,), w, device=device))
    return tuple(torch.cat(parts) for parts in (rows, cols, heights, widths))


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2 source rows (or columns) of a ``side``-long grid that position ``index`` of ``size`` samples, and
    their weights: ``F.interpolate(bilinear, align_corners=True)``, in float32 in transformers' order of operations."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class QwenVisionTower(nn.Module):
    """``(pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]) -> [tokens, out_dim]``: all images of a batch
    packed as the processor packs them, their tokens in the same order."""


    INPUTS = ("image_grid_thw",)  # what its forward takes from the processor: each image's patch grid, beside its pixel values
    PROJECTOR = ("merger.",)  # the merger projects into the text's width: the projector, which trains when the tower is frozen
    def __init__(self, args: QwenVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embedding = nn.Linear(args.patch_dim, args.dim)
        self.position_embedding = nn.Embedding(args.n_positions, args.dim)
        self.layers = nn.ModuleList(VisionBlock(args) for _ in range(args.n_layers))
        self.merger = PatchMerger(args)

    def interpolated_positions(self, rows, cols, heights, widths) -> torch.Tensor:
        """Each patch's position embedding, resampled from the learned square grid to its image's grid."""
        side = math.isqrt(self.args.n_positions)
        row_taps, row_weights = _bilinear_taps(rows, heights, side)
        col_taps, col_weights = _bilinear_taps(cols, widths, side)
        taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
        return (self.position_embedding(taps) * weights[:, :, None]).sum(1)

    def rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, 1, head_dim] in float32: a quarter of the head's frequencies, for the row then the
        column, the pair halves repeated (rotate-half layout)."""
        half = self.args.dim // self.args.n_heads // 2  # each axis's rotated dims: head_dim / 4 pairs
        inv_freq = 1.0 / (self.args.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=rows.device) / half))
        freqs = torch.stack([rows, cols], dim=-1)[..., None].float() * inv_freq  # [patches, 2, head_dim / 4]
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        args = self.args
        grid = image_grid_thw.long()
        if pixel_values.dim() != 2 or pixel_values.shape[1] != args.patch_dim:
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: this tower takes [patches, "
                             f"{args.patch_dim}] (channels * temporal_patch_size * patch_size**2)")
        if grid.dim() != 2 or grid.shape[1] != 3 or int(grid.prod(-1).sum()) != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw {grid.tolist()} does not account for the {pixel_values.shape[0]} patches")
        if bool(((grid[:, 1:] % args.merge_size) != 0).any()):
            raise ValueError(f"image_grid_thw {grid.tolist()}: heights and widths must be multiples of {args.merge_size}")
        device = self.position_embedding.weight.device
        if grid.shape[0] == 0:  # a batch without images: no tokens to place
            return pixel_values.new_zeros(0, args.out_dim, dtype=self.patch_embedding.weight.dtype)
        rows, cols, heights, widths = patch_rows_cols(grid, args.merge_size, device)
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        x = x + self.interpolated_positions(rows, cols, heights, widths).to(x.dtype)
        cos, sin = self.rotary(rows, cols)
        seqlens = [h * w for t, h, w in grid.tolist() for _ in range(t)]
        for layer in self.layers:
            x = layer(x, cos, sin, seqlens)
        return self.merger(x)
