"""What a load actually did, key by key, folded by layer for reading.

The report is built from the model after assignment (which parameters now hold a
checkpoint tensor), not from comparing key lists, so a key that was matched but
not assigned (or re-tied afterwards) shows up as what it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

_LAYER = re.compile(r"(^|\.)(layers)\.(\d+)\.")
_EXPERT = re.compile(r"(^|\.)(experts)\.(\d+)\.")


def fold_keys(keys: Iterable[str]) -> list[str]:
    """``layers.0.x, layers.1.x, ... layers.31.x`` -> ``layers.{0..31}.x``, and the same for MoE experts
    (``experts.{0..7}``) within each layer (other keys as they are)."""
    return _fold(_fold(keys, _EXPERT), _LAYER)


def _fold(keys: Iterable[str], index: re.Pattern) -> list[str]:
    groups: dict[str, list[int]] = {}
    for key in keys:
        m = index.search(key)
        if m:
            pattern = key[: m.start(3)] + "{}" + key[m.end(3):]
            groups.setdefault(pattern, []).append(int(m.group(3)))
        else:
            groups.setdefault(key, [])
    folded = []
    for pattern, layers in groups.items():
        if not layers:
            folded.append(pattern)
            continue
        layers = sorted(set(layers))
        contiguous = layers == list(range(layers[0], layers[-1] + 1))
        span = f"{{{layers[0]}..{layers[-1]}}}" if contiguous and len(layers) > 1 else "{" + ",".join(map(str, layers)) + "}"
        folded.append(pattern.replace("{}", span if len(layers) > 1 else str(layers[0])))
    return sorted(folded)


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)  # model keys that now hold a checkpoint tensor
    renamed: dict[str, str] = field(default_factory=dict)  # checkpoint key -> model key, for prefix mapping
    missing: list[str] = field(default_factory=list)  # model keys the checkpoint did not fill (new heads with strict=false)
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys the model has no place for (dropped)
    mismatched: list[str] = field(default_factory=list)  # shape mismatches (an error unless strict=false drops them)
    retied: list[str] = field(default_factory=list)  # parameters re-tied to another after loading
    tied_to: dict[str, str] = field(default_factory=dict)  # re-tied key -> the loaded key it is the same tensor as
    extra_state: list[str] = field(default_factory=list)  # module extra state restored
    quantized: list[str] = field(default_factory=list)  # model keys that now hold the checkpoint tensor quantized
    quantized_as: list[str] = field(default_factory=lambda: ["NF4"])  # their formats (quantize_base: NF4, MXFP4, FP8)
    sources: dict[str, str] = field(default_factory=dict)  # model key -> the checkpoint key it was read from

    def lines(self) -> list[str]:
        out = [f"loaded {len(self.loaded)} tensors: {', '.join(fold_keys(self.loaded))}"]
        if self.quantized:
            out.append(f"quantized to {' and '.join(self.quantized_as)} as loaded: {len(self.quantized)} tensors: "
                       f"{', '.join(fold_keys(self.quantized))}")
        if self.renamed:
            prefixes = sorted({_prefix_change(a, b) for a, b in self.renamed.items()})
            out.append(f"renamed {len(self.renamed)} keys: {', '.join(prefixes)}")
        for label, keys, why in (("missing (left as initialised)", self.missing, ""),
                                 ("unexpected (dropped)", self.unexpected, ""),
                                 ("shape-mismatched (dropped)", self.mismatched, ""),
                                 ("re-tied", self.retied, self._why_retied()),
                                 ("extra state restored", self.extra_state, "")):
            if keys:
                out.append(f"{label}: {', '.join(fold_keys(keys))}{why}")
        return out

    def _why_retied(self) -> str:
        """What a re-tied key is: the tensor of the key it is tied to (a tied model's output projection is its
        embedding table), not one read from the checkpoint under its own name."""
        partners = sorted({self.tied_to[k] for k in self.retied if k in self.tied_to})
        same = f"the same tensor as {', '.join(partners)}" if partners else "tied to another weight"
        return f" ({same}: the model ties these weights, so it is not read from the checkpoint)"

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _prefix_change(source: str, target: str) -> str:
    i = 0
    while i < min(len(source), len(target)) and source[-1 - i] == target[-1 - i]:
        i += 1
    return f"{source[: len(source) - i] or '(none)'} -> {target[: len(target) - i] or '(none)'}"
