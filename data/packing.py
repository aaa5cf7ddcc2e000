"""Packing: short samples concatenated into sequences of up to ``max_seq_len`` tokens, so a batch is tokens,
not padding.

A pack keeps its samples apart: ``document_ids`` numbers the samples of a pack (the model attends only within
one, ``waypoint.models.attention.document_mask``) and ``positions`` restart at 0 for each (RoPE sees each sample
as it would alone). The first label of each sample is -100, so no sample learns to predict the next one's first
token from the end of the previous: a pack's per-token losses are those of its samples trained one by one.

Packs are made once, greedily in dataset order (deterministic, so a resumed run sees the same packs); the batch
order over packs is ``data_order``'s, as for any dataset.
"""

from __future__ import annotations

from torch.utils.data import Dataset

from waypoint.errors import CheckpointError
from waypoint.models.fused_loss import IGNORE_INDEX


class PackedDataset(Dataset):
    """``dataset``'s items (``{"tokens", "labels"}``) in packs of at most ``max_seq_len`` tokens; an item longer
    than that is cut to it. Items: ``{"tokens", "labels", "positions", "document_ids"}``."""

    def __init__(self, dataset: Dataset, max_seq_len: int) -> None:
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        self.max_seq_len = max_seq_len
        if getattr(dataset, "images", None) is not None:  # a pack's rows would lose their images (and their masks)
            raise CheckpointError("packed: true does not pack conversations with images yet; set packed: false")
        self.items = [dataset[i] for i in range(len(dataset))]  # tokenized once, here
        self.packs: list[list[int]] = []
        current, length = [], 0
        for index, item in enumerate(self.items):
            n = min(len(item["tokens"]), max_seq_len)
            if current and length + n > max_seq_len:
                self.packs.append(current)
                current, length = [], 0
            current.append(index)
            length += n
        if current:
            self.packs.append(current)

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        tokens, labels, positions, documents = [], [], [], []
        for document, item_index in enumerate(self.packs[index]):
            item = self.items[item_index]
            n = min(len(item["tokens"]), self.max_seq_len)
            tokens += item["tokens"][:n]
            labels += [IGNORE_INDEX] + list(item["labels"][1:n])  # never predicted from the previous sample
            positions += range(n)
            documents += [document] * n
        return {"tokens": tokens, "labels": labels, "positions": positions, "document_ids": documents}

    @property
    def fill(self) -> float:
        """The share of pack slots holding tokens (1.0: no padding at all)."""
        used = sum(min(len(self.items[i]["tokens"]), self.max_seq_len) for pack in self.packs for i in pack)
        return used / max(len(self.packs) * self.max_seq_len, 1)
