"""Gemma 3's multimodal projector: the tower's patches average-pooled (``VisionArgs.pool_kernel``, to ``image_tokens``
an image), RMS-normed (Gemma's ``1 + weight``) and multiplied by one [vision dim, text dim] matrix, as transformers'
``Gemma3MultiModalProjector``.

Parameter names under the model's ``projector.``: ``norm.weight`` (``mm_soft_emb_norm.weight``) and ``weight``
(``mm_input_projection_weight``, kept [vision dim, text dim] as transformers keeps it: no transpose on disk). LoRA on the
matrix: ``models.lora_vision.LoRAProjector``, which overrides :meth:`ImageProjector.project`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.models.attention import RMSNorm
from waypoint.models.vision_args import VisionArgs


class ImageProjector(nn.Module):
    def __init__(self, args: VisionArgs, text_dim: int) -> None:
        super().__init__()
        self.args = args
        self.norm = RMSNorm(args.dim, args.projector_eps, plus_one=True)
        self.weight = nn.Parameter(torch.zeros(args.dim, text_dim))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision dim] -> [images, image_tokens, text dim], in the patches' dtype."""
        images, _, dim = patches.shape
        side, kernel = self.args.patches_per_side, self.args.pool_kernel
        grid = patches.transpose(1, 2).reshape(images, dim, side, side).contiguous()
        tokens = F.avg_pool2d(grid, kernel_size=kernel, stride=kernel).flatten(2).transpose(1, 2)
        return self.project(self.norm(tokens)).type_as(patches)

    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        """The normed tokens [..., vision dim] into the text's width: ``tokens @ weight``."""
        return torch.matmul(tokens, self.weight)
