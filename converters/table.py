"""A declarative, reversible key/tensor conversion table.

A :class:`Rule` pairs HF key patterns with native key patterns and a tensor op;
``{i}`` in a pattern stands for a layer index, ``{key}`` for any whole key. :class:`Converter` applies the
rules forwards (HF -> native) on load and backwards (native -> HF) on save, so
saving is loading run in reverse. Any key that no rule matches is an error that
names it; only keys matching ``ignore`` (e.g. ``rotary_emb.inv_freq``) are
skipped.

``{e}`` in a pattern stands for an expert index: the rule's op (``Stack``) says how many experts a group has,
and the table gathers them into one group (all experts of a layer <-> one stacked tensor). Where a family is
stored in more than one on-disk layout (per-expert keys or packed ones), ``variants`` holds each layout's rules:
loading uses the one the keys match, and saving writes that same one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from waypoint.errors import CheckpointError
from waypoint.lazy import LazyState, on_meta, release_pages
from waypoint.converters.ops import Identity


def compile_pattern(pattern: str) -> re.Pattern:
    """``{i}`` matches a layer index, ``{key}`` any key (for tables that keep names as they are)."""
    regex = (re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)").replace(re.escape("{e}"), r"(?P<e>\d+)")
             .replace(re.escape("{key}"), r"(?P<key>.+)"))
    return re.compile(f"^{regex}$")


@dataclass(frozen=True)
class Rule:
    """``hf`` keys <-> ``native`` keys through ``op`` (forward: HF -> native)."""

    hf: tuple[str, ...]
    native: tuple[str, ...]
    op: object = Identity()

    def __init__(self, hf: str | tuple[str, ...], native: str | tuple[str, ...], op: object = Identity()):
        object.__setattr__(self, "hf", (hf,) if isinstance(hf, str) else tuple(hf))
        object.__setattr__(self, "native", (native,) if isinstance(native, str) else tuple(native))
        object.__setattr__(self, "op", op)

    def slots(self, side: str) -> list[tuple[int, int | None]]:
        """(pattern position, expert index or None) of each key of one group on ``side``, in order."""
        count = getattr(self.op, "count", None)
        return [(pos, e) for pos, p in enumerate(getattr(self, side))
                for e in (range(count) if "{e}" in p and count is not None else (None,))]

    def key(self, side: str, slot: tuple[int, int | None], binding: dict) -> str:
        pos, e = slot
        return getattr(self, side)[pos].format(**binding, **({"e": e} if e is not None else {}))


@dataclass(frozen=True)
class Group:
    """One application of a rule: concrete source keys -> concrete target keys."""

    rule: Rule
    sources: tuple[str, ...]
    targets: tuple[str, ...]


@dataclass
class Converter:
    rules: list[Rule]
    ignore: tuple[str, ...] = ()  # regexes of HF keys that carry no weights (searched, not anchored)
    tied_embeddings: bool = False  # HF omits lm_head when tied; native output.weight aliases the embedding
    hf_embedding_key: str = "model.embed_tokens.weight"
    hf_head_key: str = "lm_head.weight"
    native_embedding_key: str = "tok_embeddings.weight"
    native_head_key: str = "output.weight"
    variants: dict[str, list[Rule]] = field(default_factory=dict)  # on-disk layouts, one of which is in use
    variant: str | None = None  # the layout in use: chosen by the first HF keys planned (default: the first)
    # native LoRA target on a stacked parameter -> the HF parameter PEFT targets (``{i}``: the layer), in the order
    # transformers' module registers them (``checkpointers.peft_parameters``)
    lora_parameters: dict[str, str] = field(default_factory=dict)
    buffers: tuple[str, ...] = ()  # regexes of HF keys holding buffers, not parameters (not in total_parameters)
    # native LoRA parameter targets whose HF parameter holds gate and up as halves (all gate rows, then all up rows:
    # Qwen3.5-MoE's gate_up_proj), where the native lora_B interleaves them (gpt-oss's order): its rows are regrouped
    lora_halves: frozenset[str] = frozenset()
    # the HF module names vLLM serves LoRA on in this model (its family's ``vllm_lora_modules``; empty: not known, the
    # PEFT adapter writer checks against Llama's)
    vllm_lora_modules: frozenset[str] = frozenset()
    _compiled: dict = field(default_factory=dict, init=False, repr=False)

    # -- planning (keys only) -------------------------------------------------
    def rules_in_use(self) -> list[Rule]:
        return self.rules + (self.variants[self.variant or next(iter(self.variants))] if self.variants else [])

    def _patterns(self, side: str) -> list[tuple[Rule, int, re.Pattern]]:
        cache = (side, self.variant)
        if cache not in self._compiled:
            self._compiled[cache] = [
                (rule, pos, compile_pattern(p)) for rule in self.rules_in_use() for pos, p in enumerate(getattr(rule, side))
            ]
        return self._compiled[cache]

    def _choose_variant(self, hf_keys: list[str]) -> None:
        """The layout whose patterns match most of the checkpoint's keys (layouts may share some, e.g. the router's)."""
        matched = {}
        for name, rules in self.variants.items():
            patterns = [compile_pattern(p) for rule in rules for p in rule.hf]
            matched[name] = sum(any(regex.match(key) for regex in patterns) for key in hf_keys)
        best = max(matched, key=lambda name: matched[name])  # the first of equals
        if matched[best]:
            self.variant = best

    def is_parameter(self, hf_key: str) -> bool:
        """Whether an HF key holds a parameter (what ``num_parameters()`` counts), not a buffer."""
        return not any(re.search(p, hf_key) for p in self.buffers)

    def renamed(self, hf_key: Callable[[str], str]) -> "Converter":
        """This table with every HF key (pattern) passed through ``hf_key``, e.g. a multimodal model's module paths
        (``model.language_model.layers.{i}...``) for a text model's (``model.layers.{i}...``)."""
        def rules(table: list[Rule]) -> list[Rule]:
            return [Rule(tuple(hf_key(k) for k in r.hf), r.native, r.op) for r in table]
        return replace(self, rules=rules(self.rules), variants={n: rules(t) for n, t in self.variants.items()},
                       lora_parameters={n: hf_key(k) for n, k in self.lora_parameters.items()},
                       hf_embedding_key=hf_key(self.hf_embedding_key), hf_head_key=hf_key(self.hf_head_key))

    def matches(self, key: str, side: str) -> bool:
        """Whether a rule of the layout in use names ``key`` (of ``side``: 'hf' or 'native')."""
        return any(regex.match(key) for _, _, regex in self._patterns(side))

    def is_ignored(self, hf_key: str) -> bool:
        return any(re.search(p, hf_key) for p in self.ignore)

    def plan(self, keys: Iterable[str], side: str, where: Mapping[str, str] | None = None) -> list[Group]:
        """Group ``keys`` of ``side`` ('hf' or 'native') into rule applications.

        ``where`` maps keys to the file they came from, for error messages.
        """
        other = "native" if side == "hf" else "hf"
        keys = list(keys)
        if side == "hf" and self.variants and self.variant is None:
            self._choose_variant(keys)
        found: dict[tuple[int, tuple], dict[tuple[int, int | None], str]] = {}
        rules_by_id: dict[int, tuple[Rule, dict]] = {}
        for key in keys:
            if side == "hf" and self.is_ignored(key):
                continue
            for rule, pos, regex in self._patterns(side):
                m = regex.match(key)
                if m:
                    binding = m.groupdict()
                    e = binding.pop("e", None)
                    if e is not None and int(e) >= getattr(rule.op, "count", 0):
                        origin = f" in {where[key]}" if where and key in where else ""
                        raise CheckpointError(f"{side} key {key!r}{origin}: expert {e}, but the model has "
                                              f"{getattr(rule.op, 'count', 0)} experts")
                    gid = (id(rule), tuple(sorted(binding.items())))
                    found.setdefault(gid, {})[(pos, None if e is None else int(e))] = key
                    rules_by_id[id(rule)] = (rule, binding)
                    break
            else:
                origin = f" in {where[key]}" if where and key in where else ""
                raise CheckpointError(f"unknown {side} key {key!r}{origin}: no rule of the converter matches it")
        groups = []
        for (rid, binding), members in found.items():
            rule = rules_by_id[rid][0]
            slots = rule.slots(side)
            if len(members) != len(slots):
                absent = [rule.key(side, slot, dict(binding)) for slot in slots if slot not in members]
                raise CheckpointError(f"incomplete {side} key group: {', '.join(absent[:3])}"
                                      f"{f' and {len(absent) - 3} more' if len(absent) > 3 else ''} missing beside "
                                      f"{members[min(members, key=lambda s: (s[0], s[1] or 0))]!r}")
            sources = tuple(members[slot] for slot in slots)
            targets = tuple(rule.key(other, slot, dict(binding)) for slot in rule.slots(other))
            groups.append(Group(rule, sources, targets))
        return groups

    # -- conversion -------------------------------------------------------------
    def apply_groups(self, groups: list[Group], tensors: Mapping[str, torch.Tensor], forward: bool,
               where: Mapping[str, str] | None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for g in groups:
            fn = g.rule.op.forward if forward else g.rule.op.inverse
            try:
                results = fn([tensors[k] for k in g.sources])
            except (RuntimeError, ValueError) as e:
                if getattr(e, "input_fault", False):  # the file's values, not the conversion (an FP8 weight's nan)
                    raise CheckpointError(f"{where[g.sources[0]] + ': ' if where and g.sources[0] in where else ''}"
                                          f"{g.sources[0]}: {str(e).splitlines()[0]}") from e
                origin = f" in {where[g.sources[0]]}" if where and g.sources[0] in where else ""
                shapes = ", ".join(f"{k} {tuple(tensors[k].shape)}" for k in g.sources)
                raise CheckpointError(f"cannot convert {shapes}{origin}: {str(e).splitlines()[0]}") from e
            out.update(zip(g.targets, results))
        return out

    def to_native(self, hf_state: Mapping[str, torch.Tensor], where: Mapping[str, str] | None = None) -> LazyState:
        """HF state dict -> native state dict (``where``: key -> file name, for errors).

        Keys and shapes are checked now (the ops run on meta-device stand-ins); each native tensor is
        computed when it is read, so a reader taking one at a time holds one converted tensor at a time.
        """
        groups = self.plan(hf_state, "hf", where)
        converted = self.apply_groups(groups, on_meta(hf_state, [k for g in groups for k in g.sources]), True, where)
        native = ConvertedState(self, sorted(set(where.values())) if where else [])
        for g in groups:
            for target in g.targets:
                native.put(target, lambda g=g, target=target: self._convert_one(g, target, hf_state, where),
                           (converted[target].shape, converted[target].dtype))
        if self.tied_embeddings and self.native_embedding_key in native and self.native_head_key not in native:
            native.alias(self.native_head_key, self.native_embedding_key)
        return native

    def _convert_one(self, group: Group, target: str, hf_state, where) -> torch.Tensor:
        """One native tensor. Where the op copied (stacked experts, the RoPE permutation of q and k), the memory-mapped
        sources' pages are dropped from this process once copied, so no weight is held twice (file pages and its copy)."""
        sources = [hf_state[k] for k in group.sources]
        out = self.apply_groups([group], dict(zip(group.sources, sources)), True, where)[target]
        if out.untyped_storage().data_ptr() not in {s.untyped_storage().data_ptr() for s in sources}:
            release_pages(*sources)
        return out

    def from_native(self, native_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Native state dict (or a subset made of whole groups) -> HF state dict."""
        return self.apply_groups(self.plan(self.native_keys_to_save(native_state), "native"), native_state, False, None)

    def native_keys_to_save(self, native_keys: Iterable[str]) -> list[str]:
        """The native keys that have an HF counterpart (the tied head is the embedding in HF)."""
        return [k for k in native_keys if not (self.tied_embeddings and k == self.native_head_key)]


class ConvertedState(LazyState):
    """What :meth:`Converter.to_native` gives: the input's tensors, converted as they are read, and for native keys
    they lack the file keys (:meth:`absent`) that saving would write: every checkpointer writes the input's layout,
    so a weight its ``files`` lack cannot be added by training it (``strict=false``)."""

    def __init__(self, converter: Converter, files: list[str]) -> None:
        super().__init__({}, {})
        self.converter, self.files = converter, files

    def named(self, native_keys: Iterable[str]) -> list[str]:
        """Those of ``native_keys`` that a save would write (a rule names them; not a tied head)."""
        return [k for k in self.converter.native_keys_to_save(native_keys) if self.converter.matches(k, "native")]

    def absent(self, native_keys: Iterable[str]) -> list[str]:
        """The file keys that these native keys (ones the input lacks) would be saved as; [] for keys no rule names
        (a new head beside the model)."""
        try:
            groups = self.converter.plan(self.named(native_keys), "native")
        except CheckpointError:
            return []
        return sorted({key for g in groups for key in g.targets})
