"""What a run checks of its data before the first step, so that it does not fail mid-step or train on nothing:
every token id fits the model's embedding (a tokenizer from another model would fail inside ``F.embedding``),
and some record supervises a token within ``max_seq_len`` (records whose assistant turns are all cut off train
with loss 0)."""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.data import Dataset

from waypoint.errors import CheckpointError
from waypoint.training.loss import IGNORE_INDEX


def check_data(dataset: Dataset, tokenizer, vocab_size: int, name: str, say: Callable[[str], None],
               required: bool = True) -> None:
    """Refuse ``dataset`` (items ``{"tokens", "labels"}``, called ``name`` in messages) when a token id or the
    padding id is past the model's ``vocab_size``, or (``required``) when no record supervises a token; note the
    records that supervise none."""
    pad_id = getattr(tokenizer, "pad_id", None)
    if pad_id is not None and pad_id >= vocab_size:
        raise CheckpointError(_does_not_fit(f"the padding id {pad_id}", tokenizer, vocab_size))
    unsupervised = 0
    for index in range(len(dataset)):
        item = dataset[index]
        top = max(item["tokens"], default=0)
        if top >= vocab_size:
            raise CheckpointError(_does_not_fit(f"{_where(dataset, index, name)}: token id {top} "
                                                f"({tokenizer.decode([top])!r})", tokenizer, vocab_size))
        if all(label == IGNORE_INDEX for label in item["labels"][1:]):  # the loss predicts labels[1:]
            unsupervised += 1
    if not unsupervised:
        return
    cut = getattr(getattr(_origin(dataset), "items", None), "max_seq_len", None)
    within = f" within max_seq_len={cut}" if cut else ""
    if unsupervised == len(dataset) and required:
        raise CheckpointError(f"{name}: no record supervises a token{within} (the turns trained on start past it, or are "
                              "empty): every step would train on nothing; raise dataset.max_seq_len or shorten the prompts")
    say(f"note: {name}: {unsupervised} of {len(dataset)} records supervise no token{within} (the turns trained on start "
        "past it); they add nothing to the loss")


def _does_not_fit(what: str, tokenizer, vocab_size: int) -> str:
    source = getattr(tokenizer, "directory", None) or "the tokenizer"
    return (f"{what} is past the model's embedding of {vocab_size} rows (the tokenizer at {source} has "
            f"{tokenizer.vocab_size} ids): the tokenizer belongs to another model; use the checkpoint's own")


def _where(dataset: Dataset, index: int, name: str) -> str:
    """``file: record n`` for a dataset that keeps where its records came from, else ``name: item index``."""
    while hasattr(dataset, "indices"):  # a Subset (the training part of a split): the index in what it is part of
        index = dataset.indices[index]
        dataset = dataset.dataset
    where = getattr(getattr(dataset, "items", None), "where", None)
    return where[index] if where else f"{name}: item {index}"


def _origin(dataset: Dataset) -> Dataset:
    """The dataset a ``Subset`` is part of."""
    while hasattr(dataset, "indices"):
        dataset = dataset.dataset
    return dataset
