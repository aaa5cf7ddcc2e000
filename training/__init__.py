"""The data side of fine-tuning: tokenizers, instruction datasets, collation and batch order."""

from waypoint.training.collate import padded_collate
from waypoint.training.data_order import batches_per_epoch, epoch_permutation, iterate_batches
from waypoint.training.instruct_dataset import TEMPLATES, InstructDataset, PromptTemplate
from waypoint.training.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "TEMPLATES",
    "InstructDataset",
    "PromptTemplate",
    "Tokenizer",
    "batches_per_epoch",
    "epoch_permutation",
    "iterate_batches",
    "load_tokenizer",
    "padded_collate",
]
