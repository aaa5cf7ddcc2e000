"""``generate_group``: n completions of one prompt as one batch. Greedy rows are ``generate``'s tokens; sampled rows are
reproducible from the generator, each the tokens ``generate`` gives alone with that row's generator, whatever the
other rows do (their number, their stops); stop tokens and stop strings end a row and no other. A Llama-shaped model
and Qwen3.5's hybrid (Gated DeltaNet layers, whose recurrent state the group's cache copies per row)."""

from __future__ import annotations

import pytest
import torch

from waypoint.families import from_hf_config
from waypoint.models.generate import Sampling, generate
from waypoint.models.sample_group import generate_group, generate_groups, group_seed, row_generator
from tests.conftest import tiny_family_config

NEW = 10
PROMPT = [5, 9, 3, 77, 12, 40]
SAMPLED = Sampling(temperature=1.0, top_k=40, top_p=0.9, repetition_penalty=1.1)


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = from_hf_config(tiny_family_config(family).to_dict())
    with torch.no_grad():  # larger than init_weights' 0.02, so that the logits differ from token to token
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def model(request):
    return build(request.param)


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_are_generate(model):
    rows = generate_group(model, PROMPT, 3, NEW)
    assert rows == [generate(model, PROMPT, NEW)] * 3


def test_sampled_rows_are_reproducible_and_each_is_generate_alone(model):
    rows = generate_group(model, PROMPT, 4, NEW, SAMPLED, generator=seeded())
    assert rows == generate_group(model, PROMPT, 4, NEW, SAMPLED, generator=seeded())
    assert len({tuple(r) for r in rows}) == 4  # different draws
    base = group_seed(seeded())
    assert rows == [generate(model, PROMPT, NEW, SAMPLED, generator=row_generator(base, i)) for i in range(4)]


def test_the_call_takes_one_draw_from_the_generator(model):
    """A resumed run restores the generator (recipe_state.pt): the next group's draws follow from its state."""
    g = seeded(3)
    generate_group(model, PROMPT, 2, 4, SAMPLED, generator=g)
    after = seeded(3)
    group_seed(after)
    assert torch.equal(g.get_state(), after.get_state())
    resumed = torch.Generator()
    resumed.set_state(g.get_state())
    assert generate_group(model, PROMPT, 2, 4, SAMPLED, generator=g) == generate_group(model, PROMPT, 2, 4, SAMPLED,
                                                                                        generator=resumed)


def test_rows_do_not_depend_on_the_batch(model):
    """Row i of a group of 5 is row i of a group of 2, and stays so when other rows stop early."""
    five = generate_group(model, PROMPT, 5, NEW, SAMPLED, generator=seeded(1))
    assert generate_group(model, PROMPT, 2, NEW, SAMPLED, generator=seeded(1)) == five[:2]
    # row 3 stops at its first new token after the first; the others at that token wherever they meet it
    at = next(k for k in range(1, NEW) if five[3][k] not in five[3][:k])
    stop = five[3][at]
    stopped = generate_group(model, PROMPT, 5, NEW, SAMPLED, stop_ids=[stop], generator=seeded(1))
    expected = [r[: r.index(stop) + 1] if stop in r else r for r in five]
    assert stopped == expected and len(stopped[3]) == at + 1
    assert any(len(r) == NEW for r in stopped)  # and the others went on to the end


def test_stop_strings_end_a_row_after_the_token_that_completes_them(model):
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731 (each token's own text)
    free = generate_group(model, PROMPT, 3, NEW, SAMPLED, generator=seeded(2))
    # a string that spans two tokens of row 1, cut in the middle of both
    target = decode(free[1][2:4])[2:-1]
    rows = generate_group(model, PROMPT, 3, NEW, SAMPLED, stop_strings=[target], decode=decode, generator=seeded(2))
    for free_row, row in zip(free, rows):
        text = decode(free_row)
        if target in text:
            cut = next(k for k in range(1, len(free_row) + 1) if target in decode(free_row[:k]))
            assert row == free_row[:cut]
        else:
            assert row == free_row
    assert rows[1] == free[1][:4]
    with pytest.raises(ValueError, match="decode"):
        generate_group(model, PROMPT, 2, NEW, SAMPLED, stop_strings=["x"])


def test_edges(model):
    assert generate_group(model, PROMPT, 2, 0) == [[], []]
    assert generate_group(model, PROMPT, 1, 1) == [generate(model, PROMPT, 1)]
    with pytest.raises(ValueError, match="prompt"):
        generate_group(model, [], 2, 4)
    with pytest.raises(ValueError, match="n >= 1"):
        generate_group(model, PROMPT, 0, 4)
    model.train()
    generate_group(model, PROMPT, 2, 2)
    assert model.training  # the mode is restored
    model.eval()


def test_interrupt_is_called_before_each_forward_and_what_it_raises_abandons_the_group(model):
    """A preemption mid-group (``waypoint.training.grpo_step``): the group stops at the next token, not its last."""
    calls, forwards = [], []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))

    class Preempted(Exception):
        pass

    def interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise Preempted
    try:
        with pytest.raises(Preempted):
            generate_group(model, PROMPT, 2, NEW, SAMPLED, generator=seeded(), interrupt=interrupt)
        assert len(forwards) == 2  # the prompt and one token; the third forward never ran
        calls.clear()
        assert generate_group(model, PROMPT, 2, 4, SAMPLED, generator=seeded(), interrupt=lambda: calls.append(1)) \
            == generate_group(model, PROMPT, 2, 4, SAMPLED, generator=seeded())
        assert len(calls) == 4  # the prompt's forward and each token's but the last
    finally:
        hook.remove()


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_5", "gemma4"])
def test_several_prompts_in_one_loop_sample_what_each_samples_alone(family):
    """``generate_groups``: prompts of different lengths prefilled apart, then every row of every group in one batch a
    token (each row at its own position, attending its own tokens only: sliding windows, attention sinks, MLA's
    latents, Gated DeltaNet's state, Gemma 4's shared keys); each row's tokens are those its group samples alone, and
    a stop ends only the rows that meet it."""
    model = build(family)
    prompts = [PROMPT, [7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    for sampling in (Sampling(temperature=0), SAMPLED):
        alone = [generate_group(model, p, 3, NEW, sampling, generator=seeded(i)) for i, p in enumerate(prompts)]
        together = generate_groups(model, prompts, 3, NEW, sampling, generators=[seeded(i) for i in range(3)])
        assert together == alone, (family, sampling)
    stop = alone[1][0][1]
    stopped = generate_groups(model, prompts, 3, NEW, SAMPLED, stop_ids=[stop], generators=[seeded(i) for i in range(3)])
    assert stopped == [[r[: r.index(stop) + 1] if stop in r else r for r in group] for group in alone]
