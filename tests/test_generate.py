"""Generation against transformers: greedy tokens identical to ``generate`` for every family (fp32, KV cache), the
cached step's logits equal to a full forward, and the sampling processors equal to transformers' own."""

from __future__ import annotations

import pytest
import torch

from waypoint.checkpointers import load_model
from waypoint.models.generate import Sampling, generate
from waypoint.models.kv_cache import KVCache
from tests.conftest import tiny_family_config, write_family_checkpoint
from tests.test_families import FAMILIES

NEW_TOKENS = 12


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_is_transformers_token_for_token(name, tmp_path):
    fam, overrides, _ = FAMILIES[name]
    hf_model = write_family_checkpoint(tmp_path / "in", tiny_family_config(fam, **overrides), packed=name.endswith("-packed"))
    model = load_model(tmp_path / "in")
    prompt = torch.randint(1, 128, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = generate(model, prompt, NEW_TOKENS)
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs, name


def test_cached_steps_give_the_full_forward_logits(tmp_path):
    """A sliding window shorter than the sequence and the local rope of Gemma 3: the cache must apply both."""
    write_family_checkpoint(tmp_path / "in", tiny_family_config("gemma3"))
    model = load_model(tmp_path / "in").eval()
    tokens = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(len(model.layers))
        stepped = [model(tokens[:, :5], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(5, 11)]
    assert cache.length == 11
    assert (torch.cat(stepped, dim=1) - full).abs().max().item() <= 1e-5


def test_sampling_processors_are_transformers():
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from waypoint.models import generate as gen

    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 3
    seen = torch.tensor([3, 7, 7, 20])
    sampling = Sampling(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3)
    theirs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7), TopKLogitsWarper(20),
                                  TopPLogitsWarper(0.8)])(seen[None], logits[None].clone())[0]
    draws = {gen.next_token(logits, seen, sampling, torch.Generator().manual_seed(s)) for s in range(300)}
    allowed = set(torch.nonzero(theirs > float("-inf")).flatten().tolist())
    assert draws <= allowed and len(draws) > 1, (draws, allowed)
    # the same distribution: our draws follow transformers' probabilities
    counts = torch.bincount(torch.tensor([gen.next_token(logits, seen, sampling, torch.Generator().manual_seed(s))
                                          for s in range(2000)]), minlength=50).float() / 2000
    assert (counts - theirs.softmax(-1)).abs().max().item() < 0.05
    assert gen.next_token(logits, seen, Sampling(), None) == int(logits.argmax())
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)


def test_generation_stops_at_a_stop_token_and_streams(tmp_path):
    write_family_checkpoint(tmp_path / "in", tiny_family_config("llama"))
    model = load_model(tmp_path / "in")
    free = generate(model, [1, 2, 3], 8)
    streamed = []
    stopped = generate(model, [1, 2, 3], 8, stop_ids=[free[3]], on_token=streamed.append)
    assert stopped == free[:free.index(free[3]) + 1] == streamed
