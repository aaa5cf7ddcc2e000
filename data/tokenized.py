"""A dataset's records tokenized once, when it is read: token ids and which of them are trained on, held
compactly (5 bytes a token), so that bad records stop a run before its first step and the data can be checked
against the model (``waypoint.data.data_checks``) without tokenizing anything twice."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from waypoint.models.fused_loss import IGNORE_INDEX


class TokenizedRecords:
    """Items ``{"tokens", "labels"}``: each record's ids and its labels (-100 where not trained on, unless
    ``train_on_input``), both cut to ``max_seq_len``; ``where[i]`` says where record ``i`` came from."""

    def __init__(self, max_seq_len: int, train_on_input: bool) -> None:
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        self.max_seq_len = max_seq_len
        self.train_on_input = train_on_input
        self.where: list[str] = []
        self._tokens: list[array] = []
        self._masks: list[bytes] = []

    def add(self, tokens: Sequence[int], mask: Sequence[int], where: str) -> None:
        """A record's ids and its mask (1 on the tokens trained on), kept up to ``max_seq_len``."""
        self._tokens.append(array("i", tokens[: self.max_seq_len]))  # 4 bytes an id: vocabularies are far below 2**31
        self._masks.append(bytes(1 if m else 0 for m in mask[: self.max_seq_len]))
        self.where.append(where)

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        tokens = self._tokens[index].tolist()
        if self.train_on_input:
            return {"tokens": tokens, "labels": tokens[:]}
        mask = self._masks[index]
        return {"tokens": tokens, "labels": [t if m else IGNORE_INDEX for t, m in zip(tokens, mask)]}
