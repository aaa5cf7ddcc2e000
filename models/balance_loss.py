"""The Switch-Transformer load-balancing loss of a mixture-of-experts model, as transformers computes it
(``load_balancing_loss_func``), and the per-expert sums it is made of, which add up across ranks and micro-batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

def load_balancing_loss(router_logits: Sequence[torch.Tensor] | torch.Tensor, n_experts: int, top_k: int) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss over all layers' router logits (each [tokens, n_experts]), equal to
    transformers' ``load_balancing_loss_func(router_logits, n_experts, top_k, attention_mask=None)``:
    ``n_experts * sum_e f_e * P_e`` with ``f_e`` the number of top-k assignments to expert e per token and ``P_e``
    its mean router probability, over the layers' tokens concatenated. Accumulated layer by layer as
    transformers does (the softmax in the logits' dtype, the sums in fp32), so the result agrees bitwise.
    Differentiable with respect to the logits (through ``P``). Multiply by ``router_aux_loss_coef`` for the
    training loss."""
    counts, prob_sum, rows = load_balancing_stats(router_logits, n_experts, top_k)
    return balance_loss(counts, prob_sum, rows, n_experts)


def balance_loss(counts: torch.Tensor, prob_sum: torch.Tensor, rows: float, n_experts: int) -> torch.Tensor:
    """``n_experts * sum_e (counts_e / rows) * (prob_sum_e / rows)``, in transformers' order of operations. Summed
    over ranks (or micro-batches), ``counts``, ``prob_sum`` and ``rows`` give the loss of the whole batch."""
    return torch.sum((counts / rows) * (prob_sum / rows).unsqueeze(0)) * n_experts


def load_balancing_stats(router_logits: Sequence[torch.Tensor] | torch.Tensor, n_experts: int, top_k: int,
                         mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(top-k assignments per expert [E], router probabilities summed per expert [E] (differentiable), rows) over
    all layers' router logits: the sums ``balance_loss`` needs, which add up across ranks. ``mask`` (bool, one per
    token of a layer's logits): only those tokens count, as with transformers' ``attention_mask`` (padding aside)."""
    if isinstance(router_logits, torch.Tensor):
        router_logits = (router_logits,)
    router_logits = list(router_logits)
    if not router_logits:
        raise ValueError("load_balancing_loss needs at least one layer's router logits")
    device = router_logits[0].device
    counts = torch.zeros(n_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(n_experts, dtype=torch.float32, device=device)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits.reshape(-1, n_experts).to(device), dim=-1)
        if mask is not None:
            probs = probs[mask.reshape(-1).to(device)]
        _, selected = torch.topk(probs, top_k, dim=-1)
        # histc as transformers (no host sync, unlike bincount on CUDA; deterministic with a float input on CPU and
        # MPS, an integer one on CUDA); bins [e, e + 1) for e < n_experts
        histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
        counts = counts + torch.histc(selected.reshape(-1).to(histc_dtype), bins=n_experts, min=0, max=n_experts)
        prob_sum = prob_sum + probs.float().sum(dim=0)
        rows += probs.shape[0]
    return counts, prob_sum, rows
