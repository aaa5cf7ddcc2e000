"""Gemma 4's per-layer embeddings (PLE, the E2B/E4B models): a second, narrow embedding of each token for every layer,
added into that layer's residual stream through a small gated projection.

Native parameters (transformers' names after the arrow)::

    per_layer.embeddings.weight  [per_layer_vocab, n_layers * per_layer_dim]   <- model.embed_tokens_per_layer.weight
    per_layer.model_proj.weight  [n_layers * per_layer_dim, dim]               <- model.per_layer_model_projection.weight
    per_layer.norm.weight        [per_layer_dim]                               <- model.per_layer_projection_norm.weight
    layers.{i}.per_layer_input.input_gate.weight  [per_layer_dim, dim]         <- model.layers.{i}.per_layer_input_gate.weight
    layers.{i}.per_layer_input.input_proj.weight  [dim, per_layer_dim]         <- model.layers.{i}.per_layer_projection.weight
    layers.{i}.per_layer_input.norm.weight        [dim]                        <- model.layers.{i}.post_per_layer_input_norm.weight

As ``Gemma4TextModel.get_per_layer_inputs`` / ``project_per_layer_inputs`` and ``Gemma4TextDecoderLayer`` compute them:
each layer's input is ``(norm(model_proj(h) / sqrt(dim)) + embeddings(tokens) * sqrt(per_layer_dim)) / sqrt(2)``, ``h``
the scaled token embeddings; after its MLP a layer adds ``norm(input_proj(act(input_gate(h)) * input))``. The table is by far
the model's largest tensor (E4B: 262144 x 42 * 256): it is looked up, never copied or multiplied as a whole.
"""

from __future__ import annotations

import torch
from torch import nn

from waypoint.models.args import ACTIVATIONS, ModelArgs
from waypoint.models.attention import RMSNorm


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` times ``scale`` rounded to fp32, then to x's dtype (as transformers' scaled embeddings)."""
    return x * torch.tensor(scale, dtype=torch.float32, device=x.device).to(x.dtype)


class PerLayerEmbeddings(nn.Module):
    """``(tokens [b, s], h [b, s, dim]) -> [b, s, n_layers, per_layer_dim]``: every layer's extra input."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_layers, self.width, self.dim = args.n_layers, args.per_layer_dim, args.dim
        rows, cols = args.per_layer_vocab_size or args.vocab_size, args.n_layers * args.per_layer_dim
        # an explicit (empty) weight: no init on the meta device (the table is the model's largest tensor)
        self.embeddings = nn.Embedding(rows, cols, _weight=torch.empty(rows, cols))
        if not self.embeddings.weight.is_meta:
            nn.init.normal_(self.embeddings.weight)
        self.model_proj = nn.Linear(args.dim, cols, bias=False)
        self.norm = RMSNorm(args.per_layer_dim, args.norm_eps, args.norm_plus_one, args.norm_fp32_weight)

    def forward(self, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        looked_up = _scaled(self.embeddings(tokens), self.width ** 0.5).unflatten(-1, (self.n_layers, self.width))
        projected = (self.model_proj(h) * self.dim ** -0.5).unflatten(-1, (self.n_layers, self.width))
        return (self.norm(projected) + looked_up) * 2.0 ** -0.5


class PerLayerInput(nn.Module):
    """A layer's residual update from its per-layer input: ``(h [b, s, dim], input [b, s, width]) -> [b, s, dim]``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_gate = nn.Linear(args.dim, args.per_layer_dim, bias=False)
        self.input_proj = nn.Linear(args.per_layer_dim, args.dim, bias=False)
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_plus_one, args.norm_fp32_weight)
        self.act = ACTIVATIONS[args.activation]

    def forward(self, h: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        return self.norm(self.input_proj(self.act(self.input_gate(h)) * per_layer_input))
