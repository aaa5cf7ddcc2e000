"""``n`` sampled completions of one prompt as one batch (GRPO's group), with ``generate``'s processors and tokens.

The prompt runs once, as a batch of one; its cache (attention's keys and values, Gated DeltaNet's convolution inputs
and delta-rule state) is copied to ``n`` rows, into buffers with room for every new token (no concatenation a step).
Each step then runs the rows still going as one batch; a row that ends (a stop token, a stop string) leaves the
batch, its cache rows dropped, so later steps cost only the rows that remain.

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

__all__ = ["generate_group", "group_seed", "row_generator"]


def group_seed(generator: torch.Generator | None = None) -> int:
    """The group's base seed: one draw from ``generator`` (None: torch's default generator)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(2 ** 62, (1,), generator=generator, device=device))


def row_generator(base: int, row: int, device=None) -> torch.Generator:
    """Row ``row``'s generator of the group whose base seed is ``base``."""
    return torch.Generator(device=device if device is not None else "cpu").manual_seed(base + row)


class _GroupCache(KVCache):
    """A ``KVCache`` of ``rows`` copies of a batch-of-one cache, in buffers preallocated for ``capacity`` tokens:
    ``append`` writes the new keys and values in place and returns views of the filled part."""

    def __init__(self, prompt: KVCache, rows: int, capacity: int) -> None:
        super().__init__(len(prompt.keys))
        self.length = prompt.length
        for layer, (k, v) in enumerate(zip(prompt.keys, prompt.values)):
            if k is not None:
                self.keys[layer] = self._buffer(k, rows, capacity)
                self.values[layer] = self._buffer(v, rows, capacity)
        self.states = [None if s is None else tuple(t.repeat(rows, *[1] * (t.dim() - 1)) for t in s) for s in prompt.states]

    @staticmethod
    def _buffer(t: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
        buffer = t.new_empty(rows, t.shape[1], capacity, t.shape[3])
        buffer[:, :, : t.shape[2]] = t
        return buffer

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, self.length:end] = k
        values[:, :, self.length:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (in that order)."""
        pick = lambda t: t.index_select(0, rows)  # noqa: E731
        self.keys = [None if k is None else pick(k) for k in self.keys]
        self.values = [None if v is None else pick(v) for v in self.values]
        self.states = [None if s is None else tuple(pick(t) for t in s) for s in self.states]


@torch.no_grad()
def generate_group(model: torch.nn.Module, prompt: list[int], n: int, max_new_tokens: int,
                   sampling: Sampling = Sampling(), stop_ids: Iterable[int] = (), stop_strings: Sequence[str] | None = None,
                   decode: Callable[[list[int]], str] | None = None,
                   generator: torch.Generator | None = None,
                   interrupt: Callable[[], None] | None = None) -> list[list[int]]:
    """``n`` completions of ``prompt`` by ``model`` (each row's tokens, a stop token included); see the module's
    docstring for the draws each row takes and how stop strings end a row (``decode``: token ids -> text).
    ``interrupt``: called before each forward; what it raises abandons the group (a preemption)."""
    if not prompt:
        raise ValueError("generate_group: the prompt has no tokens")
    if n < 1 or max_new_tokens < 0:
        raise ValueError(f"generate_group: n >= 1 and max_new_tokens >= 0 (got n={n}, max_new_tokens={max_new_tokens})")
    stop_strings = [s for s in stop_strings or () if s]
    if stop_strings and decode is None:
        raise ValueError("generate_group: stop_strings need decode (token ids -> text)")
    device = next(model.parameters()).device
    base = group_seed(generator)
    generators = [row_generator(base, row, device) for row in range(n)]
    out: list[list[int]] = [[] for _ in range(n)]
    if max_new_tokens == 0:
        return out
    stop = set(stop_ids)
    was_training = model.training
    model.eval()
    try:
        if interrupt is not None:
            interrupt()
        prefill = KVCache(len(model.layers))
        logits = model(torch.tensor([prompt], device=device), cache=prefill)[:, -1].float().expand(n, -1)
        cache = _GroupCache(prefill, n, len(prompt) + max_new_tokens)
        del prefill
        seen = torch.tensor(prompt, device=device).repeat(n, 1)
        seen = torch.cat([seen, seen.new_zeros(n, max_new_tokens)], dim=1)  # the prompt, then each row's tokens
        running = list(range(n))  # the rows of the batch, in its order
        for step in range(max_new_tokens):
            tokens = sample_rows(logits, seen[:, : len(prompt) + step], sampling, [generators[row] for row in running])
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
            seen[:, len(prompt) + step] = tokens
            if interrupt is not None:
                interrupt()
            logits = model(tokens[:, None], cache=cache)[:, -1].float()
    finally:
        model.train(was_training)
    return out
