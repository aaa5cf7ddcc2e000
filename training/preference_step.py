"""A preference-tuning step: chosen and rejected completions through the model in one forward, each completion's
summed label log-probs from the fused output projection (``sequence_loss_sums``: never the full logits), the loss
of ``waypoint.training.preference_loss`` against the reference's log-probs computed once before training
(:func:`reference_pass`), and TRL's metrics summed over the global batch."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

import torch
from torch.utils.data import Dataset

from waypoint.data.collate import preference_collate
from waypoint.training.fsdp import reshard
from waypoint.training.loss import backward_with_balance, sequence_loss_sums
from waypoint.training.preference_loss import METRICS, PreferenceLoss, pair_metrics

PAIR_KEYS = ("prompt", "chosen", "rejected")


class IndexedPairs(Dataset):
    """``pairs`` whose items also carry their ``index``: where their reference log-probs are in the run's table."""

    def __init__(self, pairs: Dataset) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict:
        return {**self.pairs[index], "index": index}


def pair_collate(pad_id: int) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Items of :class:`IndexedPairs` -> ``preference_collate``'s batch (chosen rows, then rejected) and ``index``."""
    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        batch = preference_collate([{k: item[k] for k in PAIR_KEYS} for item in items], pad_id)
        batch["index"] = torch.tensor([item["index"] for item in items], dtype=torch.long)
        return batch
    return collate


def policy_logps(model: torch.nn.Module, batch: dict, device: torch.device,
                 loss_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed completion log-probs [pairs] of ``batch``, with their graph when grad is enabled."""
    logps = -sequence_loss_sums(model, batch["tokens"].to(device), batch["labels"].to(device), loss_chunk)
    return logps.float().chunk(2)


def preference_forward_backward(model: torch.nn.Module, micro_batches: list[dict], reference: torch.Tensor | None,
                                loss: PreferenceLoss, device: torch.device, dist,
                                loss_chunk: int | None = None) -> tuple[float, int, dict[str, float], float | None]:
    """One optimizer step's gradients: the mean pair loss over the global batch (every micro-batch of every rank).
    ``reference``: the table of reference log-probs [pairs, 2] indexed by the batches' ``index`` (None for SimPO).
    Returns (the loss, the step's tokens, TRL's metrics averaged over the global batch, a MoE's balance loss or None).
    Each micro-batch's loss sum is divided by the global number of pairs, and under FSDP (which averages gradients
    over ranks) multiplied by the number of ranks, so N processes train as one."""
    n_pairs = max(dist.sum(sum(len(b["index"]) for b in micro_batches)), 1)
    loss_sum, aux_sum, has_aux = 0.0, 0.0, False
    sums = torch.zeros(len(METRICS), dtype=torch.float64)
    for batch in micro_batches:
        chosen, rejected = policy_logps(model, batch, device, loss_chunk)
        losses, chosen_rewards, rejected_rewards, logged = _pair_losses(loss, chosen, rejected, batch, reference)
        aux = backward_with_balance(model, losses.sum() / n_pairs, dist, batch.get("mask"), len(micro_batches))
        if aux is not None:  # MoE: the load-balancing loss, as in SFT
            has_aux, aux_sum = True, aux_sum + aux
        loss_sum += float(losses.detach().sum())
        sums += _metric_sums(chosen_rewards, rejected_rewards, *logged)
    tokens = int(dist.sum(sum(int(b["mask"].sum()) for b in micro_batches)))
    sums = dist.sum_tensor(sums)
    return dist.sum(loss_sum) / n_pairs, tokens, {k: float(v) / n_pairs for k, v in zip(METRICS, sums)}, \
        aux_sum if has_aux else None


@torch.no_grad()
def evaluate_preferences(model: torch.nn.Module, pairs: Dataset, reference: torch.Tensor | None, loss: PreferenceLoss,
                         batch_size: int, collate, device: torch.device, dist,
                         loss_chunk: int | None = None) -> dict[str, float]:
    """The mean pair loss (``loss``) and TRL's metrics over ``pairs`` (an :class:`IndexedPairs`), in eval mode.
    Every rank runs the same number of forwards (a rank without pairs in the last batch runs one that counts
    nothing), as FSDP needs."""
    sums, loss_sum, count = torch.zeros(len(METRICS), dtype=torch.float64), 0.0, 0
    for batch, mine in _shares(model, pairs, batch_size, collate, dist):
        chosen, rejected = policy_logps(model, batch, device, loss_chunk)
        if mine:
            losses, chosen_rewards, rejected_rewards, logged = _pair_losses(loss, chosen, rejected, batch, reference)
            loss_sum += float(losses.sum())
            sums += _metric_sums(chosen_rewards, rejected_rewards, *logged)
            count += len(batch["index"])
    n = max(dist.sum(count), 1)
    sums = dist.sum_tensor(sums)
    return {"loss": dist.sum(loss_sum) / n, **{k: float(v) / n for k, v in zip(METRICS, sums)}}


@torch.no_grad()
def reference_pass(model: torch.nn.Module, pairs: Dataset, batch_size: int, collate, device: torch.device, dist,
                   loss_chunk: int | None = None, progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """The reference log-probs of every pair of ``pairs`` (an :class:`IndexedPairs`) as a [pairs, 2] fp32 table
    (chosen, rejected), computed in eval mode by ``model`` as it is now (the caller disables LoRA adapters), each
    rank its share, then summed over ranks (every other row is zero: the sum is exact). ``progress(n)``: pairs
    done."""
    table = torch.zeros(len(pairs), 2, dtype=torch.float32)
    for batch, mine in _shares(model, pairs, batch_size, collate, dist):
        chosen, rejected = policy_logps(model, batch, device, loss_chunk)
        if mine:
            table[batch["index"]] = torch.stack([chosen, rejected], dim=1).cpu()
        if progress:
            progress(len(batch["index"]) * dist.world_size)
    return dist.sum_tensor(table) if dist.enabled else table


def _shares(model: torch.nn.Module, pairs: Dataset, batch_size: int, collate, dist):
    """(batch, whether it is this rank's) for every batch of ``pairs`` split over ranks, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        per_step = batch_size * dist.world_size
        for start in range(0, len(pairs), per_step):
            mine = list(range(start + dist.rank * batch_size, min(start + (dist.rank + 1) * batch_size, len(pairs))))
            yield collate([pairs[i] for i in (mine or [start])]), bool(mine)
    finally:
        reshard(model)  # under FSDP2, as after a training step
        model.train(was_training)


def _pair_losses(loss: PreferenceLoss, chosen: torch.Tensor, rejected: torch.Tensor, batch: dict,
                 reference: torch.Tensor | None):
    chosen_tokens, rejected_tokens = batch["completion_tokens"].to(chosen.device).chunk(2)
    ref_chosen = ref_rejected = None
    if loss.uses_reference:
        ref = reference[batch["index"]].to(chosen.device)
        ref_chosen, ref_rejected = ref[:, 0], ref[:, 1]
    losses, chosen_rewards, rejected_rewards = loss(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens,
                                                    rejected_tokens)
    logged = (loss.logps_logged(chosen, chosen_tokens), loss.logps_logged(rejected, rejected_tokens))
    return losses, chosen_rewards, rejected_rewards, logged


def _metric_sums(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> torch.Tensor:
    metrics = pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps)
    return torch.stack([metrics[k].detach().double().cpu() for k in METRICS])


def pairs_digest(pairs: Dataset) -> str:
    """A fingerprint of every pair's token ids, in order (the data, its template and its truncation)."""
    digest = hashlib.sha256()
    for index in range(len(pairs)):
        item = pairs[index]
        for key in PAIR_KEYS:
            ids = array("i", item[key])
            digest.update(len(ids).to_bytes(4, "little") + ids.tobytes())
    return digest.hexdigest()
