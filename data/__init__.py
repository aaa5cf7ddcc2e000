"""What a run trains on: instruction, chat, vision-chat, preference and prompt datasets read from records (JSONL,
JSON, Parquet, or embedded), tokenized with the checkpoint's chat template, packed on request, checked, collated into
batches, put in a deterministic order split across ranks, and a held-out validation split."""

from waypoint.data.collate import padded_collate
from waypoint.data.data_order import batches_per_epoch, epoch_permutation, iterate_batches
from waypoint.data.instruct_dataset import TEMPLATES, InstructDataset, PromptTemplate

__all__ = [
    "TEMPLATES",
    "InstructDataset",
    "PromptTemplate",
    "batches_per_epoch",
    "epoch_permutation",
    "iterate_batches",
    "padded_collate",
]
