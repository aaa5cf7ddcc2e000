"""What a training step is made of: data (instruction and chat datasets, records, packing, collation, the
deterministic batch order split across ranks, validation), the loss and its backward pass, the learning-rate
schedule and gradient clipping with the non-finite guard, QLoRA's 4-bit base, and distribution (the process group
and FSDP2 sharding). A run's life around it (checkpoints, resume, the output directory) is ``waypoint.run``."""

from waypoint.training.collate import padded_collate
from waypoint.training.data_order import batches_per_epoch, epoch_permutation, iterate_batches
from waypoint.training.instruct_dataset import TEMPLATES, InstructDataset, PromptTemplate

__all__ = [
    "TEMPLATES",
    "InstructDataset",
    "PromptTemplate",
    "batches_per_epoch",
    "epoch_permutation",
    "iterate_batches",
    "padded_collate",
]
