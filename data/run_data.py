"""A run's data, as both recipes set it up: the config's dataset, a validation split held out of it (or read from
another file), packed on request; and the files that make every checkpoint an inference bundle, prompted as the
run trained (``inference_bundle``: the chat template of conversations, or the instruction prompt written as one)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch.utils.data import Dataset

from waypoint.text.chat_template import ChatTemplate
from waypoint.text.inference_bundle import GENERATION_CONFIG, TEMPLATE_FILE, generation_config, template_file
from waypoint.data.data_checks import check_data
from waypoint.data.packing import PackedDataset
from waypoint.data.validation_split import Validation, split


def run_data(make_dataset: Callable[..., Dataset], tokenizer, checkpointer, validation: Mapping | None, seed: int,
             packed_to: int | None, vocab_size: int, say: Callable[[str], None],
             max_positions: int | None = None) -> tuple[Dataset, Validation | None]:
    """(the training dataset, the validation or None), checked against the model's ``vocab_size`` and
    ``max_positions`` (``data_checks``).
    ``make_dataset(source=None)``: the config's dataset (of another source: a validation file); ``validation``: the
    config's section (``{fraction | source, every_n_steps}``); ``packed_to``: the length samples are packed up to
    (None: not packed)."""
    dataset = make_dataset()
    template = getattr(dataset, "prompt_format", None)  # conversations' chat template, instructions' prompt as one
    if isinstance(template, ChatTemplate):  # the output renders prompts and stops as the run trained
        for name, bundle in ((GENERATION_CONFIG, generation_config(checkpointer.checkpoint_dir, tokenizer, template)),
                             (TEMPLATE_FILE, template_file(tokenizer, template))):
            if bundle is not None:
                checkpointer.output_files[name], note = bundle
                say(note)
    dataset, validation = split(validation, dataset, seed=seed, make=lambda source: make_dataset(source=source))
    check_data(dataset, tokenizer, vocab_size, "dataset", say, max_positions=max_positions)
    if validation:
        check_data(validation.dataset, tokenizer, vocab_size, "validation", say, required=False,
                   max_positions=max_positions)
    if packed_to and max_positions is not None and packed_to > max_positions:
        from waypoint.errors import CheckpointError

        raise CheckpointError(f"dataset.max_seq_len={packed_to}: packed sequences would be longer than the model's "
                              f"{max_positions} positions; set it to at most {max_positions}")
    if packed_to:  # samples concatenated up to max_seq_len; attention and positions kept per sample
        dataset = PackedDataset(dataset, packed_to)
        say(f"packed into {len(dataset)} sequences of up to {dataset.max_seq_len} tokens, {dataset.fill:.0%} filled")
    return dataset, validation
