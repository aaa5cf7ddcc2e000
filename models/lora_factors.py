"""What every LoRA module shares: two factors built on the meta device (drawing no random numbers), then placed
beside the base weight and initialised once, as PEFT initialises them (A Kaiming-uniform with a = sqrt(5), B zeros,
so the adapted model starts equal to the base). The same draws whether the base is already loaded or still on the
meta device (``initial_lora_weights`` is what ``models.lora.init_adapters`` uses for the latter)."""

from __future__ import annotations

import math

import torch
from torch import nn


def initial_lora_weights(lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's initialisation as whole CPU tensors shaped like ``lora_a`` / ``lora_b``: A Kaiming-uniform
    (a = sqrt(5)) from the global generator, B zeros."""
    a = torch.empty(lora_a.shape, dtype=lora_a.dtype)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as peft.tuners.lora.LoraLayer
    return a, torch.zeros(lora_b.shape, dtype=lora_b.dtype)


class LoRAFactors(nn.Module):
    """Base of the LoRA modules: ``lora_A`` / ``lora_B`` (``nn.Linear`` without bias) and the ``disabled`` switch."""

    lora_A: nn.Linear
    lora_B: nn.Linear

    def place_factors(self, like: torch.Tensor) -> None:
        """Give the meta-built factors memory beside ``like`` (the base weight) and their initial values; nothing
        while the base is still on the meta device."""
        self.disabled = False  # True: the base alone (``models.lora.adapters_disabled``)
        if not like.is_meta:
            self.lora_A.to_empty(device=like.device)
            self.lora_B.to_empty(device=like.device)
            self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        with torch.no_grad():
            a, b = initial_lora_weights(self.lora_A.weight, self.lora_B.weight)
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.copy_(b)
