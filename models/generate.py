"""Autoregressive generation with a KV cache, sampling as transformers' ``generate`` does.

The logits of each step go through transformers' processors in its order: repetition penalty, temperature,
top-k, top-p; greedy decoding (``temperature=0``) takes the arg-max, and then gives transformers' tokens exactly.
Generation stops at any of ``stop_ids`` (the end-of-sequence and end-of-turn tokens) or after ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from waypoint.models.kv_cache import KVCache


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or self.repetition_penalty <= 0:
            raise ValueError("sampling: temperature >= 0, top_k >= 0, 0 < top_p <= 1, repetition_penalty > 0")


def process_logits(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """transformers' processors on a batch: ``logits`` [rows, vocab] (fp32), ``seen`` [rows, tokens] each row's token
    ids so far; each row is processed on its own (the same as that row alone)."""
    if sampling.repetition_penalty != 1.0:  # transformers' RepetitionPenaltyLogitsProcessor
        picked = logits.gather(1, seen)
        logits = logits.scatter(1, seen, torch.where(picked < 0, picked * sampling.repetition_penalty,
                                                     picked / sampling.repetition_penalty))
    if sampling.temperature == 0:
        return logits
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:  # transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p
        ordered, order = torch.sort(logits, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - sampling.top_p
        remove[:, -1] = False
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


def sample_rows(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling,
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """The next token of each row [rows] (int64): ``logits`` [rows, vocab] (fp32) of the last position, ``seen``
    [rows, tokens], row ``i`` drawing from ``generators[i]`` (None: torch's default generator).

    Greedy (``temperature=0``) draws nothing. Sampling draws, for each row, exactly what ``torch.multinomial(probs, 1,
    generator=g)`` draws and picks the same token: one ``exponential_`` fill of a vocabulary-sized vector from ``g``,
    then the arg-max of ``probs / q`` (torch's own one-sample path), so a row's tokens depend only on its generator."""
    logits = process_logits(logits, seen, sampling)
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = logits.softmax(-1)
    q = probs.new_empty(probs.shape)  # contiguous rows, as the one multinomial fills
    for row, generator in enumerate(generators):
        q[row].exponential_(generator=generator)
    return (probs / q).argmax(-1)


def next_token(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from the last position's ``logits`` [vocab] (fp32), given the ``seen`` token ids."""
    return int(sample_rows(logits[None], seen[None], sampling, [generator])[0])


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_ids: Iterable[int] = (), on_token: Callable[[int], bool | None] | None = None,
             generator: torch.Generator | None = None, images: dict[str, torch.Tensor] | None = None) -> list[int]:
    """The tokens ``model`` continues ``prompt`` with (a stop token included, as transformers returns it);
    ``on_token`` sees each as it comes (streaming) and stops the generation by returning True (a stop string).
    ``images``: a vision-language prompt's ``pixel_values`` and ``token_type_ids`` (for the prompt's tokens), which
    the first forward takes; the tokens after it are text."""
    if not prompt:
        raise ValueError("generate: the prompt has no tokens")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    stop = set(stop_ids)
    cache = KVCache(len(model.layers))
    seen = torch.tensor(prompt, device=device)
    step_input = seen[None]
    out: list[int] = []
    prefill = {k: v.to(device) for k, v in (images or {}).items()}
    try:
        for _ in range(max_new_tokens):
            logits = model(step_input, cache=cache, **prefill)[0, -1].float()
            prefill = {}
            token = next_token(logits, seen, sampling, generator)
            out.append(token)
            if (on_token is not None and on_token(token)) or token in stop:
                break
            seen = torch.cat([seen, seen.new_tensor([token])])
            step_input = seen[None, -1:]
    finally:
        model.train(was_training)
    return out
