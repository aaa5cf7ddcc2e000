"""A training recipe's model, as every recipe builds it: on the meta device, LoRA adapters (and a 4-bit base) on
request, sharded (FSDP2) under torchrun, then given the checkpoint's tensors, each rank reading only its own piece.

The checkpointer reads the input (its files, key -> file map, dtypes and side files are what every save writes). A full
run resumed from a whole step takes that step's weights (as they trained, when its files hold a narrower dtype), one
resumed from a sharded step reads its DCP shards; a LoRA run always takes its base from the input (the adapters come
fresh, or from the resumed step through ``load_adapters``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.utils import instantiate

from waypoint.checkpointers import load_into
from waypoint.checkpointers.load_model import load_sharded_into
from waypoint.checkpointers.load_report import LoadReport
from waypoint.checkpointers.peft_adapter import check_targets, load_adapter
from waypoint.converters import Converter
from waypoint.models.lora import adapter_state_keys, apply_lora, init_adapters, load_adapter_state
from waypoint.training.fsdp import shard_model
from waypoint.training.quantize import NF4Options, quantize_base


@dataclass
class RecipeModel:
    """The model loaded, the checkpointer that read it (and writes its checkpoints), and what was done.

    ``wrapped``: the layers LoRA adapted (none for a full run); ``original``: a LoRA run's input state, read lazily,
    which its merges read again (the full-precision base, not the model's 4-bit or dtype-cast copy); None for a full run.
    """

    model: torch.nn.Module
    checkpointer: Any
    report: LoadReport
    wrapped: list[str] = field(default_factory=list)
    original: Mapping[str, Any] | None = None


def load_model(cfg, dist, start, lora, say: Callable[[str], None]) -> RecipeModel:
    """Build ``cfg.model`` and load it for a run that starts at ``start`` (``waypoint.run.resume.RunStart``), with the
    ``lora`` section's adapters when it is given (``quantize_base``: the frozen base in 4 bits, each linear quantized
    as its tensor is read, so the full-precision base is never in memory); ``say`` gets the quantization's lines and
    the load report."""
    checkpointer = instantiate(cfg.checkpointer)
    state = checkpointer.load_checkpoint()  # memory-mapped and converted lazily: nothing is read yet
    if start.checkpoint and not start.sharded and not lora:
        state = instantiate(cfg.checkpointer, checkpoint_dir=start.path).load_checkpoint()
        state["model"].update(start.state.get("model") or {})
    with torch.device("meta"):
        model = instantiate(cfg.model)
    wrapped = []
    if lora:
        wrapped = apply_lora(model, list(lora.targets), lora.rank, lora.alpha, lora.dropout)
        nf4 = NF4Options(**(cfg.get("nf4") or {})) if cfg.get("quantize_base") == "nf4" else None
        for line in quantize_base(model, cfg.dtype, cfg.get("quantize_base"), nf4, dist.world_size, checkpointer):
            say(line)
    if dist.enabled:
        shard_model(model, dist.mesh, cfg.get("mixed_precision"))
    if start.sharded and not lora:
        report = load_sharded_into(model, start.path, dtype=cfg.dtype, device=dist.device)
    else:
        report = load_into(model, state["model"], dtype=cfg.dtype, device=dist.device, strict=cfg.strict,
                           key_prefix_map=cfg.key_prefix_map, fill_later=list(adapter_state_keys(model)) if lora else ())
    if lora:
        init_adapters(model, dist.device)
    say("\n".join(report.lines() + checkpointer.notes))
    return RecipeModel(model, checkpointer, report, wrapped, state["model"] if lora else None)


def load_adapters(model: torch.nn.Module, checkpointer, start) -> Converter:
    """A LoRA run's adapters checked and, when it resumes, given the step's weights; returns the converter that names
    their modules as HF does (PEFT's keys). A target PEFT cannot name (Phi-3's fused qkv) fails now, not at the first
    save."""
    converter = checkpointer.hf_converter()
    check_targets(model, converter, checkpointer.family)
    if start.checkpoint:
        load_adapter_state(model, load_adapter(start.path, converter)[0])
    return converter
