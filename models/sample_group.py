"""``n`` sampled completions of a prompt as one batch (GRPO's group), with ``generate``'s processors and tokens; several
prompts' groups in one decode loop (``generate_groups``: a micro-batch's).

Each prompt runs once, as a batch of one; its cache (attention's keys and values, Gated DeltaNet's convolution inputs
and delta-rule state) is copied to ``n`` rows, into buffers with room for every new token (no concatenation a step).
Each step then runs the rows still going, of every prompt, as one batch, each row at its own position (prompts differ
in length: a row attends its own tokens only, never the padding after a shorter prompt's); a row that ends (a stop
token, a stop string) leaves the batch, its cache rows dropped, so later steps cost only the rows that remain.

Determinism (what a resumed run must restore to get the same completions):

* a call takes exactly one draw from ``generator`` (or, with None, torch's default generator), whatever the
  sampling: ``base = group_seed(generator)``, one int64 from ``torch.randint(2**62, (1,))``; the generator that the
  recipe keeps in recipe_state.pt thus advances by one draw a group;
* row ``i`` samples from its own generator, ``row_generator(base, i)`` = ``torch.Generator(device).manual_seed(base + i)``;
  each step that row ``i`` is still running, with ``temperature > 0``, takes what ``torch.multinomial(probs, 1,
  generator=g)`` takes from it (one ``exponential_`` fill of a vocabulary-sized vector) and picks the same token;
  greedy rows draw nothing;
* so row ``i``'s tokens depend only on the prompt, the model and ``base + i``: not on ``n``, nor on which other rows
  are still running, and ``generate(model, prompt, ..., generator=row_generator(base, i))`` gives the same tokens (up
  to the last bits of the batched matmuls' rounding, which could flip a draw only at a near-tie).

What a row returns: its tokens, a stop token included (as transformers returns it), at most ``max_new_tokens``. A stop
string (``stop_strings``, matched in ``decode(row's tokens)``, the completion's text only, not the prompt's) ends the
row at the token whose text completes it: that token is kept whole, so the text may run on after the stop string
within it (as transformers' ``StopStringCriteria`` leaves it); cut the text at the string if that matters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from waypoint.models.generate import Sampling, sample_rows
from waypoint.models.kv_cache import KVCache

__all__ = ["generate_group", "generate_groups", "generate_rows", "group_seed", "row_generator"]


def group_seed(generator: torch.Generator | None = None) -> int:
    """The group's base seed: one draw from ``generator`` (None: torch's default generator)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(2 ** 62, (1,), generator=generator, device=device))


def row_generator(base: int, row: int, device=None) -> torch.Generator:
    """Row ``row``'s generator of the group whose base seed is ``base``."""
    return torch.Generator(device=device if device is not None else "cpu").manual_seed(base + row)


class _RowsCache(KVCache):
    """The caches of several prompts' prefills, each copied to its number of rows (``counts``), in buffers preallocated for ``capacity``
    tokens: row ``r`` holds its prompt's keys and values at positions ``0 .. lengths[r] - 1``, a shorter prompt's rows
    padded after them (never attended: ``mask``). Each decode step appends one token to every row at its own
    position and attends up to it; ``rope_rows`` gives each row its own positions."""

    def __init__(self, prompts: list[KVCache], counts: list[int], capacity: int) -> None:
        first = prompts[0]
        super().__init__(len(first.keys))
        device = next(k for k in first.keys + [s[0] for s in first.states if s is not None] if k is not None).device
        self.lengths = torch.tensor([c.length for c, n in zip(prompts, counts) for _ in range(n)], device=device)
        self.length = int(self.lengths.max())
        for layer, k in enumerate(first.keys):
            if k is not None:
                self.keys[layer] = self._buffer([c.keys[layer] for c in prompts], counts, capacity)
                self.values[layer] = self._buffer([c.values[layer] for c in prompts], counts, capacity)
        self.states = [None if s is None else tuple(
            torch.cat([c.states[layer][i].repeat(n, *[1] * (t.dim() - 1)) for c, n in zip(prompts, counts)])
            for i, t in enumerate(s)) for layer, s in enumerate(first.states)]

    @staticmethod
    def _buffer(caches: list[torch.Tensor], counts: list[int], capacity: int) -> torch.Tensor:
        t = caches[0]
        buffer = t.new_zeros(sum(counts), t.shape[1], capacity, t.shape[3])
        row = 0
        for c, n in zip(caches, counts):
            buffer[row: row + n, :, : c.shape[2]] = c
            row += n
        return buffer

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if k.shape[2] != 1:
            raise ValueError("_RowsCache takes one token a row a step")
        rows = torch.arange(k.shape[0], device=k.device)
        keys, values = self.keys[layer], self.values[layer]
        keys[rows, :, self.lengths] = k[:, :, 0]
        values[rows, :, self.lengths] = v[:, :, 0]
        return keys[:, :, : self.length + 1], values[:, :, : self.length + 1]

    def rope_rows(self, table: torch.Tensor, new: int, offset: int = 0) -> torch.Tensor:
        return table[(self.lengths + offset)[:, None] + torch.arange(new, device=self.lengths.device)]

    def mask(self, new: int, window: int | None, device=None) -> torch.Tensor:
        """[rows, 1, new, length + new] bool: each row's new token attends its own tokens up to itself (the last
        ``window`` of them with a window), never another row's padding."""
        position = (self.lengths[:, None] + torch.arange(new, device=self.lengths.device))[:, :, None]
        j = torch.arange(self.length + new, device=self.lengths.device)[None, None, :]
        allowed = j <= position
        if window is not None:
            allowed &= j > position - window
        return allowed[:, None].to(device)

    def advance(self, new: int) -> None:
        self.lengths = self.lengths + new
        self.length = int(self.lengths.max())

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (in that order)."""
        pick = lambda t: t.index_select(0, rows)  # noqa: E731
        self.keys = [None if k is None else pick(k) for k in self.keys]
        self.values = [None if v is None else pick(v) for v in self.values]
        self.states = [None if s is None else tuple(pick(t) for t in s) for s in self.states]
        self.lengths = pick(self.lengths)
        self.length = int(self.lengths.max())


@torch.no_grad()
def generate_group(model: torch.nn.Module, prompt: list[int], n: int, max_new_tokens: int,
                   sampling: Sampling = Sampling(), stop_ids: Iterable[int] = (), stop_strings: Sequence[str] | None = None,
                   decode: Callable[[list[int]], str] | None = None,
                   generator: torch.Generator | None = None,
                   interrupt: Callable[[], None] | None = None) -> list[list[int]]:
    """``n`` completions of ``prompt`` by ``model`` (each row's tokens, a stop token included); see the module's
    docstring for the draws each row takes and how stop strings end a row (``decode``: token ids -> text).
    ``interrupt``: called before each forward; what it raises abandons the group (a preemption)."""
    return generate_groups(model, [prompt], n, max_new_tokens, sampling, stop_ids, stop_strings, decode, [generator],
                           interrupt)[0]


@torch.no_grad()
def generate_groups(model: torch.nn.Module, prompts: Sequence[list[int]], n: int, max_new_tokens: int,
                    sampling: Sampling = Sampling(), stop_ids: Iterable[int] = (),
                    stop_strings: Sequence[str] | None = None, decode: Callable[[list[int]], str] | None = None,
                    generators: Sequence[torch.Generator | None] | None = None,
                    interrupt: Callable[[], None] | None = None) -> list[list[list[int]]]:
    """``generate_group`` of each prompt (``generators[i]``: prompt ``i``'s), in one decode loop: each prompt is
    prefilled alone, then every row of every group runs as one batch a token, finished rows leaving it. Each row's
    tokens are those ``generate_group`` gives it alone (its own generator; the same draws)."""
    generators = list(generators) if generators is not None else [None] * len(prompts)
    if len(generators) != len(prompts):
        raise ValueError(f"generate_groups: {len(generators)} generators for {len(prompts)} prompts")
    if n < 1:
        raise ValueError(f"generate_group: n >= 1 and max_new_tokens >= 0 (got n={n}, max_new_tokens={max_new_tokens})")
    _check(prompts, max_new_tokens, stop_strings, decode)
    device = _device(model)
    bases = [group_seed(g) for g in generators]  # one draw from each, in prompt order
    out = _decode(model, list(prompts), [n] * len(prompts), max_new_tokens, sampling, stop_ids, stop_strings, decode,
                  [row_generator(base, row, device) for base in bases for row in range(n)], interrupt)
    return [out[i * n: (i + 1) * n] for i in range(len(prompts))]


@torch.no_grad()
def generate_rows(model: torch.nn.Module, prompts: Sequence[list[int]], max_new_tokens: int,
                  generators: Sequence[torch.Generator], sampling: Sampling = Sampling(), stop_ids: Iterable[int] = (),
                  stop_strings: Sequence[str] | None = None, decode: Callable[[list[int]], str] | None = None,
                  interrupt: Callable[[], None] | None = None) -> list[list[int]]:
    """One completion of each prompt, row ``i`` drawing from ``generators[i]`` (each a row generator, as
    ``row_generator`` makes them: no group draw), in one decode loop; runs of equal prompts next to each other are
    prefilled once (a group's rows: the tokens ``generate_groups`` gives them). A multi-turn rollout's later turns
    continue each row from its own history this way."""
    if len(generators) != len(prompts):
        raise ValueError(f"generate_rows: {len(generators)} generators for {len(prompts)} prompts")
    _check(prompts, max_new_tokens, stop_strings, decode)
    distinct, counts = [], []
    for prompt in prompts:
        if distinct and distinct[-1] == prompt:
            counts[-1] += 1
        else:
            distinct.append(list(prompt))
            counts.append(1)
    return _decode(model, distinct, counts, max_new_tokens, sampling, stop_ids, stop_strings, decode, list(generators),
                   interrupt)


def _check(prompts, max_new_tokens: int, stop_strings, decode) -> None:
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate_group: a prompt has no tokens")
    if max_new_tokens < 0:
        raise ValueError(f"generate_group: max_new_tokens >= 0 (got {max_new_tokens})")
    if [s for s in stop_strings or () if s] and decode is None:
        raise ValueError("generate_group: stop_strings need decode (token ids -> text)")


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _decode(model: torch.nn.Module, prompts: list[list[int]], counts: list[int], max_new_tokens: int,
            sampling: Sampling, stop_ids: Iterable[int], stop_strings: Sequence[str] | None,
            decode: Callable[[list[int]], str] | None, row_generators: list[torch.Generator],
            interrupt: Callable[[], None] | None) -> list[list[int]]:
    """The decode loop: prompt ``i`` prefilled once, its cache copied to ``counts[i]`` rows (in prompt order), each
    row sampling from its own generator until a stop token, a stop string or ``max_new_tokens``."""
    out: list[list[int]] = [[] for _ in range(sum(counts))]
    if max_new_tokens == 0:
        return out
    stop_strings = [s for s in stop_strings or () if s]
    device = _device(model)
    stop = set(stop_ids)
    was_training = model.training
    model.eval()
    try:
        prefills, first_logits = [], []
        for prompt, n in zip(prompts, counts):
            if interrupt is not None:
                interrupt()
            prefill = KVCache(len(model.layers))
            first_logits.append(model(torch.tensor([prompt], device=device), cache=prefill)[:, -1].float().expand(n, -1))
            prefills.append(prefill)
        longest = max(len(p) for p in prompts)
        cache = _RowsCache(prefills, counts, longest + max_new_tokens)
        del prefills
        logits = torch.cat(first_logits)
        # each row's tokens so far, for the repetition penalty: its prompt (padded with its own first token, which the
        # penalty counts once however often it appears), then its new tokens
        seen = torch.tensor([p + [p[0]] * (longest - len(p)) for p, n in zip(prompts, counts) for _ in range(n)],
                            device=device)
        seen = torch.cat([seen, seen.new_zeros(len(seen), max_new_tokens)], dim=1)
        running = list(range(len(out)))  # the rows of the batch, in its order
        for step in range(max_new_tokens):
            tokens = sample_rows(logits, seen[:, : longest + step], sampling, [row_generators[row] for row in running])
            keep = []
            for index, (row, token) in enumerate(zip(running, tokens.tolist())):
                out[row].append(token)
                if token not in stop and not (stop_strings and any(s in decode(out[row]) for s in stop_strings)):
                    keep.append(index)
            if not keep or step == max_new_tokens - 1:
                break
            if len(keep) < len(running):
                picked = torch.tensor(keep, device=device)
                cache.keep(picked)
                tokens, seen = tokens[picked], seen[picked]
                running = [running[i] for i in keep]
            seen[:, longest + step] = tokens
            if interrupt is not None:
                interrupt()
            logits = model(tokens[:, None], cache=cache)[:, -1].float()
    finally:
        model.train(was_training)
    return out
