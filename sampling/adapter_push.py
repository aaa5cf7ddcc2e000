"""A LoRA policy given to vLLM as what it is: the base stays as the engine loaded it (it is frozen), and after each
step the PEFT adapter (the one the run's checkpoints hold: PEFT's keys and config) is written to a folder and served
as a new ``LoRARequest`` (a new id: vLLM caches an adapter by its id), as verl and prime-rl push adapters. A small
file a step instead of the whole model merged, where vLLM serves LoRA on every target (its family's
``vllm_lora_modules``, a rank it takes, no expert or bare-parameter targets); elsewhere the merged weights are pushed
(``sampling.grpo_engine``), said once at start."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch

from waypoint.checkpointers.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, VLLM_RANKS, VLLM_TARGETS, \
    adapter_config, to_peft, vllm_problems
from waypoint.converters.table import Converter
from waypoint.lazy import on_host
from waypoint.models.lora import adapter_state, lora_modules


ADAPTERS_FOLDER = ".waypoint_vllm_adapters"  # in a server's vllm_server_weights_dir: the adapters it loads


class AdapterPush:
    """The adapter of ``model`` (LoRA layers named by ``converter`` as PEFT names them) written for vLLM, a folder at
    a time in ``folder`` (two, alternating: vLLM may read the last one again until the next is in use)."""

    def __init__(self, model: torch.nn.Module, converter: Converter, folder: Path) -> None:
        modules = lora_modules(model)
        first = next(iter(modules.values()))
        self.converter, self.folder, self.pushed = converter, Path(folder), 0
        self.made_parent = not self.folder.parent.exists()  # removed again, empty, by close
        self.rank = first.rank
        self.config = adapter_config(converter, list(modules), first.rank, first.alpha, first.dropout_p, "policy")

    @staticmethod
    def why_not(model: torch.nn.Module, converter: Converter) -> str | None:
        """Why vLLM cannot serve this policy's adapter, or None."""
        modules = lora_modules(model)
        first = next(iter(modules.values()))
        config = adapter_config(converter, list(modules), first.rank, first.alpha, 0.0, "policy")
        if config.get("target_parameters"):
            return f"it adapts parameters ({', '.join(config['target_parameters'][:2])}), not modules"
        problems = vllm_problems(config, max(VLLM_RANKS), converter.vllm_lora_modules or VLLM_TARGETS)
        return problems[0].removeprefix("vLLM: ") if problems else None

    @property
    def max_lora_rank(self) -> int:
        return min(r for r in VLLM_RANKS if r >= self.rank)

    def write(self, model: torch.nn.Module) -> tuple[Path, int]:
        """The adapter as the model holds it now: (its folder, a new id for vLLM)."""
        from safetensors.torch import save_file

        self.pushed += 1
        folder = self.folder / f"adapter_{self.pushed % 2}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        tensors = to_peft({k: on_host(v, k) for k, v in adapter_state(model).items()}, self.converter)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (folder / ADAPTER_CONFIG).write_text(json.dumps(self.config))
        return folder, self.pushed

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.made_parent:
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()
