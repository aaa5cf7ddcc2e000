"""LoRA adapters on the native model's linear layers.

``apply_lora(model, targets, rank, alpha, dropout)`` replaces each targeted ``nn.Linear`` (by its
attribute name: ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``, ``w1``, ``w2``, ``w3``, ``output``)
with a :class:`LoRALinear` that keeps the base ``weight`` (and ``bias``) under the same key, frozen,
and adds ``lora_A.weight`` [rank, in] and ``lora_B.weight`` [out, rank]. Call it *after* the base
weights are loaded (``waypoint.checkpointers.load_into``), so the base keys stay the native ones; every other
parameter of the model is frozen too, so only adapter parameters reach the optimizer.

On a bf16 / fp16 base the adapter weights are fp32 (as PEFT keeps them); the update is cast to the base's
dtype. Initialisation is PEFT's: A Kaiming-uniform (a = sqrt(5)), B zeros, so the adapted model starts equal
to the base. ``output = base(x) + lora_B(lora_A(dropout(x))) * alpha / rank``, as PEFT computes it. A clamping
linear (Gemma 4's tower) keeps its clamps around that sum (:class:`ClippedLoRALinear`); the image side's targets
(``vision.NAME``, Gemma 3's projector matrix too) are :mod:`waypoint.models.lora_vision`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from waypoint.errors import CheckpointError
from waypoint.lazy import on_host, spec_of
from waypoint.models.gemma4_vision import ClippedLinear
from waypoint.models.lora_factors import LoRAFactors, initial_lora_weights
from waypoint.models.lora_experts import EXPERT_TARGETS, LoRAExperts, add_expert_lora, adapted_rows, merge_expert_weight
from waypoint.models.image_projector import ImageProjector
from waypoint.models.lora_vision import VISION, LoRAProjector, image_side_modules, vision_targets
from waypoint.models.vision_towers import IMAGE_SIDE

HALF = (torch.bfloat16, torch.float16)
TARGETS = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3", "output", *EXPERT_TARGETS,
           "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj",  # latent attention's (models.mla)
           "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",  # Gated DeltaNet's (models.gated_deltanet)
           "input_gate", "input_proj")  # Gemma 4's per-layer inputs (models.per_layer_embeddings)
HF_NAMES = {"o_proj": "output_proj", "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "lm_head": "output",  # also accepted
            "mlp.experts.gate_up_proj": "experts_gate_up", "mlp.experts.down_proj": "experts_down",
            "kv_a_proj_with_mqa": "kv_a_proj", "linear_attn.in_proj_qkv": "in_proj_qkv", "linear_attn.in_proj_z": "in_proj_z",
            "linear_attn.out_proj": "out_proj", "per_layer_input_gate": "input_gate", "per_layer_projection": "input_proj",
            "experts.gate_up_proj": "experts_gate_up", "experts.down_proj": "experts_down"}


class LoRALinear(LoRAFactors):
    """A frozen linear layer plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if rank < 1:
            raise CheckpointError(f"lora rank must be at least 1, got {rank}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.dropout_p = int(rank), float(alpha), float(dropout)
        self.scaling = self.alpha / self.rank
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        # fp32 adapters on a half-precision base (PEFT's autocast_adapter_dtype default): the optimizer's updates
        # to small adapter weights are not lost to bf16 rounding
        # Built on the meta device (drawing no random numbers), then initialised once: the same draws
        # whether the base is already loaded or still on the meta device (see initial_lora_weights).
        dtype = torch.float32 if base.weight.dtype in HALF else base.weight.dtype
        self.lora_A = nn.Linear(self.in_features, self.rank, bias=False, device="meta", dtype=dtype)
        self.lora_B = nn.Linear(self.rank, self.out_features, bias=False, device="meta", dtype=dtype)
        self.dropout = nn.Dropout(self.dropout_p) if self.dropout_p > 0 else nn.Identity()
        self.place_factors(base.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        if self.disabled:
            return result
        x = x.to(self.lora_A.weight.dtype)
        return result + (self.lora_B(self.lora_A(self.dropout(x))) * self.scaling).to(result.dtype)

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) * B @ A in fp32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}, dropout={self.dropout_p}"


class ClippedLoRALinear(LoRALinear):
    """LoRA on a clamping linear (Gemma 4's tower: ``ClippedLinear``): the input clamped, then base + LoRA product, then
    the sum clamped, as PEFT computes on the inner ``linear`` of transformers' ``Gemma4ClippableLinear``; the bounds
    are the base's buffers under the same keys, so a merge folds the update into the weight and keeps them as they are."""

    def __init__(self, base: ClippedLinear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__(base, rank, alpha, dropout)
        for name in ClippedLinear.BOUNDS:
            self.register_buffer(name, getattr(base, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(x, self.output_min, self.output_max)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes as its base (PEFT's ``disable_adapter()``): the reference model of
    preference tuning, with no second copy of the weights."""
    modules = list(lora_modules(model).values())
    for module in modules:
        module.disabled = True
    try:
        yield
    finally:
        for module in modules:
            module.disabled = False


def lora_modules(model: nn.Module) -> dict[str, LoRALinear | LoRAExperts | LoRAProjector]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAFactors)}


def apply_lora(model: nn.Module, targets: Iterable[str], rank: int, alpha: float, dropout: float = 0.0) -> list[str]:
    """Wrap every ``nn.Linear`` named in ``targets`` (native names, or HF's: ``o_proj``, ``gate_proj``, ...) in a LoRALinear and freeze all non-adapter parameters;
    returns the wrapped module paths. A vision-language model's tower and projector are adapted only where a target
    names them (``vision.q_proj``, ``vision.qkv``, ``vision.mm_input_projection_weight``: ``models.lora_vision``).
    Unknown target names and a LoRA on a tied head are one-line errors."""
    targets = list(targets)
    tower = vision_targets(targets)
    in_tower = image_side_modules(model, tower)
    targets = list(dict.fromkeys(HF_NAMES.get(t, t) for t in targets if not t.startswith(VISION)))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise CheckpointError(f"unknown lora target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    if not targets and not tower:
        raise CheckpointError("lora.targets is empty: name at least one of " + ", ".join(TARGETS))
    if "output" in targets and getattr(getattr(model, "args", None), "tie_embeddings", False):
        raise CheckpointError("lora target 'output' is tied to the embedding in this model; a LoRA on it would untie them")
    for p in model.parameters():
        p.requires_grad_(False)
    # the language model's layers: a vision-language model's tower (``vision.``, its own q_proj ...) is not adapted
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets and not name.startswith(IMAGE_SIDE)]
    chosen += in_tower
    experts = [(f"{name}.{t}", m) for name, m in model.named_modules() if hasattr(m, "experts_gate_up")
               for t in EXPERT_TARGETS if t in targets]  # mixture-of-experts layers' stacked weights
    absent = [t for t in targets if t in EXPERT_TARGETS and not experts]
    if absent:
        raise CheckpointError(f"lora target {absent[0]} adapts mixture-of-experts weights, which this model does not have")
    if not chosen and not experts:
        raise CheckpointError(f"no linear layer of the model is named {', '.join(targets + [VISION + t for t in tower])}")
    for name, module in chosen:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, adapted(module, rank, alpha, dropout))
    for name, moe in experts:
        add_expert_lora(moe, name.rsplit(".", 1)[-1], rank, alpha, dropout)
    chosen += experts
    model.lora_config = {"targets": targets, "rank": int(rank), "alpha": float(alpha), "dropout": float(dropout)}
    return [name for name, _ in chosen]


def adapted(module: nn.Module, rank: int, alpha: float, dropout: float) -> LoRAFactors:
    """The LoRA module that takes ``module``'s place: Gemma 3's projector's, a clamping linear's (its clamps kept: a
    plain LoRALinear computes F.linear and would lose them) or a linear's."""
    if isinstance(module, ImageProjector):
        return LoRAProjector(module, rank, alpha, dropout)
    return (ClippedLoRALinear if getattr(module, "clipped", False) else LoRALinear)(module, rank, alpha, dropout)


def adapter_state_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of the adapter weights (``adapter_state``'s keys), without reading them."""
    return [f"{name}.lora_{ab}.weight" for name in lora_modules(model) for ab in ("A", "B")]


def initial_adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Fresh adapter weights for a model whose LoRA layers were added on the meta device (a model to shard
    before loading), drawn as LoRALinear draws them on a loaded base: load them with the base weights."""
    out = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = initial_lora_weights(m.lora_A.weight, m.lora_B.weight)
    return out


def init_adapters(model: nn.Module, device: torch.device | str | None = None) -> list[str]:
    """Give LoRA layers added on the meta device (before sharding and loading) their initial weights, as
    they would have been drawn on a loaded base; in a sharded model each rank keeps its piece. Returns the keys."""
    from waypoint.lazy import local_shard

    own = model.state_dict()
    placed = {}
    for key, value in initial_adapter_state(model).items():
        like = own[key]
        placed[key] = local_shard(value, like, device=device) if hasattr(like, "device_mesh") else value.to(device)
    model.load_state_dict(placed, strict=False, assign=True)
    return list(placed)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a sharded (FSDP2) parameter: gathered


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` for every LoRALinear (native module paths), whole
    tensors (in a sharded model every rank must call this: the adapters are gathered)."""
    out = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A.weight"] = _whole(m.lora_A.weight.detach())
        out[f"{name}.lora_B.weight"] = _whole(m.lora_B.weight.detach())
    return out


def load_adapter_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter tensors (``adapter_state``'s keys) into the model's LoRA layers; missing, unexpected or
    misshapen keys are one-line errors."""
    own = {}
    for name, m in lora_modules(model).items():
        own[f"{name}.lora_A.weight"], own[f"{name}.lora_B.weight"] = m.lora_A.weight, m.lora_B.weight
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        problem = f"lacks {missing[0]!r}" if missing else f"has {unexpected[0]!r}, which the model has no LoRA layer for"
        raise CheckpointError(f"adapter {problem} ({len(missing)} missing, {len(unexpected)} unexpected keys)")
    with torch.no_grad():
        for key, target in own.items():
            if state[key].shape != target.shape:
                raise CheckpointError(f"adapter {key}: shape {tuple(state[key].shape)} does not fit the model's {tuple(target.shape)}")
            if hasattr(target, "device_mesh"):  # sharded: this rank's piece
                from waypoint.lazy import local_shard
                target.to_local().copy_(local_shard(state[key], target, dtype=target.dtype).to_local())
            else:
                target.copy_(state[key])


def merge_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B @ A, computed in fp32 and cast back to W's dtype."""
    return (weight.float() + (lora_b.float() @ lora_a.float()) * scaling).to(weight.dtype)


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every LoRA update folded into its base weight: native keys only, as the
    base checkpoint had them (saveable by any checkpointer)."""
    modules = lora_modules(model)
    out = {}
    for key, t in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if ".lora_A." in f".{key}" or ".lora_B." in f".{key}":
            continue
        rows = adapted_rows(key)
        if leaf == "weight" and owner in modules:
            m = modules[owner]
            out[key] = merge_weight(m.weight.detach(), m.lora_A.weight.detach(), m.lora_B.weight.detach(), m.scaling)
        elif rows is not None and rows[0] in modules:
            m = modules[rows[0]]
            out[key] = merge_expert_weight(t.detach(), m.lora_A.weight.detach(), m.lora_B.weight.detach(), m.scaling, *rows[1:])
        else:
            out[key] = t
    return out


class MergedState(Mapping):
    """A lazy ``merged_state``: ``state`` (a model's state dict, or its gathered view on rank 0) with each LoRA
    update folded into its base weight as the key is read, so a checkpointer writing file by file holds one
    file's worth. ``scalings``: LoRA module path -> alpha / rank.

    ``original`` (the input checkpoint's lazy state) and ``sources`` (model key -> its key there): every base
    tensor the model was loaded from is read again from the input, so the merge starts from the
    full-precision original, never from the model's 4-bit (QLoRA) or dtype-cast copy of it, and the output
    holds the input's values (and dtype) wherever no adapter changed them."""

    def __init__(self, state: Mapping[str, torch.Tensor], scalings: Mapping[str, float],
                 original: Mapping[str, torch.Tensor] | None = None, sources: Mapping[str, str] | None = None) -> None:
        self._state, self._scalings = state, dict(scalings)
        self._original, self._sources = original, dict(sources or {}) if original is not None else {}

    def _is_adapter(self, key: str) -> bool:
        return ".lora_A." in f".{key}" or ".lora_B." in f".{key}"

    def _model(self, key: str) -> torch.Tensor:
        """The model's tensor on the host, wherever the model lives (its adapters on CUDA, the input on the CPU)."""
        return on_host(self._state[key], key)

    def _base(self, key: str) -> torch.Tensor:
        return on_host(self._original[self._sources[key]], key) if key in self._sources else self._model(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._is_adapter(key):
            raise KeyError(key)
        owner, _, leaf = key.rpartition(".")
        if leaf == "weight" and owner in self._scalings:
            return merge_weight(self._base(key), self._model(f"{owner}.lora_A.weight"),
                                self._model(f"{owner}.lora_B.weight"), self._scalings[owner])
        rows = adapted_rows(key)
        if rows is not None and rows[0] in self._scalings:
            module, first, step = rows
            return merge_expert_weight(self._base(key), self._model(f"{module}.lora_A.weight"),
                                       self._model(f"{module}.lora_B.weight"), self._scalings[module], first, step)
        return self._base(key)

    def __iter__(self):
        return (k for k in self._state if not self._is_adapter(k))

    def adapted_keys(self) -> frozenset[str]:
        """The keys an adapter's update is folded into (a quantized output keeps them unquantized)."""
        def adapted(key: str) -> bool:
            owner, _, leaf = key.rpartition(".")
            rows = adapted_rows(key)
            return (leaf == "weight" and owner in self._scalings) or (rows is not None and rows[0] in self._scalings)
        return frozenset(k for k in self if adapted(k))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def spec(self, key: str):
        return spec_of(self._original, self._sources[key]) if key in self._sources else spec_of(self._state, key)


def merge_state_dict(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Offline merge: a native base state dict plus native adapter tensors -> the merged native state dict."""
    out = dict(base)
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in adapter})
    for module in modules:
        owner, _, target = module.rpartition(".")
        a, b = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]
        for name, first, step in EXPERT_TARGETS.get(target, ((None, 0, 1),)):
            key = f"{owner}.{name}" if name else f"{module}.weight"
            if key not in out:
                raise CheckpointError(f"adapter targets {module!r}, which the base checkpoint lacks")
            out[key] = merge_expert_weight(out[key], a, b, scaling, first, step) if name else merge_weight(out[key], a, b, scaling)
    return out
