"""LoRA on a mixture-of-experts layer's stacked expert weights, in PEFT's form for parameter targets.

PEFT adapts a 3-D parameter ``[E, in, out]`` (``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", ...])``,
its ``ParamWrapper``) with one ``lora_A`` of ``[r * E, in]`` and one ``lora_B`` of ``[out, r * E]``: expert e's
factors are ``A_e = lora_A[e * r:(e + 1) * r]`` (rows expert-major) and ``B_e = lora_B[:, e::E]`` (columns
rank-major), and its update is ``alpha / r * B_e @ A_e`` (``[out, in]`` here, the native orientation; PEFT adds
its transpose to its ``[in, out]`` weight). :class:`LoRAExperts` holds exactly those two tensors, so PEFT's
initialisation, keys and shapes carry over unchanged, and the rows of ``lora_B`` are the output rows of the HF
parameter: for gpt-oss's ``gate_up_proj`` gate and up interleaved (row ``2j`` is gate unit j, ``2j + 1`` up unit j).

Native targets, by the MoE weights they adapt (``EXPERT_TARGETS``): ``experts_gate_up`` (``w1`` from the even
rows of the update, ``w3`` from the odd ones) and ``experts_down`` (``w2``). The MoE calls :meth:`grouped` /
:meth:`batched` / :meth:`expert` from its three implementations; the update is added to the projection's output
(``x @ (W + dW).T = x @ W.T + s * (x @ A_e.T) @ B_e.T``), never materialised during training.
"""

from __future__ import annotations

import torch
from torch import nn

from waypoint.errors import CheckpointError
from waypoint.models.lora_factors import LoRAFactors

# native target -> (the MoE weight it adapts, the first of its rows in the update, the step between them), ...
EXPERT_TARGETS = {"experts_gate_up": (("w1", 0, 2), ("w3", 1, 2)), "experts_down": (("w2", 0, 1),)}
HALF = (torch.bfloat16, torch.float16)


class LoRAExperts(LoRAFactors):
    """The low-rank update of one stacked expert weight (or, for ``experts_gate_up``, of two interleaved ones)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, rank: int, alpha: float,
                 like: torch.Tensor, dropout: float = 0.0) -> None:
        super().__init__()
        if rank < 1:
            raise CheckpointError(f"lora rank must be at least 1, got {rank}")
        if dropout:
            raise CheckpointError("lora.dropout must be 0 with expert targets (PEFT's ParamWrapper refuses dropout: the "
                                  "input cannot be factored out of an update to a stacked weight)")
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.rank, self.alpha, self.dropout_p = int(rank), float(alpha), 0.0
        self.scaling = self.alpha / self.rank
        dtype = torch.float32 if like.dtype in HALF else like.dtype
        self.lora_A = nn.Linear(in_features, self.rank * n_experts, bias=False, device="meta", dtype=dtype)
        self.lora_B = nn.Linear(self.rank * n_experts, out_features, bias=False, device="meta", dtype=dtype)
        self.place_factors(like)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [E, r, in], B [E, out, r]): each expert's factors."""
        a = self.lora_A.weight.view(self.n_experts, self.rank, self.in_features)
        b = self.lora_B.weight.view(self.out_features, self.rank, self.n_experts).permute(2, 0, 1)
        return a, b

    def delta_weight(self) -> torch.Tensor:
        """``alpha / r * B_e @ A_e`` for every expert, ``[E, out, in]`` in fp32 (PEFT's merge, transposed)."""
        a, b = self.factors()
        return torch.bmm(b.float(), a.float()) * self.scaling

    # -- the update of a projection's output, for each of the MoE's implementations ---------------------------
    def grouped(self, xs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """``xs`` [S, in]: assignments sorted by expert, expert e's rows ending at ``ends[e]`` -> [S, out]. One small
        product pair per expert (one host sync for the offsets): any dtype, any device."""
        a, b = self.factors()
        x = xs.to(a.dtype)
        bounds = [0] + ends.tolist()
        parts = [(x[start:end] @ a[e].T) @ b[e].T for e, (start, end) in enumerate(zip(bounds, bounds[1:]))]
        return (torch.cat(parts) * self.scaling).to(xs.dtype)

    def batched(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` [E, capacity, in] -> [E, capacity, out]."""
        a, b = self.factors()
        return (torch.bmm(torch.bmm(buf.to(a.dtype), a.transpose(1, 2)), b.transpose(1, 2)) * self.scaling).to(buf.dtype)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s update for its tokens ``x`` [n, in] -> [n, out]."""
        a, b = self.factors()
        return (((x.to(a.dtype) @ a[e].T) @ b[e].T) * self.scaling).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, in={self.in_features}, out={self.out_features}, rank={self.rank}, "
                f"alpha={self.alpha}")


def add_expert_lora(moe: nn.Module, target: str, rank: int, alpha: float, dropout: float = 0.0) -> LoRAExperts:
    """Attach ``target``'s adapter (``EXPERT_TARGETS``) to a MoE module, frozen weights untouched."""
    if target == "experts_gate_up":
        module = LoRAExperts(moe.n_experts, moe.dim, 2 * moe.hidden_dim, rank, alpha, moe.w1, dropout)
    else:
        module = LoRAExperts(moe.n_experts, moe.hidden_dim, moe.dim, rank, alpha, moe.w2, dropout)
    setattr(moe, target, module)
    return module


def expert_update(module: LoRAExperts | None, out: torch.Tensor, update) -> torch.Tensor:
    """``out`` plus ``update(module)`` where the adapter is there and on (``update``: one of its three methods)."""
    return out if module is None or module.disabled else out + update(module)


def adapted_rows(key: str) -> tuple[str, int, int] | None:
    """For a MoE weight's key (``layers.0.moe.w3``): (its adapter's module path, first row, row step) should an
    ``experts_*`` adapter exist, else None."""
    owner, _, leaf = key.rpartition(".")
    for target, weights in EXPERT_TARGETS.items():
        for name, first, step in weights:
            if leaf == name and owner.endswith("moe"):
                return f"{owner}.{target}", first, step
    return None


def merge_expert_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                        first: int, step: int) -> torch.Tensor:
    """``weight`` [E, rows, in] plus rows ``first::step`` of the experts' update, in fp32, cast back to its dtype:
    PEFT's ``merge_and_unload()`` to the bit (the update's fp32 product first, then the scaling, then the sum)."""
    n_experts = weight.shape[0]
    rank = lora_a.shape[0] // n_experts
    a = lora_a.float().view(n_experts, rank, lora_a.shape[1])
    b = lora_b.float().view(lora_b.shape[0], rank, n_experts).permute(2, 0, 1)
    delta = (torch.bmm(b, a) * scaling)[:, first::step]
    return (weight.float() + delta).to(weight.dtype)
