"""PEFT's keys for LoRA on parameters (``LoraConfig(target_parameters=[...])``): stacked experts (gpt-oss's, ...) and
a bare matrix (Gemma 3's projector).

PEFT wraps each targeted parameter of a module in a ``ParamWrapper``; two targets on one module nest, the one the
module registers first innermost. Its adapter keys are the module's path plus one ``base_layer.`` per wrapper
outside it: with both of gpt-oss's targeted, ``mlp.experts.base_layer.lora_A.weight`` is ``gate_up_proj``'s and
``mlp.experts.lora_A.weight`` is ``down_proj``'s; with one, it has the plain key. So which parameter a key belongs
to depends on which are targeted: ``adapter_config.json``'s ``target_parameters`` says.

The tensors themselves need no conversion: ``models.lora_experts.LoRAExperts`` holds PEFT's ``[r * E, in]`` and
``[out, r * E]`` as they are. The family's converter names the HF parameter of each native target
(``Converter.lora_parameters``, in registration order).

A bare matrix (Gemma 3's ``multi_modal_projector.mm_input_projection_weight``, ``models.lora_vision``) is one parameter
of its module: PEFT wraps that module, its keys the module's (``model.multi_modal_projector.lora_A.weight``), and
``target_parameters`` names the parameter; the converter maps it one-to-one like a linear's weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from waypoint.converters.table import Converter
from waypoint.errors import CheckpointError

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
BARE_MATRICES = ("projector.weight",)  # native keys of the bare matrices a LoRA adapts (models.lora_vision.PROJECTOR's)


def is_bare_matrix(module: str) -> bool:
    """Whether a native LoRA module adapts a bare matrix, which PEFT adapts by ``target_parameters``."""
    return f"{module}.weight" in BARE_MATRICES


def peft_stem(hf_key: str) -> str:
    """The module path whose lora_A / lora_B adapt an HF weight: a linear's (``...q_proj.weight`` -> ``...q_proj``) or,
    for a bare matrix, the module that holds it (``model.multi_modal_projector.mm_input_projection_weight`` ->
    ``model.multi_modal_projector``)."""
    return hf_key.removesuffix(".weight") if hf_key.endswith(".weight") else hf_key.rpartition(".")[0]


def bare_targets(converter: Converter, names: Iterable[str], stems: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """Of an adapter_config.json's ``target_parameters``, those naming a bare matrix of this base that PEFT wrapped at
    one of ``stems`` (the module paths of the adapter's keys): ({stem: native module}, the other names)."""
    matrices = {}  # the base's bare matrices: HF key -> native module
    for native in BARE_MATRICES:
        try:
            matrices[converter.plan([native], "native")[0].targets[0]] = native.removesuffix(".weight")
        except CheckpointError:  # not in this model
            continue
    found, rest, stems = {}, [], list(stems)
    for name in names:
        hits = {}
        for stem in stems:
            key = f"{stem}.{name.rsplit('.', 1)[-1]}"  # PEFT's match: the parameter's path is the name or ends in .name
            if key in matrices and (key == name or key.endswith("." + name)):
                hits[stem] = matrices[key]
        found.update(hits)
        rest += [] if hits else [name]
    return found, rest


def is_parameter_target(module: str) -> bool:
    """Whether a native LoRA module path adapts stacked parameters (``layers.0.moe.experts_gate_up``)."""
    from waypoint.models.lora_experts import EXPERT_TARGETS

    return module.rsplit(".", 1)[-1] in EXPERT_TARGETS


def targeted(converter: Converter, modules: Iterable[str]) -> list[str]:
    """The native parameter targets among ``modules``, in the HF module's registration order."""
    present = {m.rsplit(".", 1)[-1] for m in modules if is_parameter_target(m)}
    return [t for t in converter.lora_parameters if t in present]


def peft_module(converter: Converter, module: str, targets: list[str]) -> str:
    """The key stem (``model.layers.0.mlp.experts.base_layer``) of a native parameter target's lora_A / lora_B."""
    target = module.rsplit(".", 1)[-1]
    if target not in converter.lora_parameters:
        raise CheckpointError(f"{module}: LoRA on these experts cannot be written in PEFT's format for this model family; "
                              "choose other lora.targets")
    layer = LAYER.search(module)
    path = converter.lora_parameters[target].format(i=layer.group(1) if layer else "")
    owner = path.rpartition(".")[0]
    return owner + ".base_layer" * (len(targets) - 1 - targets.index(target))


def parameter_names(converter: Converter, targets: list[str]) -> list[str]:
    """``target_parameters`` for adapter_config.json (``mlp.experts.gate_up_proj``: the path inside a layer)."""
    return [converter.lora_parameters[t].split("{i}.", 1)[-1] for t in targets]


def native_targets(converter: Converter, target_parameters: Iterable[str], source: str) -> list[str]:
    """The native targets an adapter_config.json's ``target_parameters`` name, in registration order; one this
    family cannot adapt is a one-line error naming it."""
    by_name = {p.split("{i}.", 1)[-1]: t for t, p in converter.lora_parameters.items()}
    found = []
    for name in target_parameters:
        match = next((t for p, t in by_name.items() if p == name or p.endswith("." + name) or name.endswith("." + p)), None)
        if match is None:
            known = ", ".join(by_name) or "none for this model family"
            raise CheckpointError(f"{source}: target_parameters names {name!r}, which this base does not have (known: {known})")
        found.append(match)
    return [t for t in converter.lora_parameters if t in found]


def native_module_of(converter: Converter, stem: str, targets: list[str]) -> str | None:
    """The native module (``layers.0.moe.experts_down``) of a PEFT key stem, given the adapter's parameter targets;
    None if the stem is not a parameter target's."""
    layer = LAYER.search(stem)
    for target in targets if layer else ():
        module = f"layers.{layer.group(1)}.moe.{target}"
        if stem == peft_module(converter, module, targets):
            return module
    return None


def check_shapes(key: str, part: str, shape: tuple[int, ...], base: Mapping | None, module: str, rank: int | None,
                 source: str) -> None:
    """A PEFT parameter target's lora_A ``[r * E, in]`` / lora_B ``[out, r * E]`` against the base's experts."""
    if len(shape) != 2:
        raise CheckpointError(f"{source}: {key} has shape {list(shape)}, expected a matrix")
    if base is None:
        return
    from waypoint.lazy import spec_of

    owner, _, target = module.rpartition(".")
    try:
        w1 = spec_of(base, f"{owner}.w1")[0]
    except KeyError:
        raise CheckpointError(f"{source}: {key} adapts experts {owner!r}, which the base model lacks") from None
    experts, hidden, dim = w1
    inputs, outputs = (dim, 2 * hidden) if target == "experts_gate_up" else (hidden, dim)
    expected = [rank * experts if rank else shape[0], inputs] if part == "lora_A" else [outputs, rank * experts if rank else shape[1]]
    if list(shape) != expected:
        raise CheckpointError(f"{source}: {key} has shape {list(shape)}, expected {expected} for {experts} experts"
                              f"{f' of rank {rank}' if rank else ''}; the adapter was trained for another base model")
