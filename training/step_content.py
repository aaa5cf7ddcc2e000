"""What a step checkpoint of each recipe holds, for the savers (``waypoint.checkpointers.step_saver``).

``model_step``: a full fine-tune's model, optimizer and recipe state; one process writes the model in the
input's format, torchrun writes DCP shards (and, for the final step, the model in the input's format as well).
``adapter_step``: LoRA's adapters in PEFT's format with their optimizer and recipe state, and the merged model
in ``merged/`` when asked. With ``verify`` the model in the input's format is read back into a fresh model
before the step is committed (``ExportCheck``), and the line it prints is returned by ``content.verified``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate

from waypoint.checkpointers.base import RECIPE_STATE_FILE
from waypoint.checkpointers.commit import StagedDir
from waypoint.checkpointers.dtensor_state import GatheredState, serve_gathers
from waypoint.checkpointers.export_check import ExportCheck
from waypoint.checkpointers.load_model import load_into
from waypoint.checkpointers.extra_state import EXTRA_STATE_FILE, split_extra_state
from waypoint.checkpointers.peft_adapter import write_adapter
from waypoint.checkpointers.step_saver import StepContent
from waypoint.models.lora import MergedState, adapter_state, lora_modules
from waypoint.models.nf4 import is_nf4
from waypoint.training.optimizer_state import optimizer_state
from waypoint.training.recipe_state import RecipeState

MERGED_DIR = "merged"


class ExportReload:
    """How a recipe reads an export back (``verify_export``): a fresh model of its config's class, given the
    directory's tensors through its config's checkpointer, in the dtypes they were written in."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def build(self) -> torch.nn.Module:
        with torch.device("meta"):
            return instantiate(self.cfg.model)

    def __call__(self, directory: Path) -> torch.nn.Module:
        state = instantiate(self.cfg.checkpointer, checkpoint_dir=str(directory)).load_checkpoint()
        model = self.build()
        load_into(model, state["model"], device="cpu", strict=self.cfg.strict, key_prefix_map=self.cfg.key_prefix_map)
        return model


def model_step(model, optimizer, checkpointer, recipe: RecipeState, final: bool, dist, verify: ExportReload | None,
               report: Callable[[str], None]) -> StepContent:
    """The full fine-tune's step ``recipe.global_step``; ``final``: the run's last."""
    optim = optimizer_state(model, optimizer)
    model_state = model.state_dict()
    check = ExportCheck(model, report=report, reload=verify) if verify and final else None
    if not dist.enabled:  # one process: whole tensors, in the input's format
        recipe.optimizer = optim
        state = {"model": model_state, "recipe_state": recipe.as_dict()}
        return StepContent(state, lambda s: _checked(checkpointer.writer(s), check))
    # torchrun: every rank's DCP shards (the model, unless the final step writes it in the input's format and no
    # narrower than it trained), rank 0 the recipe and extra state and, at the end, the model gathered file by file
    tensors, extra = split_extra_state(model_state)
    keep_model = not final or checkpointer.narrows(tensors)
    recipe.optimizer_param_groups = optim["param_groups"]
    files = {RECIPE_STATE_FILE: recipe.as_dict()} | ({EXTRA_STATE_FILE: extra} if extra and keep_model else {})

    def writer(state: Mapping[str, Any]) -> Callable[[StagedDir], None]:
        def write(stage: StagedDir) -> None:
            for name, obj in state.items():
                stage.write(name, lambda f, obj=obj: torch.save(obj, f))
            if final:
                with GatheredState(model_state) as gathered:
                    _checked(checkpointer.writer({"model": gathered}), check)(stage)
        return write
    return StepContent(files, writer, sharded={"optimizer": optim["state"]} | ({"model": dict(tensors)} if keep_model else {}),
                       serve=(lambda: serve_gathers(model_state)) if final else None)


def export_step(checkpointer, model_state: Mapping[str, Any], sharded: Mapping[str, Any] | None = None) -> StepContent:
    """Only the model in the checkpointer's format, a sharded model's gathered file by file (and ``sharded``'s
    DCP tensors beside it): what the benchmarks and memory probes time."""
    def writer(_: Mapping[str, Any]) -> Callable[[StagedDir], None]:
        def write(stage: StagedDir) -> None:
            with GatheredState(model_state) as gathered:
                checkpointer.writer({"model": gathered})(stage)
        return write
    return StepContent({}, writer, sharded=sharded or {}, serve=lambda: serve_gathers(model_state))


def shards_step(sharded: Mapping[str, Any]) -> StepContent:
    """Only every rank's DCP tensors."""
    return StepContent({}, lambda _: (lambda stage: None), sharded=sharded)


def adapter_step(model, optimizer, recipe: RecipeState, checkpointer, *, converter, base_name: str, max_lora_rank: int,
                 layout, merge: bool, original, sources, dist, verify: ExportReload | None,
                 report: Callable[[str], None]) -> StepContent:
    """LoRA's step: the adapters and their optimizer state, small and gathered whole whatever the number of
    processes; with ``merge`` the merged model (W + alpha/r * B @ A, from the input's full-precision ``original``)
    in ``merged/``, committed inside the step's staging directory, so both appear together or not at all."""
    adapter = adapter_state(model)
    recipe.optimizer = optimizer_state(model, optimizer, whole=True)
    scalings = {name: m.scaling for name, m in lora_modules(model).items()}
    model_state = model.state_dict() if merge else None
    check = None
    if merge and verify:
        quantized = any(is_nf4(p) for p in model.parameters())
        if not quantized:
            check = ExportCheck(model, report=report, reload=verify)  # the model as it trains computes what merged/ must
        elif not dist.enabled:  # a 4-bit base computes something else: the reference is the merge itself, in memory
            check = _merged_reference_check(model, model_state, scalings, original, sources, verify, report)
        else:
            report("note: the merged model is not read back under torchrun with quantize_base (its full-precision "
                   "reference would have to be gathered); scripts/convert.py --verify checks it afterwards")

    def writer(state: Mapping[str, Any]) -> Callable[[StagedDir], None]:
        def write(stage: StagedDir) -> None:
            write_adapter(stage, model, converter, base_name, max_lora_rank, layout=layout, adapter=state["adapter"])
            stage.write(RECIPE_STATE_FILE, lambda f: torch.save(state["recipe_state"], f))
            if merge:
                with GatheredState(model_state) if dist.enabled else nullcontext({**model_state, **state["adapter"]}) as whole:
                    checkpointer.save_to({"model": MergedState(whole, scalings, original, sources)},
                                         stage.path / MERGED_DIR, check=check)
        return write
    return StepContent({"adapter": adapter, "recipe_state": recipe.as_dict()}, writer,
                       serve=(lambda: serve_gathers(model_state)) if merge else None)


def _merged_reference_check(model, model_state, scalings, original, sources, verify: ExportReload, report) -> ExportCheck:
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and not is_nf4(p))
    reference = verify.build()
    load_into(reference, MergedState(model_state, scalings, original, sources), dtype=dtype, device="cpu")
    check = ExportCheck(reference, report=report, reload=verify)
    del reference
    return check


def _checked(write: Callable[[StagedDir], None], check: ExportCheck | None) -> Callable[[StagedDir], None]:
    """``write``, then ``check`` on the staged files (before anything is committed)."""
    if check is None:
        return write

    def write_and_check(stage: StagedDir) -> None:
        write(stage)
        check(stage.path)
    return write_and_check
