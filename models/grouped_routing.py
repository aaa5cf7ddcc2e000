"""DeepSeek's routers (``MoE.route`` with ``routing`` "sigmoid_grouped" or "softmax_grouped"), each step as
transformers' ``DeepseekV3TopkRouter`` / ``DeepseekV2TopkRouter`` takes it, so that the chosen experts are the same.

- ``sigmoid_grouped`` (DeepSeek-V3, ``noaux_tc``): router logits in fp32, ``scores = sigmoid(logits)``; for choosing
  only, ``scores + e_score_correction_bias`` (a per-expert buffer, in the checkpoint, never trained by gradients); the
  experts in ``n_groups`` groups, each scored by the sum of its two best biased scores, all but the best ``topk_groups``
  groups masked to -inf; the top-k of what is left. The weights are the *unbiased* scores of those experts,
  renormalised (``normalize``, with transformers' 1e-20 in the denominator), times ``routed_scaling``.
- ``softmax_grouped`` (DeepSeek-V2): router logits in fp32, a softmax over all experts; with ``n_groups`` > 1
  (``group_limited_greedy``) each group is scored by its best expert and the experts outside the best ``topk_groups``
  groups are set to 0; the top-k probabilities, times ``routed_scaling`` (transformers' V2 never renormalises: its
  ``norm_topk_prob`` is read by no code, and the family leaves ``normalize`` off). ``n_groups`` 1 is ``greedy``.

Both keep the weights in fp32 (the experts' outputs are weighted in fp32 and rounded, as transformers does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def limit_to_groups(scores: torch.Tensor, n_groups: int, topk_groups: int, top2: bool, fill: float) -> torch.Tensor:
    """``scores`` [tokens, E] with every expert outside each token's ``topk_groups`` best groups (of ``n_groups``
    consecutive experts) replaced by ``fill``; a group's score is its best two experts' sum (``top2``) or its best."""
    if n_groups <= 1:
        return scores
    tokens, n_experts = scores.shape
    grouped = scores.view(tokens, n_groups, n_experts // n_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if top2 else grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_groups, n_experts // n_groups).reshape(-1, n_experts)
    return scores.masked_fill(~score_mask.bool(), fill)


def grouped_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, routing: str, n_groups: int, topk_groups: int,
                  normalize: bool, routed_scaling: float, correction_bias: torch.Tensor | None = None,
                  replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [tokens, dim], the router's ``weight`` [E, dim] -> (fp32 logits [tokens, E], fp32 weights [tokens, k],
    expert indices [tokens, k]); ``replay``: the experts to take instead of choosing (their weights still computed)."""
    logits = F.linear(x.float(), weight.float())
    if routing == "sigmoid_grouped":
        scores = logits.sigmoid()
        if replay is None:
            choice = scores + correction_bias if correction_bias is not None else scores
            choice = limit_to_groups(choice, n_groups, topk_groups, top2=True, fill=float("-inf"))
            replay = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, replay)
    elif routing == "softmax_grouped":
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if replay is None:
            weights, replay = torch.topk(limit_to_groups(scores, n_groups, topk_groups, top2=False, fill=0.0), k=top_k,
                                         dim=-1, sorted=False)
        else:
            weights = scores.gather(1, replay)
    else:
        raise ValueError(f"routing={routing!r} is not a grouped routing")
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * routed_scaling, replay
