"""What a run checks of its data before the first step, so that it does not fail mid-step or train on nothing:
every token id fits the model's embedding (a tokenizer from another model would fail inside ``F.embedding``),
and some record supervises a token within ``max_seq_len`` (records whose assistant turns are all cut off train
with loss 0). Preference pairs (items ``{"prompt", "chosen", "rejected"}``) are checked alike: their ids fit, and
the pairs with a completion that has no token to predict within ``max_length`` are noted."""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.data import Dataset

from waypoint.errors import CheckpointError
from waypoint.models.fused_loss import IGNORE_INDEX

PAIR_KEYS = {"prompt", "chosen", "rejected"}


def check_data(dataset: Dataset, tokenizer, vocab_size: int, name: str, say: Callable[[str], None],
               required: bool = True, max_positions: int | None = None) -> None:
    """Refuse ``dataset`` (items ``{"tokens", "labels"}``, or preference pairs ``{"prompt", "chosen", "rejected"}``;
    called ``name`` in messages) when a token id or the padding id is past the model's ``vocab_size``, a record is
    longer than the model's ``max_positions``, or (``required``) when no record supervises a token; note the records
    that supervise none (of pairs: those with a completion that does)."""
    pad_id = getattr(tokenizer, "pad_id", None)
    if pad_id is not None and pad_id >= vocab_size:
        raise CheckpointError(_does_not_fit(f"the padding id {pad_id}", tokenizer, vocab_size))
    if len(dataset) and PAIR_KEYS <= set(dataset[0]):
        return _check_pairs(dataset, tokenizer, vocab_size, name, say, required, max_positions)
    if len(dataset) and "prompt_ids" in dataset[0]:  # online RL's prompts: the completions are sampled
        for index in range(len(dataset)):
            top = max(dataset[index]["prompt_ids"], default=0)
            if top >= vocab_size:
                raise CheckpointError(_does_not_fit(f"{_where(dataset, index, name)}: token id {top} "
                                                    f"({tokenizer.decode([top])!r})", tokenizer, vocab_size))
        return None
    unsupervised = 0
    for index in range(len(dataset)):
        item = dataset[index]
        top = max(item["tokens"], default=0)
        if top >= vocab_size:
            raise CheckpointError(_does_not_fit(f"{_where(dataset, index, name)}: token id {top} "
                                                f"({tokenizer.decode([top])!r})", tokenizer, vocab_size))
        _check_length(len(item["tokens"]), max_positions, dataset, index, name, "max_seq_len")
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


def _check_pairs(dataset: Dataset, tokenizer, vocab_size: int, name: str, say: Callable[[str], None],
                 required: bool, max_positions: int | None = None) -> None:
    """``check_data`` of preference pairs: every id fits; the pairs with a completion that predicts no token (the
    pairs whose prompt fills max_length are dropped by the dataset, so one side at most, but count both) are noted,
    and when none of the pairs predicts a token (``required``) the data is refused."""
    one_side = neither = 0
    for index in range(len(dataset)):
        item = dataset[index]
        top = max((max(item[key], default=0) for key in PAIR_KEYS), default=0)
        if top >= vocab_size:
            raise CheckpointError(_does_not_fit(f"{_where(dataset, index, name)}: token id {top} "
                                                f"({tokenizer.decode([top])!r})", tokenizer, vocab_size))
        _check_length(len(item["prompt"]) + max(len(item["chosen"]), len(item["rejected"])), max_positions, dataset,
                      index, name, "max_length")
        # labels[1:] are predicted: without a prompt, a completion's first token is not
        empty = [len(item[side]) - (0 if item["prompt"] else 1) <= 0 for side in ("chosen", "rejected")]
        neither += all(empty)
        one_side += any(empty) and not all(empty)
    if not one_side and not neither:
        return
    cut = getattr(_origin(dataset), "max_length", None)
    within = f" within max_length={cut}" if cut else ""
    if neither == len(dataset) and required:
        raise CheckpointError(f"{name}: no pair has a completion token to train on{within}: every step would train on "
                              "nothing; raise dataset.max_length or shorten the prompts")
    parts = [f"{one_side} of {len(dataset)} pairs have an empty chosen or rejected completion{within} (its "
             "log-prob is 0)"] if one_side else []
    parts += [f"{neither} of {len(dataset)} pairs have both completions empty{within}; they add nothing to the "
              "loss"] if neither else []
    say(f"note: {name}: {'; '.join(parts)}")


def _check_length(length: int, max_positions: int | None, dataset: Dataset, index: int, name: str, option: str) -> None:
    """Refuse a record longer than the model's positions: it would stop the run at its first step."""
    if max_positions is not None and length > max_positions:
        raise CheckpointError(f"{_where(dataset, index, name)}: {length} tokens, past the model's {max_positions} "
                              f"positions (max_position_embeddings in its config.json); set dataset.{option} to at most "
                              f"{max_positions}")


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
    if where is None and isinstance(getattr(dataset, "where", None), (list, tuple)):  # kept by the dataset itself
        where = dataset.where  # (PreferenceDataset)
    return where[index] if where else f"{name}: item {index}"


def _origin(dataset: Dataset) -> Dataset:
    """The dataset a ``Subset`` is part of."""
    while hasattr(dataset, "indices"):
        dataset = dataset.dataset
    return dataset
