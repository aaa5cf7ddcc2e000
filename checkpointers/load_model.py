"""Filling a meta-device model from a native state dict (or a torchrun step's shards), and the one-call ``load_model``.

The model is built on the meta device (no memory) and its parameters are
*assigned* the loaded tensors (``load_state_dict(assign=True)``), which are
memory-mapped views of the files: loading peaks at about one copy of the model.
Build the optimizer after this, so it holds the parameters the model really uses.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from waypoint.checkpointers.extra_state import EXTRA_STATE_FILE, is_extra_state_key, load_extra_state
from waypoint.checkpointers.formats import checkpointer_for, detect_format
from waypoint.checkpointers.load_report import LoadReport, fold_keys
from waypoint.checkpointers.sharded_checkpoint import SHARDED_DIR, load_sharded, sharded_keys
from waypoint.converters.table import ConvertedState
from waypoint.errors import CheckpointError
from waypoint.families import from_hf_config
from waypoint.lazy import local_shard, release_heap, release_pages, spec_of
from waypoint.models.extra_state import EXTRA_STATE_SUFFIX
from waypoint.models import Transformer, parse_dtype
from waypoint.models.nf4 import is_nf4, nf4_local_shard
from waypoint.models.quantized_base import carry_source, is_quantized_base, quantized_format
from waypoint.models.swap import swapping_conversions


log = logging.getLogger(__name__)


def _fold(keys: list[str]) -> str:
    return f"{keys[0]!r}" + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")


HEAD_KEYS = ("output.weight",)  # a head that a headless skeleton drops (reported), as from_pretrained does


def map_prefixes(state_keys: list[str], model_keys: list[str], key_prefix_map: Mapping[str, str] | None = None) -> dict[str, str]:
    """Checkpoint key -> model key.

    Declared ``key_prefix_map`` entries (``{"model.": "backbone."}``) rename first. Otherwise the
    standard cases are detected: keys match as they are; the checkpoint carries a prefix the
    model lacks; or the model nests the backbone under a prefix the checkpoint lacks.
    """
    if key_prefix_map:
        renamed = {}
        for key in state_keys:
            for source, target in key_prefix_map.items():
                if key.startswith(source):
                    renamed[key] = target + key[len(source):]
                    break
            else:
                renamed[key] = key
        return renamed
    model_set = set(model_keys)
    candidates = [{k: k for k in state_keys}]
    for key in state_keys:  # the checkpoint has a prefix the model lacks
        if "." in key:
            prefix = key.split(".", 1)[0] + "."
            candidates.append({k: k[len(prefix):] if k.startswith(prefix) else k for k in state_keys})
    for key in model_keys:  # the model nests the backbone
        if "." in key:
            prefix = key.split(".", 1)[0] + "."
            candidates.append({k: prefix + k for k in state_keys})
    return max(candidates, key=lambda mapping: sum(v in model_set for v in mapping.values()))


def load_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor], dtype: torch.dtype | str | None = None,
              device: torch.device | str | None = None, strict: bool = True,
              key_prefix_map: Mapping[str, str] | None = None, fill_later: Iterable[str] = ()) -> LoadReport:
    """Assign ``state`` to ``model``'s parameters and return what was done.

    Shapes are checked first (one-line errors naming the key). ``strict`` (the default) makes
    missing and unexpected keys an error that lists them; a head the model lacks is always dropped
    and reported. ``strict=False`` allows new heads (left as initialised, named in the report).
    Tensors keep their dtype unless ``dtype`` is given; ``*._extra_state`` entries go to the modules'
    ``set_extra_state`` (a checkpoint older than a module's extra state loads with its defaults).
    ``fill_later``: model keys the checkpoint does not have and the caller fills itself (adapters added on
    the meta device); they are left as they are.
    """
    dtype = parse_dtype(dtype)
    own = model.state_dict()
    fill_later = set(fill_later)
    expected = {k: v for k, v in own.items() if not is_extra_state_key(k) and k not in fill_later}
    tensor_keys = [k for k in state if not is_extra_state_key(k)]
    mapping = map_prefixes(tensor_keys, list(expected), key_prefix_map)
    report = LoadReport(renamed={k: v for k, v in mapping.items() if k != v})
    matched: dict[str, str] = {}  # model key -> checkpoint key; tensors are read one at a time, when placed
    order = {k: i for i, k in enumerate(expected)}
    for key, target in sorted(mapping.items(), key=lambda item: order.get(item[1], len(order))):  # model order
        if target not in expected:
            report.unexpected.append(key)
        elif spec_of(state, key)[0] != expected[target].shape:
            if strict:
                raise CheckpointError(f"{target}: checkpoint shape {tuple(spec_of(state, key)[0])} does not fit the model's "
                                      f"{tuple(expected[target].shape)}")
            report.mismatched.append(target)
        else:
            matched[target] = key
    dropped_heads = [k for k in report.unexpected if mapping[k].endswith(HEAD_KEYS)]
    missing = sorted(expected.keys() - matched.keys())
    tied = [k for k in missing if k.endswith(HEAD_KEYS) and getattr(getattr(model, "args", None), "tie_embeddings", False)]
    missing = [k for k in missing if k not in tied]
    if strict and missing:
        absent, named = _absent_file_keys(state, missing, report.renamed)
        if absent:  # a save writes the input's layout: these cannot be trained in (strict=false) and written out
            files = state.files
            where = f"{files[0]}: " if len(files) == 1 else f"{files[0]} ... ({len(files)} files): " if files else ""
            raise CheckpointError(f"{where}checkpoint lacks {_fold(fold_keys(absent))} (the model's "
                                  f"{_fold(fold_keys(named))}), which its config asks for and every save writes: the "
                                  "checkpoint is incomplete; re-download or re-export it, or correct config.json if "
                                  "the model has no such weight")
        raise CheckpointError(f"checkpoint lacks model key {_fold(fold_keys(missing))} (strict: set strict=false to allow new heads)")
    if strict and len(report.unexpected) > len(dropped_heads):
        others = sorted(set(report.unexpected) - set(dropped_heads))
        raise CheckpointError(f"checkpoint has key {_fold(fold_keys(others))} that the model does not")

    def place(value, like, keep: bool = False):
        cast = dtype if dtype is not None and value.is_floating_point() and not keep else None
        if isinstance(like, DTensor):  # a sharded (FSDP2) model: this rank's piece only
            if is_nf4(like):  # quantized whole (the shards keep one set of scales), then cut
                return nf4_local_shard(value, like, device=device)
            return local_shard(value, like, device=device, dtype=cast)
        return carry_source(value, value.to(device=device, dtype=cast))  # a block-FP8 origin stays (converters.fp8)

    # One tensor at a time, each through load_state_dict with swapping on: the parameter object stays (an
    # optimizer or FSDP2 holding it stays valid) and decides how to take the tensor (module_load: an NF4
    # placeholder quantizes it). Memory-mapped tensors the model does not keep (cast, quantized or sharded
    # copies) have their pages dropped as soon as they are placed, so a load that converts holds about one
    # full-precision tensor at a time, never the whole checkpoint.
    held: dict[str, int | None] = {}  # model key -> data pointer of what the checkpoint gave it (None: quantized)
    taken: set[int] = set()  # parameter objects already filled (a tied pair is one object: filled once)
    with swapping_conversions():
        for target, key in matched.items():
            owner_name, _, leaf = target.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            if id(getattr(owner, leaf)) in taken:
                report.retied.append(target)
                continue
            raw = state[key]
            value = place(raw, expected[target], keep=leaf in getattr(owner, "keep_dtype", ()))
            piece = {leaf: value}
            if f"{owner_name}.{EXTRA_STATE_SUFFIX}".lstrip(".") in own:  # its extra state loads below, once; kept as is here
                piece[EXTRA_STATE_SUFFIX] = owner.get_extra_state()
            owner.load_state_dict(piece, strict=False, assign=True)
            now = getattr(owner, leaf)
            taken.add(id(now))
            quantized = is_quantized_base(now)  # NF4 or MXFP4: the checkpoint's tensor was quantized as it was read
            held[target] = None if quantized else _ptr(value)
            if quantized or held[target] != _ptr(raw):
                release_pages(raw)
            del raw, value
            if quantized:  # the quantizer's temporaries, returned to the system rather than kept as heap
                release_heap()
    # Extra state last, in one pass over every module (also with none: a module whose extra state the checkpoint
    # predates says so, and keeps its own)
    extra = {k: state[k] for k in state if is_extra_state_key(k) and k in own}
    model.load_state_dict(extra, strict=False)
    refresh_derived(model)

    for key in missing:  # new heads (strict=False): materialise and initialise what the checkpoint lacks
        _initialise_new(model, key, device, dtype)

    # From the model as it now is: which parameters hold a checkpoint tensor, which were re-tied.
    after = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    report.quantized = sorted(k for k, ptr in held.items() if ptr is None and k in after and is_quantized_base(after[k]))
    report.quantized_as = sorted({quantized_format(after[k]) for k in report.quantized})
    report.loaded = sorted(k for k, ptr in held.items() if ptr is not None and k in after and not is_quantized_base(after[k])
                           and _ptr(after[k]) == ptr)
    report.retied += sorted(k for k, ptr in held.items() if k in after and k not in report.loaded and k not in report.quantized)
    report.retied += [k for k in tied if not after[k].is_meta]
    report.retied.sort()
    report.tied_to = {k: other for k in report.retied for other in report.loaded if after[other] is after[k]}
    report.sources = dict(matched)
    report.missing = sorted(missing)
    report.extra_state = sorted(extra)
    still_meta = sorted(k for k, t in after.items() if t.is_meta and k not in fill_later)
    if still_meta and strict:
        raise CheckpointError(f"after loading, {_fold(fold_keys(still_meta))} still has no data")
    for line in report.lines():
        log.info(line)
    return report


def _absent_file_keys(state: Mapping[str, torch.Tensor], missing: list[str],
                      renamed: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(The file keys a converted checkpoint, ``ConvertedState``, lacks for these missing model keys, the model keys
    they are): each model key named as the checkpoint names the others (``renamed``'s prefixes undone); nothing for
    any other state, or for keys no rule names (a new head)."""
    if not isinstance(state, ConvertedState):
        return [], []
    prefixes = set()  # (the checkpoint's prefix, the model's) of each renamed key
    for ours, theirs in renamed.items():
        common = len(os.path.commonprefix([ours[::-1], theirs[::-1]]))
        prefixes.add((ours[:len(ours) - common], theirs[:len(theirs) - common]))
    undone = {}
    for key in missing:
        ours, theirs = max(((o, t) for o, t in prefixes if key.startswith(t)), key=lambda p: len(p[1]), default=("", ""))
        undone[ours + key[len(theirs):]] = key
    absent = state.absent(list(undone))
    return absent, [undone[k] for k in state.named(list(undone))] if absent else []


def refresh_derived(model: torch.nn.Module) -> None:
    """What is not loaded but follows from what was: re-tied weights, every rotary table."""
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    for module in model.modules():  # also in a model that nests the backbone
        if hasattr(module, "reset_rope"):
            module.reset_rope()


def load_sharded_into(model: torch.nn.Module, directory: str | os.PathLike, dtype: torch.dtype | str | None = None,
                      device: torch.device | str | None = None) -> LoadReport:
    """Fill a meta-device model (plain or FSDP2-sharded) from a sharded checkpoint ``directory`` (a step
    directory of a multi-process run), whatever number of processes wrote it; each rank reads its shards."""
    directory = Path(directory)
    dtype = parse_dtype(dtype)
    if dtype is not None:
        model.to(dtype=dtype)  # on the meta device: no memory
    model.to_empty(device=device or "cpu")
    refresh_derived(model)
    tensors = {k: v for k, v in model.state_dict().items() if not is_extra_state_key(k)}
    held = {k.removeprefix("model.") for k in sharded_keys(directory / SHARDED_DIR) if k.startswith("model.")}
    tied = {"output.weight"} if getattr(getattr(model, "args", None), "tie_embeddings", False) else set()
    missing = sorted(set(tensors) - held - tied)
    if missing:
        raise CheckpointError(f"{directory / SHARDED_DIR}: lacks model key {_fold(fold_keys(missing))}")
    load_sharded({"model": {k: v for k, v in tensors.items() if k in held}}, directory / SHARDED_DIR)
    extra = load_extra_state(directory / EXTRA_STATE_FILE) if (directory / EXTRA_STATE_FILE).is_file() else {}
    extra = {k: v for k, v in extra.items() if k in model.state_dict()}
    if extra:
        model.load_state_dict(extra, strict=False)
    refresh_derived(model)
    return LoadReport(loaded=sorted(held & set(tensors)), extra_state=sorted(extra))


def _ptr(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).data_ptr()


def _initialise_new(model: torch.nn.Module, key: str, device, dtype) -> None:
    """Give a still-empty (meta) parameter real memory: normal(0, 0.02) for weights, zeros for biases."""
    owner_name, _, attr = key.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    old = getattr(owner, attr)
    if not old.is_meta:
        return
    fresh = torch.empty(old.shape, dtype=dtype or old.dtype, device=device or "cpu")
    torch.nn.init.zeros_(fresh) if attr == "bias" else torch.nn.init.normal_(fresh, std=0.02)
    if isinstance(old, torch.nn.Parameter):
        setattr(owner, attr, torch.nn.Parameter(fresh, requires_grad=old.requires_grad))
    else:
        setattr(owner, attr, fresh)


def build_model(checkpoint_dir: str | os.PathLike, attn_dropout: float | None = None) -> Transformer:
    """The model (on the current default device: build it under ``torch.device("meta")``) that a checkpoint
    directory of any format describes; for configs: ``model: {_target_: waypoint.checkpointers.build_model, ...}``."""
    if detect_format(checkpoint_dir) == "hf":
        return from_hf_config(checkpoint_dir, attn_dropout=attn_dropout)
    args = checkpointer_for(checkpoint_dir).model_args()
    return Transformer(replace(args, attn_dropout=attn_dropout) if attn_dropout is not None else args)


def load_model(path: str | os.PathLike, dtype: torch.dtype | str | None = None) -> Transformer:
    """The ready native model for a checkpoint directory (format and family detected from its files)."""
    checkpointer = checkpointer_for(path)
    return model_from(checkpointer, checkpointer.load_checkpoint()["model"], dtype)


def model_from(checkpointer, state: Mapping[str, torch.Tensor], dtype: torch.dtype | str | None = None) -> Transformer:
    """The native model a loaded checkpointer describes, given ``state`` (its ``load_checkpoint()["model"]``)."""
    with torch.device("meta"):
        model = Transformer(checkpointer.model_args())
    load_into(model, state, dtype)
    return model
