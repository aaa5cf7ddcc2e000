"""The data side of fine-tuning: tokenizers, instruction datasets, collation and batch order."""

from training.collate import padded_collate
from training.data_order import batches_per_epoch, epoch_permutation, iterate_batches
from training.instruct_dataset import TEMPLATES, InstructDataset, PromptTemplate
from training.tokenizer import Tokenizer, load_tokenizer

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
