"""One optimizer step's forward and backward: the next-token cross-entropy over the supervised positions."""

from __future__ import annotations

import inspect

import torch

from waypoint.models.fused_loss import IGNORE_INDEX, next_token_loss_rows, next_token_loss_sum


# what a batch may hold for the model's forward beside tokens and labels: a packed batch's positions and documents, a
# vision-language batch's images and token types (transformers' names)
MODEL_INPUTS = ("positions", "document_ids", "pixel_values", "token_type_ids", "image_grid_thw", "mm_token_type_ids",
                "image_position_ids")


def model_inputs(batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's ``MODEL_INPUTS``, on ``device``."""
    return {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}


def supervised_tokens(labels: torch.Tensor) -> int:
    """How many positions of ``labels`` [batch, seq] a next-token loss supervises."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def model_loss_sum(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, loss_chunk: int | None = None,
                   **inputs) -> torch.Tensor:
    """The next-token loss sum of ``model`` on ``tokens``: the native model's output projection fused with the loss,
    a chunk of tokens at a time (``loss_chunk=0``: the full logits); a model of your own whose ``forward`` takes no
    ``labels`` returns logits, and the loss is taken from them."""
    if "labels" in inspect.signature(model.forward).parameters:
        return model(tokens, labels=labels, loss_chunk=loss_chunk, **inputs)
    return next_token_loss_sum(model(tokens, **inputs), labels)


def sequence_loss_sums(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor,
                       loss_chunk: int | None = None) -> torch.Tensor:
    """Each sequence's next-token loss sum [batch] (fp32; minus its labels' summed log-probabilities), as
    :func:`model_loss_sum` takes the batch's: the native model's fused path (``per_sequence``), else from the logits
    of a model whose ``forward`` takes no ``labels``."""
    if "labels" in inspect.signature(model.forward).parameters:
        return model(tokens, labels=labels, loss_chunk=loss_chunk, per_sequence=True)
    return next_token_loss_rows(model(tokens), labels)


def forward_backward(model: torch.nn.Module, micro_batches: list[dict], device: torch.device,
                     dist, loss_chunk: int | None = None) -> tuple[float, int, float | None]:
    """One optimizer step's gradients: the mean loss over the supervised tokens of the whole global batch
    (every micro-batch of every rank), whatever the split of each micro-batch over ranks. Returns (that loss,
    the step's tokens, the load-balancing loss of a mixture-of-experts model averaged over micro-batches, or None).

    Each micro-batch's loss sum is divided by the global token count; under FSDP, which averages gradients
    over ranks, it is also multiplied by the number of ranks. ``dist``: a ``waypoint.training.distributed.Distributed``.
    ``loss_chunk``: tokens per chunk of the fused output projection and loss (None: by the vocabulary's size; 0:
    the full logits, as ``fused_loss: false`` asks).
    """
    n_supervised = max(dist.sum(sum(supervised_tokens(b["labels"]) for b in micro_batches)), 1)
    loss_sum, aux_sum, has_aux = 0.0, 0.0, False
    for batch in micro_batches:
        loss = model_loss_sum(model, batch["tokens"].to(device), batch["labels"].to(device), loss_chunk,
                              **model_inputs(batch, device)) / n_supervised
        aux = backward_with_balance(model, loss, dist, batch.get("mask"), len(micro_batches))
        if aux is not None:
            has_aux, aux_sum = True, aux_sum + aux
        loss_sum += loss.item()
    # the samples' own tokens (padding aside, where the collate marks it): what packing raises
    tokens = int(dist.sum(sum(int(b["mask"].sum()) if "mask" in b else b["tokens"].numel() for b in micro_batches)))
    return dist.sum(loss_sum), tokens, aux_sum if has_aux else None


def backward_with_balance(model: torch.nn.Module, loss: torch.Tensor, dist, mask: torch.Tensor | None,
                          micro_batches: int) -> float | None:
    """``loss``'s backward for one of a step's ``micro_batches``, with a mixture-of-experts model's load-balancing loss
    added (weighted by ``router_aux_loss_coef``, averaged over the micro-batches), scaled by the number of ranks
    (FSDP averages gradients over them). Returns this micro-batch's share of the balance loss's value (None for a
    dense model)."""
    total, value = loss, None
    aux = balance_share(model, dist, mask)
    if aux is not None:
        share, whole = aux
        total = loss + model.args.router_aux_loss_coef * share / micro_batches
        value = whole / micro_batches
    (total * dist.world_size).backward()
    return value


def balance_share(model: torch.nn.Module, dist, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, float] | None:
    """A mixture-of-experts model's load-balancing loss (transformers' ``aux_loss``) over the micro-batch of every
    rank, padding left out (``mask``): (this rank's differentiable share, whose sum over ranks is the loss; the loss's
    value). The expert counts and probability sums are summed over ranks first, so N processes train as one with
    the same global batch. None for a dense model."""
    from waypoint.models.balance_loss import balance_loss

    stats = model.aux_stats(mask) if hasattr(model, "aux_stats") else None
    if stats is None:
        return None
    counts, prob_sum, rows = stats
    n_experts = model.args.n_experts
    counts_all, prob_all, rows_all = dist.sum_tensor(counts), dist.sum_tensor(prob_sum), dist.sum(rows)
    # d share / d prob_sum on this rank = d loss / d (global prob_sum): the gradient of the whole batch's loss
    share = balance_loss(counts_all, prob_sum, rows_all, n_experts)
    return share, float(balance_loss(counts_all, prob_all, rows_all, n_experts))
