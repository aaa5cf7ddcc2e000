"""What a step checkpoint of each recipe holds, for the savers (``waypoint.run.savers``).

``model_step``: a full fine-tune's model, optimizer and recipe state; one process writes the model in the
input's format, torchrun writes DCP shards (and, for the final step, the model in the input's format as well).
``adapter_step``: LoRA's adapters in PEFT's format with their optimizer and recipe state, the tokenizer with the chat
template the run trains with beside them (``write_tokenizer``), and the merged model in ``merged/`` when asked. With
``verify`` (an :class:`ExportReload`) the model in the input's format is read back into a fresh model before the
step is committed (``ExportCheck``), and the line it prints goes to ``report``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from waypoint.checkpointers.commit import StagedDir
from waypoint.checkpointers.dtensor_state import GatheredState, serve_gathers
from waypoint.checkpointers.export_check import ExportCheck
from waypoint.checkpointers.extra_state import EXTRA_STATE_FILE, split_extra_state
from waypoint.checkpointers.load_model import load_into
from waypoint.checkpointers.peft_adapter import write_adapter
from waypoint.models.lora import MergedState, adapter_state, lora_modules
from waypoint.models.quantized_base import is_quantized_base
from waypoint.run.recipe_state import RECIPE_STATE_FILE, RecipeState, optimizer_state
from waypoint.run.savers import StepContent
from waypoint.text.inference_bundle import TOKENIZER_FILES

MERGED_DIR = "merged"


@dataclass(frozen=True)
class ExportReload:
    """How a recipe reads an export back (``verify_export``): ``build()`` makes a fresh model of its config's class
    (on the current default device), ``read(directory)`` reads a directory through its config's checkpointer
    (``load_checkpoint()["model"]``); the tensors are loaded as they were written, ``strict`` and with the
    ``key_prefix_map`` the run loaded its input with."""

    build: Callable[[], torch.nn.Module]
    read: Callable[[Path], Mapping[str, Any]]
    strict: bool = True
    key_prefix_map: Mapping[str, str] | None = None

    def fresh_model(self) -> torch.nn.Module:
        with torch.device("meta"):
            return self.build()

    def __call__(self, directory: Path) -> torch.nn.Module:
        state = self.read(directory)
        model = self.fresh_model()
        load_into(model, state, device="cpu", strict=self.strict, key_prefix_map=self.key_prefix_map)
        return model


def model_step(model, optimizer, checkpointer, recipe: RecipeState, final: bool, dist, verify: ExportReload | None,
               report: Callable[[str], None]) -> StepContent:
    """The full fine-tune's step ``recipe.global_step``; ``final``: the run's last."""
    optim = optimizer_state(model, optimizer)
    model_state = model.state_dict()
    check = ExportCheck(model, report=report, reload=verify, written=checkpointer.as_written if checkpointer.rounds else None,
                        warn=checkpointer.output_warnings.append) if verify and final else None
    if not dist.enabled:  # one process: whole tensors, in the input's format, and the recipe state beside them
        recipe.optimizer = optim

        def whole(state: Mapping[str, Any]) -> Callable[[StagedDir], None]:
            write_model = _checked(checkpointer.writer(state), check)
            native = split_extra_state(state["model"])[0]
            recipe_state = state["recipe_state"]
            if checkpointer.narrows(native):  # the files hold less than the model: resuming needs the model as it trained
                recipe_state = recipe_state | {"model": dict(native)}

            def write(stage: StagedDir) -> None:
                write_model(stage)
                stage.write(RECIPE_STATE_FILE, lambda f: torch.save(recipe_state, f))
            return write
        return StepContent({"model": model_state, "recipe_state": recipe.as_dict()}, whole)
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
                write_gathered(stage, checkpointer, model_state, check)
        return write
    return StepContent(files, writer, sharded={"optimizer": optim["state"]} | ({"model": dict(tensors)} if keep_model else {}),
                       serve=(lambda: serve_gathers(model_state)) if final else None)


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
    # the keys an adapter changes: a quantized output keeps them unquantized (output_quantization: input)
    adapted = MergedState(model_state, scalings).adapted_keys() if merge else frozenset()
    check = None
    if merge and verify:
        quantized = any(is_quantized_base(p) for p in model.parameters())
        if not quantized and not checkpointer.rounds:
            # the model as it trains computes what merged/ must, to the merge's rounding
            check = ExportCheck(model, report=report, reload=verify, merged=True)
        elif not dist.enabled:  # a 4-bit base computes something else, a re-quantized output holds something else:
            # the reference is the merge itself, in memory (as the output's format rounds it)
            written = (lambda m: checkpointer.as_written(m, adapted)) if checkpointer.rounds else None
            check = _merged_reference_check(model, model_state, scalings, original, sources, verify, report,
                                            written, checkpointer.output_warnings.append)
        else:
            report("note: the merged model is not read back under torchrun with quantize_base (its full-precision "
                   "reference would have to be gathered); scripts/convert.py --verify checks it afterwards")

    def writer(state: Mapping[str, Any]) -> Callable[[StagedDir], None]:
        def write(stage: StagedDir) -> None:
            write_adapter(stage, model, converter, base_name, max_lora_rank, layout=layout, adapter=state["adapter"])
            write_tokenizer(stage, checkpointer)
            stage.write(RECIPE_STATE_FILE, lambda f: torch.save(state["recipe_state"], f))
            if merge:
                with GatheredState(model_state) if dist.enabled else nullcontext({**model_state, **state["adapter"]}) as whole:
                    checkpointer.save_to({"model": MergedState(whole, scalings, original, sources)},
                                         stage.path / MERGED_DIR, check=check, adapted=adapted)
        return write
    return StepContent({"adapter": adapter, "recipe_state": recipe.as_dict()}, writer,
                       serve=(lambda: serve_gathers(model_state)) if merge else None)


def write_tokenizer(stage: StagedDir, checkpointer) -> None:
    """Beside an adapter, the input's tokenizer files and, where the run trains with another chat template than the
    input's own, that one (``chat_template.jinja`` from ``output_files``), as ``merged/`` gets them: transformers'
    ``AutoTokenizer.from_pretrained(step_N)``, what PEFT and vLLM users load with the adapter, prompts as it trained."""
    files = {name: data for name, data in checkpointer.output_files.items() if name in TOKENIZER_FILES}
    for path in checkpointer.side_files(skip=frozenset(files)):
        if path.name in TOKENIZER_FILES:
            stage.copy_file(path)
    for name, data in files.items():
        stage.write_bytes(name, data)


def write_gathered(stage: StagedDir, checkpointer, model_state: Mapping[str, Any], check: ExportCheck | None = None) -> None:
    """Rank 0: a sharded model in the input's format and files, each tensor gathered from every rank as its file is
    written (the other ranks run ``serve_gathers(model_state)`` meanwhile), checked before anything is committed."""
    with GatheredState(model_state) as gathered:
        _checked(checkpointer.writer({"model": gathered}), check)(stage)


def _merged_reference_check(model, model_state, scalings, original, sources, verify: ExportReload, report,
                            written=None, warn=None) -> ExportCheck:
    # in the model's dtype; where the output rounds (re-quantizes) the merge, in the dtypes the writer is given,
    # so the reference is rounded from the very values the files are
    dtype = None if written is not None else next(p.dtype for p in model.parameters()
                                                  if p.is_floating_point() and not is_quantized_base(p))
    reference = verify.fresh_model()
    load_into(reference, MergedState(model_state, scalings, original, sources), dtype=dtype, device="cpu")
    check = ExportCheck(reference, report=report, reload=verify, written=written, warn=warn)
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
