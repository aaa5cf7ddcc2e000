"""What a torchtune checkpointer section and a torchtune-style ``save_checkpoint`` call bring, read the Waypoint way.

A torchtune config names its checkpointer ``_component_: torchtune.training.FullModelHFCheckpointer`` (``CHECKPOINTERS``
maps the three to ours; ``cli/config.py`` reads ``_component_`` as ``_target_``) and gives it torchtune's resume
options (``recipe_checkpoint``, ``adapter_checkpoint``, ``resume_from_checkpoint``, ``should_load_recipe_state``): a
Waypoint run resumes from its own ``step_N`` (``resume=auto``), so these are accepted, null/false ones silently and
the others with one note (``resume_options_note``). A torchtune loop's state dict may hold beside ``model`` its LoRA
``adapter`` and ``adapter_config`` (written as a PEFT adapter, ``adapter_writer``) and, with
``intermediate_checkpoint=True``, its own recipe state (optimizer, epochs run, seed ...), written as the step's
``recipe_state.pt``; nothing in it is dropped without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from waypoint.checkpointers.commit import StagedDir
from waypoint.errors import CheckpointError

# torchtune's state-dict keys (torchtune.training: MODEL_KEY, ADAPTER_KEY, ADAPTER_CONFIG)
MODEL_KEY, ADAPTER_KEY, ADAPTER_CONFIG_KEY = "model", "adapter", "adapter_config"

# torchtune's checkpointer components -> ours (each also importable as torchtune.training.checkpointing.X)
CHECKPOINTERS = {f"torchtune.training{sub}.{name}": ours
                 for name, ours in (("FullModelHFCheckpointer", "waypoint.checkpointers.HFCheckpointer"),
                                    ("FullModelMetaCheckpointer", "waypoint.checkpointers.MetaCheckpointer"),
                                    ("FullModelTorchTuneCheckpointer", "waypoint.checkpointers.NativeCheckpointer"))
                 for sub in ("", ".checkpointing", ".checkpointing._checkpointer")}

RESUME_OPTIONS = ("recipe_checkpoint", "adapter_checkpoint", "resume_from_checkpoint", "should_load_recipe_state")


def resume_options_note(options: Mapping[str, Any], prefix: str = "checkpointer.") -> str | None:
    """One note for torchtune's resume options that are set (not null/false), or None; ``prefix``: where they are
    (a torchtune config also has ``resume_from_checkpoint`` at its top level)."""
    given = [name for name in RESUME_OPTIONS if options.get(name) not in (None, False, "", "null", "false", "False")]
    if not given:
        return None
    return (f"note: {prefix}{(', ' + prefix).join(given)} (torchtune's resume option{'s' if len(given) > 1 else ''}) "
            "unused: a Waypoint run resumes from its own output_dir/step_N (model or adapter files and "
            "step_N/recipe_state.pt) with resume=auto (the newest verified step, the default) or resume=<a step_N "
            "directory>; resume=false starts fresh")


def step_number(step: int | None, epoch: int | None) -> int:
    """``save_checkpoint``'s step, also given as torchtune's ``epoch=`` (the directory is ``step_N`` either way)."""
    if step is not None and epoch is not None and step != epoch:
        raise CheckpointError(f"save_checkpoint: step={step} and epoch={epoch}; give one (epoch= is torchtune's name for it)")
    number = step if step is not None else epoch
    if not isinstance(number, int) or isinstance(number, bool) or number < 0:
        raise CheckpointError(f"save_checkpoint: step={number!r}: expected an integer >= 0 (step=N, or torchtune's epoch=N)")
    return number


def native_adapter(adapter: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A LoRA adapter's tensors under the model's module names: ``<module>.lora_A.weight`` / ``.lora_B.weight``
    (torchtune's ``lora_a`` / ``lora_b`` are the same tensors under its lower-case names)."""
    out = {}
    for key, tensor in adapter.items():
        stem, dot, part = str(key).rpartition(".lora_")
        part = {"a.weight": "A.weight", "b.weight": "B.weight"}.get(part, part)
        if not dot or part not in ("A.weight", "B.weight") or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"save_checkpoint: state_dict['adapter'][{key!r}] is not a LoRA A/B weight "
                                  "(<module>.lora_A.weight or .lora_B.weight); only plain LoRA adapters are written "
                                  "(DoRA's magnitude is not)")
        out[f"{stem}.lora_{part}"] = tensor
    return out


def adapter_writer(adapter: Mapping[str, Any], config: Any, converter, base_model_name_or_path: str,
                   layout) -> Callable[[StagedDir], None]:
    """Check a state dict's ``adapter`` and ``adapter_config`` now; return what stages them in PEFT's format
    (``adapter_model.safetensors`` + ``adapter_config.json``, and ``adapter_<format>.safetensors`` for a Meta or
    native input, as a LoRA step writes them). The rank comes from the tensors (and must match ``r`` when given);
    ``lora_alpha`` must be given (the tensors cannot tell it); ``lora_dropout`` defaults to 0; PEFT's
    ``target_modules`` are the tensors' modules under the HF names (torchtune's own names there are not needed)."""
    from waypoint.checkpointers.peft_adapter import to_peft, write_adapter_tensors

    if not isinstance(config, Mapping):
        raise CheckpointError("save_checkpoint: state_dict['adapter'] needs state_dict['adapter_config'] "
                              "({r, lora_alpha, ...}: the scaling PEFT applies) to be written as a PEFT adapter")
    if not adapter:
        raise CheckpointError("save_checkpoint: state_dict['adapter'] is empty: no LoRA tensors to write")
    tensors = native_adapter(adapter)
    ranks = {int(t.shape[0]) for k, t in tensors.items() if k.endswith(".lora_A.weight") and t.ndim >= 1}
    if len(ranks) != 1:
        raise CheckpointError(f"save_checkpoint: state_dict['adapter'] holds LoRA A weights of ranks {sorted(ranks)}; "
                              "a PEFT adapter has one r")
    rank = ranks.pop()
    if config.get("r", rank) != rank:
        raise CheckpointError(f"save_checkpoint: state_dict['adapter_config'] r={config['r']!r}, but the adapter's "
                              f"lora_A weights have rank {rank}")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise CheckpointError(f"save_checkpoint: state_dict['adapter_config'] lora_alpha={alpha!r}: expected a number "
                              "(the adapter's scaling is lora_alpha / r)")
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            raise CheckpointError(f"save_checkpoint: state_dict['adapter_config'] {key}=true: only plain LoRA adapters are written")
    to_peft(tensors, converter)  # every module maps to one of PEFT's before anything is written
    dropout = float(config.get("lora_dropout", 0.0) or 0.0)
    base = config.get("base_model_name_or_path") or base_model_name_or_path
    return lambda stage: write_adapter_tensors(stage, tensors, converter, rank, alpha, dropout, base, layout=layout)


def recipe_state_writer(entries: Mapping[str, Any], target_name: str) -> Callable[[StagedDir], None]:
    """A torchtune loop's recipe state (every entry beside the model and adapter) as the step's ``target_name``."""
    state = dict(entries)
    return lambda stage: stage.write(target_name, lambda f: torch.save(state, f))
