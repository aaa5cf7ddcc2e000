"""LoRA adapters in PEFT's format: ``adapter_model.safetensors`` + ``adapter_config.json``.

Keys are ``base_model.model.<HF module path>.lora_A.weight`` / ``.lora_B.weight``; the HF module path of a
native layer comes from the family's converter (the native weight key mapped through its rules: a checkpointer's
``hf_converter()``). The q
and k projections' rows are RoPE-permuted between the layouts, so ``lora_B`` (whose rows are the
projection's output rows) goes through the same op as the base weight; ``lora_A`` (input columns)
needs none. Targets that a converter does not map one-to-one (Phi-3's fused ``qkv_proj`` and
``gate_up_proj``) are refused: PEFT's module there is the fused one.

Loading (``load_adapter``) runs the mapping backwards, for adapters written by us or by PEFT.
At save, the adapter is checked against what vLLM serves for its family (``vllm_problems``); each problem is a warning.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from waypoint.checkpointers.commit import StagedDir
from waypoint.checkpointers.file_formats import json_bytes, read_json, read_tensors
from waypoint.checkpointers.peft_parameters import (bare_targets, check_shapes, is_bare_matrix, is_parameter_target,
                                                    native_module_of, native_targets, parameter_names, peft_module, peft_stem,
                                                    targeted)
from waypoint.errors import CheckpointError, first_line
from waypoint.families.family import VLLM_LORA_MODULES
from waypoint.lazy import on_host, spec_of
from waypoint.converters.ops import Identity, RopePermute
from waypoint.converters.table import Converter, Rule

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OTHER_BASE = f"the adapter was trained for another base model (see base_model_name_or_path in its {ADAPTER_CONFIG})"
PEFT_PREFIX = "base_model.model."
INNER_LINEAR = "linear"  # where transformers' Gemma4ClippableLinear keeps its nn.Linear, between its clamps
DEFAULT_MAX_LORA_RANK = 16
# The adapter modules vLLM serves for a family that declares none (each family's vllm_lora_modules: families.family)
VLLM_TARGETS = VLLM_LORA_MODULES
VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


def _single_rule(converter: Converter, key: str, side: str) -> tuple[Rule, str]:
    """The rule mapping ``key`` (of ``side``) to exactly one key of the other side, and that key."""
    try:
        groups = converter.plan([key], side)
    except CheckpointError:
        groups = []
    if len(groups) != 1 or len(groups[0].sources) != 1 or len(groups[0].targets) != 1 \
            or not isinstance(groups[0].rule.op, (Identity, RopePermute)):
        raise CheckpointError(f"{key}: the converter does not map this layer one-to-one to a Hugging Face module "
                              "(a fused projection?), so its LoRA cannot be written in PEFT's format; choose other lora.targets")
    return groups[0].rule, groups[0].targets[0]


def hf_module(converter: Converter, native_module: str) -> str:
    return peft_stem(_single_rule(converter, f"{native_module}.weight", "native")[1])


def to_peft(adapter: Mapping[str, torch.Tensor], converter: Converter) -> dict[str, torch.Tensor]:
    """Native adapter tensors (``<module>.lora_A.weight``, ...) -> PEFT keys and layout."""
    return to_layout(adapter, converter, PEFT_PREFIX)


def to_layout(adapter: Mapping[str, torch.Tensor], converter: Converter, prefix: str = "") -> dict[str, torch.Tensor]:
    """Native adapter tensors -> the module names and row layout of ``converter``'s other side (HF for PEFT;
    Meta's ``layers.{i}.attention.wq`` or native names for ``adapter_meta/native.safetensors``)."""
    out = {}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in adapter})
    parameters = targeted(converter, modules)
    for module in modules:
        if is_parameter_target(module):  # PEFT's target_parameters: its own layout already (peft_parameters)
            stem = prefix + (peft_module(converter, module, parameters) if converter.lora_parameters else module)
            for part in ("lora_A", "lora_B"):
                out[f"{stem}.{part}.weight"] = adapter[f"{module}.{part}.weight"].contiguous()
            if module.rsplit(".", 1)[-1] in converter.lora_halves:  # interleaved gate/up rows -> halves
                out[f"{stem}.lora_B.weight"] = interleaved_to_halves(out[f"{stem}.lora_B.weight"])
            continue
        rule, hf_key = _single_rule(converter, f"{module}.weight", "native")
        path = prefix + peft_stem(hf_key)
        out[f"{path}.lora_A.weight"] = adapter[f"{module}.lora_A.weight"].contiguous()
        (out[f"{path}.lora_B.weight"],) = rule.op.inverse([adapter[f"{module}.lora_B.weight"]])
        out[f"{path}.lora_B.weight"] = out[f"{path}.lora_B.weight"].contiguous()
    return out


def interleaved_to_halves(rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rows ``[g0, u0, g1, u1, ...]`` -> ``[g0, g1, ..., u0, u1, ...]`` (``inverse``: back)."""
    shape = (2, -1) if inverse else (-1, 2)
    return rows.unflatten(0, shape).transpose(0, 1).flatten(0, 1).contiguous()


def from_peft(tensors: Mapping[str, torch.Tensor], converter: Converter, source: str = ADAPTER_WEIGHTS,
              base: Mapping[str, torch.Tensor] | None = None, rank: int | None = None,
              target_parameters: list[str] | None = None) -> dict[str, torch.Tensor]:
    """PEFT adapter tensors -> native adapter tensors (the inverse of ``to_peft``). With ``base`` (the native state
    dict it is merged onto) and ``rank`` (adapter_config.json's ``r``), every tensor is checked to fit: an adapter
    of another base model is one line naming ``source`` and the key, not a shape error in the merge.
    ``target_parameters`` (adapter_config.json's): which stacked parameters its ``experts`` keys adapt, and which bare
    matrix a module's keys adapt (Gemma 3's projector)."""
    out = {}
    stems = {k.removeprefix(PEFT_PREFIX).split(".lora_")[0] for k in tensors}
    bare, experts = bare_targets(converter, target_parameters or [], stems)
    parameters = native_targets(converter, experts, source)
    for key, t in tensors.items():
        stem = key.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if stem.endswith(suffix) or stem.endswith(f".{part}.default.weight"):
                module = stem[: stem.rindex(f".{part}.")]
                break
        else:
            raise CheckpointError(f"{source}: key {key!r} is not a LoRA A/B weight (only plain LoRA adapters load)")
        if module in bare:  # a bare matrix's (Gemma 3's projector): [r, in] and [out, r] of [out, in], as a linear's
            _check_fits(key, part, t, source, rank, base, f"{bare[module]}.weight", module)
            out[f"{bare[module]}.{part}.weight"] = t
            continue
        native_module = native_module_of(converter, module, parameters)
        if native_module is not None:
            check_shapes(key, part, tuple(t.shape), base, native_module, rank, source)
            if part == "lora_B" and native_module.rsplit(".", 1)[-1] in converter.lora_halves:
                t = interleaved_to_halves(t, inverse=True)
            out[f"{native_module}.{part}.weight"] = t
            continue
        try:
            rule, native_key = _single_rule(converter, f"{module}.weight", "hf")
        except CheckpointError:
            raise CheckpointError(f"{source}: {key}: this base has no {module} that a plain LoRA can adapt; "
                                  f"{OTHER_BASE}, or adapts a fused projection") from None
        native_module = native_key.removesuffix(".weight")
        _check_fits(key, part, t, source, rank, base, native_key, module)
        if part == "lora_B":
            try:
                (t,) = rule.op.forward([t])
            except ValueError as e:  # RopePermute: rows of other heads
                raise CheckpointError(f"{source}: {key} {first_line(e)}; {OTHER_BASE}") from None
        out[f"{native_module}.{part}.weight"] = t
    return out


def _check_fits(key: str, part: str, t: torch.Tensor, source: str, rank: int | None,
                base: Mapping[str, torch.Tensor] | None, native_key: str, module: str) -> None:
    """Raise when ``t`` (``key``'s lora_A [r, in] or lora_B [out, r]) cannot adapt the base's ``native_key``."""
    if t.ndim != 2:
        raise CheckpointError(f"{source}: {key} has shape {list(t.shape)}, expected a matrix")
    if rank is not None and t.shape[0 if part == "lora_A" else 1] != rank:
        raise CheckpointError(f"{source}: {key} has shape {list(t.shape)}, not rank r={rank} of {ADAPTER_CONFIG}")
    if base is None:
        return
    try:
        shape = spec_of(base, native_key)[0]  # a lazy state's shape, without reading the tensor
    except KeyError:
        raise CheckpointError(f"{source}: {key} adapts {module}, which the base model lacks; {OTHER_BASE}") from None
    axis = 1 if part == "lora_A" else 0  # A reads the weight's input columns, B writes its output rows
    if len(shape) != 2 or t.shape[axis] != shape[axis]:
        raise CheckpointError(f"{source}: {key} has shape {list(t.shape)}, but the base's {module}.weight is "
                              f"{list(shape)}; {OTHER_BASE}")


def check_targets(model: torch.nn.Module, converter: Converter, family=None) -> None:
    """Raise the one-line CheckpointError ``write_adapter`` would, before any training: a target the family's PEFT
    modules cannot name (fused projections, stacked experts)."""
    from waypoint.models.lora import lora_modules

    modules = list(lora_modules(model))
    for module in modules:
        name = module.rsplit(".", 1)[-1]
        if family is not None and name not in family.lora_targets and not module.startswith("vision.") \
                and not is_bare_matrix(module):
            raise CheckpointError(f"lora.targets: {name} cannot be adapted in {family.name} models in PEFT's format; "
                                  f"choose from {', '.join(family.lora_targets)}")
        if is_parameter_target(module):
            peft_module(converter, module, targeted(converter, modules))
        else:
            _single_rule(converter, f"{module}.weight", "native")


def adapter_config(converter: Converter, native_modules: list[str], rank: int, alpha: float, dropout: float,
                   base_model_name_or_path: str) -> dict[str, Any]:
    modules = [hf_module(converter, m) for m in native_modules if not is_parameter_target(m) and not is_bare_matrix(m)]
    targets: list[str] | str = sorted({m.rsplit(".", 1)[-1] for m in modules})
    # a multimodal repo's parts ("model.language_model.", "model.visual.") -> names; a clamping linear's inner
    # ``linear`` (Gemma 4's tower, transformers' Gemma4ClippableLinear) by its owner's name: PEFT wraps that nn.Linear
    nests: dict[tuple[str, str], set[str]] = {}
    for m in modules:
        *_, owner, name = ("." + m).rsplit(".", 2)
        inner = name == INNER_LINEAR
        nests.setdefault((_nest(m), r"\." + INNER_LINEAR if inner else ""), set()).add(owner if inner else name)
    if any(nest not in ("", "model.") for nest, _ in nests):  # a multimodal repo's language model (Gemma 4's
        # "model.language_model."), or its tower too: PEFT's regex form, so that each part's names wrap that part only
        parts = [(re.escape(nest) + r".*\." if nest not in ("", "model.") else r"(?:.*\.)?") + "(?:" + "|".join(sorted(names)) + ")"
                 + suffix for (nest, suffix), names in sorted(nests.items())]
        targets = parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"
    parameters = parameter_names(converter, targeted(converter, native_modules))
    parameters += [_single_rule(converter, f"{m}.weight", "native")[1] for m in native_modules if is_bare_matrix(m)]
    return {**({"target_parameters": parameters} if parameters else {}),
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "inference_mode": True, "modules_to_save": None, "base_model_name_or_path": base_model_name_or_path,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "revision": None,
    }


def _nest(module: str) -> str:
    """The part of a multimodal repo a PEFT module name is in: ``model.language_model.``, ``model.visual.``,
    ``model.vision_tower.`` (its first two names under ``model.``); "" or ``model.`` for a text model's."""
    parts = module.split(".")
    if parts[0] == "model" and len(parts) > 2 and not parts[1].isdigit() and parts[1] != "layers":
        return f"model.{parts[1]}."
    return "model." if parts[0] == "model" else ""


def target_names(target_modules: list[str] | str | None) -> list[str]:
    """The module names an adapter config's ``target_modules`` lists, or its regex form (``adapter_config``'s: one
    ``(?:a|b)`` group of names per part) ends with."""
    if isinstance(target_modules, str):
        return sorted({name for group in re.findall(r"\(\?:([\w|]+)\)", target_modules) for name in group.split("|")})
    return list(target_modules or [])


def vllm_problems(config: Mapping[str, Any], max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
                  supported: frozenset[str] = VLLM_TARGETS) -> list[str]:
    """What would stop vLLM (``--enable-lora --max-lora-rank``) from serving this adapter, one line each;
    ``supported``: the module names vLLM serves LoRA on for the adapter's family (a converter's ``vllm_lora_modules``)."""
    problems = []
    if int(config.get("r", 0)) > max_lora_rank:
        problems.append(f"vLLM: rank r={config['r']} exceeds max_lora_rank={max_lora_rank} (serve with --max-lora-rank "
                        f"{min([v for v in VLLM_RANKS if v >= int(config['r'])] or [int(config['r'])])})")
    if config.get("bias", "none") != "none":
        problems.append(f"vLLM: bias={config['bias']!r} is not supported (LoRA biases are ignored or refused); use bias='none'")
    if config.get("modules_to_save"):
        problems.append(f"vLLM: modules_to_save={config['modules_to_save']} is not supported; those modules would not be served")
    unsupported = sorted(set(target_names(config.get("target_modules"))) - supported)
    if unsupported:
        problems.append(f"vLLM: target module(s) {', '.join(unsupported)} are not supported LoRA modules "
                        f"(supported: {', '.join(sorted(supported))})")
    if config.get("use_dora") or config.get("use_rslora"):
        problems.append("vLLM: DoRA / rsLoRA adapters are not supported")
    return problems


def warn_vllm(config: Mapping[str, Any], max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
              supported: frozenset[str] = VLLM_TARGETS) -> list[str]:
    problems = vllm_problems(config, max_lora_rank, supported)
    for line in problems:
        warnings.warn(line, stacklevel=3)
    return problems


def write_adapter(stage: StagedDir, model: torch.nn.Module, converter: Converter, base_model_name_or_path: str,
                  max_lora_rank: int = DEFAULT_MAX_LORA_RANK, layout: tuple[str, Converter] | None = None,
                  adapter: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Stage ``adapter_model.safetensors`` and ``adapter_config.json`` for ``model``'s LoRA layers, and with
    ``layout=(name, converter)`` (a Meta or native input) the adapter in that format's keys as ``adapter_<name>.safetensors``.
    ``adapter``: the adapter tensors when already gathered (a sharded model), else ``adapter_state(model)``."""
    from waypoint.models.lora import adapter_state, lora_modules

    modules = lora_modules(model)
    if not modules:
        raise CheckpointError("the model has no LoRA layers (apply_lora first)")
    adapter = adapter_state(model) if adapter is None else adapter
    first = next(iter(modules.values()))
    return write_adapter_tensors(stage, adapter, converter, first.rank, first.alpha, first.dropout_p,
                                 base_model_name_or_path, max_lora_rank, layout, list(modules))


def write_adapter_tensors(stage: StagedDir, adapter: Mapping[str, torch.Tensor], converter: Converter, rank: int,
                          alpha: float, dropout: float, base_model_name_or_path: str,
                          max_lora_rank: int = DEFAULT_MAX_LORA_RANK, layout: tuple[str, Converter] | None = None,
                          modules: list[str] | None = None) -> dict[str, Any]:
    """``write_adapter`` from the native adapter tensors and their LoRA settings (no model: a state dict's
    ``adapter``, ``checkpointers.torchtune_compat``); ``modules``: the adapted native modules (by default the
    tensors')."""
    modules = modules if modules is not None else sorted({k.rsplit(".lora_", 1)[0] for k in adapter})
    adapter = {k: on_host(v, k) for k, v in adapter.items()}  # wherever the model lives (CUDA), written from the host
    tensors = to_peft(adapter, converter)  # validates every target before anything is written
    config = adapter_config(converter, list(modules), rank, alpha, dropout, base_model_name_or_path)
    warn_vllm(config, max_lora_rank, converter.vllm_lora_modules or VLLM_TARGETS)
    payload = save(tensors, metadata={"format": "pt"})
    stage.write_bytes(ADAPTER_WEIGHTS, payload)
    stage.write_bytes(ADAPTER_CONFIG, json_bytes(config))
    if layout is not None:
        name, own = layout
        stage.write_bytes(f"adapter_{name}.safetensors", save(to_layout(adapter, own), metadata={"format": "pt"}))
    return config


def read_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    config = read_json(Path(directory) / ADAPTER_CONFIG)
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{Path(directory) / ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r}; only LORA adapters load")
    for key, plain in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False)):
        if config.get(key, plain) != plain:
            raise CheckpointError(f"{Path(directory) / ADAPTER_CONFIG}: {key}={config[key]!r} is not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise CheckpointError(f"{Path(directory) / ADAPTER_CONFIG}: bias / modules_to_save adapters are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise CheckpointError(f"{Path(directory) / ADAPTER_CONFIG}: per-module rank_pattern / alpha_pattern are not supported")
    for key, fits, expected in (("r", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
                                ("lora_alpha", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")):
        if key not in config:
            raise CheckpointError(f"{Path(directory) / ADAPTER_CONFIG}: lacks {key}")
        if not fits(config[key]):
            raise CheckpointError(f"{Path(directory) / ADAPTER_CONFIG}: {key}={config[key]!r}, expected {expected}")
    return config


def load_adapter(directory: str | os.PathLike, converter: Converter, base: Mapping[str, torch.Tensor] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(native adapter tensors, adapter_config) of a PEFT LoRA adapter directory (ours or PEFT's); with ``base``, the
    native state dict it is for, each tensor is checked to fit its weight (``from_peft``)."""
    directory = Path(directory)
    config = read_adapter_config(directory)
    weights = next((directory / name for name in (ADAPTER_WEIGHTS, "adapter_model.bin") if (directory / name).is_file()), None)
    if weights is None:
        raise CheckpointError(f"{directory / ADAPTER_WEIGHTS}: missing")
    tensors = read_tensors(weights)
    return from_peft(tensors, converter, str(weights), base, int(config["r"]), config.get("target_parameters")), config


def other_base(config: Mapping[str, Any], checkpoint_dir: str | os.PathLike, family=None, recorded_name: str | None = None
               ) -> str | None:
    """Why an adapter (its adapter_config.json ``config``) looks trained for another base than the checkpoint in
    ``checkpoint_dir`` (of ``family``), or None: ``base_model_name_or_path`` names none of the checkpoint's names
    (its directory, ``recorded_name``: the name a LoRA run records for it, such as the hub repo it was downloaded
    from, config.json's ``_name_or_path``; compared by their last path part, so a moved base is the same), or the model class PEFT records (``auto_mapping``) is of another family.
    What the adapter does not record is not compared."""
    reasons = []
    recorded = config.get("base_model_name_or_path")
    if isinstance(recorded, str) and recorded.strip() and _last_part(recorded) not in base_names(checkpoint_dir, recorded_name):
        reasons.append(f"base_model_name_or_path is {recorded!r}, not {checkpoint_dir}")
    mapping = config.get("auto_mapping")
    trained_on = mapping.get("base_model_class") if isinstance(mapping, Mapping) else None
    if family is not None and isinstance(trained_on, str) and _model_family(trained_on) != _model_family(family.architecture):
        reasons.append(f"it was trained on a {trained_on}, the base is a {family.architecture}")
    return "; ".join(reasons) or None


def warn_other_base(adapter_dir: str | os.PathLike, config: Mapping[str, Any], checkpoint_dir: str | os.PathLike,
                    family=None, recorded_name: str | None = None) -> str | None:
    """One ``warning:`` line on stderr when ``other_base`` finds a reason; the merge goes on (a renamed copy of the
    base is still its base). Returns the reason."""
    reason = other_base(config, checkpoint_dir, family, recorded_name)
    if reason:
        print(f"warning: {Path(adapter_dir) / ADAPTER_CONFIG}: {reason}; merged anyway, but an adapter merged onto "
              "another base model gives nonsense: check that the adapter belongs to this base", file=sys.stderr)
    return reason


def base_names(checkpoint_dir: str | os.PathLike, recorded_name: str | None = None) -> set[str]:
    """The names an adapter's ``base_model_name_or_path`` may give the checkpoint in ``checkpoint_dir``, each as
    ``_last_part``: the directory's, ``recorded_name`` (what a LoRA run records for it: cli.hub's
    ``base_model_name``, the hub repo id when it was downloaded), config.json's ``_name_or_path``, and the repo of a
    hub cache folder (``models--org--name``)."""
    path = Path(checkpoint_dir).resolve()
    names = [path.name, recorded_name]
    if (path / "config.json").is_file():
        config = read_json(path / "config.json")
        names.append(config.get("_name_or_path") if isinstance(config, Mapping) else None)
    names += [p.name.rsplit("--", 1)[-1] for p in path.parents if p.name.startswith("models--")]
    return {_last_part(n) for n in names if isinstance(n, str) and n.strip()}


def _last_part(name: str) -> str:
    """``org/Name`` and ``/data/Name/`` -> ``name``."""
    return name.strip().rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1].lower()


def _model_family(class_name: str) -> str:
    """``LlamaForCausalLM`` and ``LlamaModel`` -> ``llama``."""
    return re.sub(r"(For[A-Z]\w*|Model)$", "", class_name).lower()
