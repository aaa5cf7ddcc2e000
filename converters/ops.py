"""Reversible tensor operations used by converter tables.

Each op maps the tensors of one key group from the Hugging Face layout to the
native one (``forward``) and back (``inverse``); ``inverse(forward(x)) == x``
bitwise. Ops take and return lists so that fused tensors (one HF key <-> several
native keys) fit the same shape as plain renames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Identity:
    """A plain rename."""

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)


@dataclass(frozen=True)
class RopePermute:
    """Rows of a q/k projection (weight or bias): HF's rotate-half order <-> Meta's interleaved pairs.

    Within each head, HF keeps the first and second halves of the rotary pairs
    in two blocks ``[x0, x2, x4, ..., x1, x3, x5, ...]``; Meta interleaves them
    ``[x0, x1, x2, x3, ...]``. The permutation acts on dim 0 only.
    """

    n_heads: int
    head_dim: int

    def _regroup(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        if t.shape[0] != self.n_heads * self.head_dim:
            raise ValueError(
                f"has {t.shape[0]} rows, expected n_heads * head_dim = {self.n_heads} * {self.head_dim}")
        return t.reshape(self.n_heads, a, b, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self._regroup(t, 2, self.head_dim // 2) for t in tensors]

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self._regroup(t, self.head_dim // 2, 2) for t in tensors]


@dataclass(frozen=True)
class Split:
    """One fused tensor <-> its consecutive blocks of ``sizes`` rows along ``dim``, e.g. Phi-3's ``qkv_proj`` (dim 0)
    or the packed experts' ``gate_up_proj [E, 2I, H]`` (dim 1).

    ``forward`` returns views of the fused tensor (no copy); ``inverse`` concatenates them back.
    """

    sizes: tuple[int, ...]
    dim: int = 0

    def __init__(self, sizes, dim: int = 0) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in sizes))
        object.__setattr__(self, "dim", dim)

    def _what(self) -> str:
        return "rows" if self.dim == 0 else f"entries along dim {self.dim}"

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        (t,) = tensors
        if t.ndim <= self.dim or t.shape[self.dim] != sum(self.sizes):
            has = t.shape[self.dim] if t.ndim > self.dim else 0
            raise ValueError(f"has {has} {self._what()}, expected {' + '.join(map(str, self.sizes))} = {sum(self.sizes)}")
        return list(t.split(self.sizes, dim=self.dim))

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) != len(self.sizes):
            raise ValueError(f"got {len(tensors)} tensors to fuse, expected {len(self.sizes)}")
        for t, size in zip(tensors, self.sizes):
            if t.shape[self.dim] != size:
                raise ValueError(f"a block has {t.shape[self.dim]} {self._what()}, expected {size} (blocks {self.sizes})")
        return [torch.cat(tensors, dim=self.dim)]


@dataclass(frozen=True)
class Stack:
    """``count`` per-expert tensors (``experts.{e}.…`` for e in 0..count-1) <-> one ``[count, ...]`` tensor.

    A rule with this op has ``{e}`` in its per-expert patterns; the table collects the ``count`` keys of one layer
    into one group. ``forward`` copies them into the stacked tensor (one layer's experts at a time); ``inverse``
    returns views of it.
    """

    count: int

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) != self.count:
            raise ValueError(f"got {len(tensors)} experts, expected {self.count}")
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(f"experts differ in shape ({', '.join(map(str, sorted(shapes)))})")
        return [torch.stack(tensors)]

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        (t,) = tensors
        if t.ndim == 0 or t.shape[0] != self.count:
            raise ValueError(f"has {t.shape[0] if t.ndim else 0} experts, expected {self.count}")
        return list(t.unbind(0))


@dataclass(frozen=True)
class PerTensor:
    """The i-th op on the i-th tensor (each op maps one tensor to one), e.g. RoPE permutations after a Split."""

    ops: tuple

    def __init__(self, *ops) -> None:
        object.__setattr__(self, "ops", tuple(ops))

    def _apply(self, tensors: list[torch.Tensor], forward: bool) -> list[torch.Tensor]:
        if len(tensors) != len(self.ops):
            raise ValueError(f"got {len(tensors)} tensors for {len(self.ops)} ops")
        out = []
        for op, t in zip(self.ops, tensors):
            (result,) = (op.forward if forward else op.inverse)([t])
            out.append(result)
        return out

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._apply(tensors, True)

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._apply(tensors, False)


@dataclass(frozen=True)
class Chain:
    """Ops applied one after another on load (``forward``) and in reverse order, inverted, on save."""

    ops: tuple

    def __init__(self, *ops) -> None:
        object.__setattr__(self, "ops", tuple(ops))

    def __getattr__(self, name: str):
        if name == "count":  # the experts a Stack inside gathers (what a rule with {e} in its keys asks its op)
            for op in self.ops:
                if hasattr(op, "count"):
                    return op.count
        raise AttributeError(name)

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        for op in self.ops:
            tensors = op.forward(tensors)
        return list(tensors)

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        for op in reversed(self.ops):
            tensors = op.inverse(tensors)
        return list(tensors)


@dataclass(frozen=True)
class Transpose:
    """Two dims swapped, e.g. gpt-oss's experts stored ``[E, in, out]`` <-> the native ``[E, out, in]``. Both ways
    return a contiguous copy (a strided view would reach the grouped matmuls, or the files, as it is)."""

    dims: tuple[int, int] = (1, 2)

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.transpose(*self.dims).contiguous() for t in tensors]

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.forward(tensors)


@dataclass(frozen=True)
class Flatten:
    """A kernel's trailing dims as one <-> back to ``shape`` (those dims), e.g. Qwen3.5's patch embedding: HF's Conv3d
    kernel [dim, C, T, P, P] <-> the native Linear's [dim, C*T*P*P] (a convolution whose kernel covers its input)."""

    shape: tuple[int, ...]

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.flatten(1) for t in tensors]

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.reshape(t.shape[0], *self.shape) for t in tensors]


@dataclass(frozen=True)
class Interleave:
    """One tensor whose ``count`` parts alternate along ``dim`` <-> the parts, e.g. gpt-oss's ``gate_up_proj``
    (gate at the even positions, up at the odd ones) <-> the gate and up projections."""

    count: int = 2
    dim: int = 0

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        (t,) = tensors
        dim = self.dim % t.ndim if t.ndim else 0
        if t.ndim == 0 or t.shape[dim] % self.count:
            raise ValueError(f"has {t.shape[dim] if t.ndim else 0} entries along dim {self.dim}, not a multiple of {self.count}")
        parts = t.unflatten(dim, (-1, self.count))
        return [parts.select(dim + 1, i).contiguous() for i in range(self.count)]

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) != self.count or len({tuple(t.shape) for t in tensors}) != 1:
            raise ValueError(f"needs {self.count} tensors of one shape, got {[tuple(t.shape) for t in tensors]}")
        dim = self.dim % tensors[0].ndim
        return [torch.stack(tensors, dim=dim + 1).flatten(dim, dim + 1)]


@dataclass(frozen=True)
class HeadGroups:
    """One projection fused per head group <-> its parts, each with all groups' rows together, e.g. Qwen3-Next's
    ``in_proj_qkvz``: for each of ``groups`` key heads, rows ``[q, k, v, z]`` of ``sizes`` -> the native
    ``in_proj_qkv`` (every group's q, then every k, then every v) and ``in_proj_z``. ``parts`` says which of the
    blocks each native tensor takes, in order."""

    groups: int
    sizes: tuple[int, ...]
    parts: tuple[tuple[int, ...], ...]

    def __init__(self, groups: int, sizes, parts) -> None:
        object.__setattr__(self, "groups", int(groups))
        object.__setattr__(self, "sizes", tuple(int(s) for s in sizes))
        object.__setattr__(self, "parts", tuple(tuple(p) for p in parts))

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        (t,) = tensors
        if t.ndim == 0 or t.shape[0] != self.groups * sum(self.sizes):
            raise ValueError(f"has {t.shape[0] if t.ndim else 0} rows, expected {self.groups} groups of "
                             f"{' + '.join(map(str, self.sizes))}")
        blocks = t.unflatten(0, (self.groups, -1)).split(self.sizes, dim=1)
        return [torch.cat([blocks[b].flatten(0, 1) for b in part]) for part in self.parts]

    def inverse(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) != len(self.parts):
            raise ValueError(f"got {len(tensors)} tensors to fuse, expected {len(self.parts)}")
        blocks: dict[int, torch.Tensor] = {}
        for t, part in zip(tensors, self.parts):
            rows = [self.groups * self.sizes[b] for b in part]
            if t.shape[0] != sum(rows):
                raise ValueError(f"a part has {t.shape[0]} rows, expected {sum(rows)}")
            for b, block in zip(part, t.split(rows)):
                blocks[b] = block.unflatten(0, (self.groups, -1))
        return [torch.cat([blocks[b] for b in range(len(self.sizes))], dim=1).flatten(0, 1)]
