"""The keys and values of the tokens seen so far, per layer, for generation one token at a time.

``Transformer.forward(tokens, cache=cache)`` runs ``tokens`` as positions ``cache.length ...`` onwards: each layer
appends its new keys and values (after RoPE) and attends over all of them, so a step costs one token's work.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0  # tokens cached (the position the next token takes)
        self.position_offset = 0  # what mRoPE's images took off the next token's position (models.mrope: the delta)
        # linear-attention layers (Gated DeltaNet): (the convolution's last inputs, the delta rule's state)
        self.states: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values [batch, kv_heads, seq, head_dim] with the new ones after them."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def rope_rows(self, table: torch.Tensor, new: int, offset: int = 0) -> torch.Tensor:
        """The rotary rows of the ``new`` tokens that follow the cached ones (``offset``: mRoPE's delta)."""
        return table[self.length + offset:]

    def advance(self, new: int) -> None:
        """``new`` tokens were appended to every layer."""
        self.length += new

    def mask(self, new: int, window: int | None, device=None) -> torch.Tensor:
        """[new, length + new] bool: the new tokens attend every earlier token and themselves, causally, and with a
        ``window`` only the last ``window`` of them."""
        i = torch.arange(self.length, self.length + new, device=device)[:, None]
        j = torch.arange(self.length + new, device=device)[None, :]
        allowed = j <= i
        return allowed & (j > i - window) if window is not None else allowed
