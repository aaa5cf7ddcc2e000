"""Reward functions: the built-ins on edge cases, naming them from a config, and ``score`` against TRL 1.16; a
reward that never returns, is cut short by a preemption, is not finite or calls ``sys.exit``: one line each.

TRL's part: ``GRPOTrainer._calculate_rewards`` is called unbound on a stand-in holding the attributes it reads
(``test_per_function_values_are_trls_own``, marked slow: importing TRL's trainer takes ~25 s here). The weighted
sum and the unscorable rows live inside ``_generate_and_score_completions`` with the rest of a training step, so
``trl_combine`` below copies its three lines; the fast test checks ``score`` against that copy.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import sys
import textwrap
import threading
import time

import pytest
import torch

from tests.conftest import TRL_ORACLE
from waypoint.errors import CheckpointError
from waypoint.rewards import bounded
from waypoint.rewards.bounded import Interrupted
from waypoint.rewards.finite import group_problem
from waypoint.rewards.functions import answer_match, completion_text, extract_answer, format_reward, length_penalty
from waypoint.rewards.scoring import RewardError, resolve, reward_name, score
from waypoint.run.preemption import PreemptionWatch


def chat(text):
    return [{"role": "assistant", "content": text}]


def trl_combine(per_func, weights):
    """TRL 1.16 ``_generate_and_score_completions`` (sum_then_normalize): the reward per completion."""
    unscorable_mask = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    return rewards


def same(a, b):
    """Equal to the bit, NaN where the other is NaN (``torch.testing.assert_close`` takes seconds to import)."""
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


# ---- built-ins ----

@pytest.mark.parametrize("completion, answer, want", [
    ("42", "42", 1.0),
    ("  The Answer:  42. ", "42", 1.0),                       # after "answer:", trailing period
    ("so \\boxed{3.0}", "3", 1.0),                            # numbers as numbers
    ("\\boxed{\\frac{1}{2}} and \\boxed{7}", "7", 1.0),      # the last box
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),           # nested braces
    ("work...\n#### 1,000", "1000", 1.0),                     # GSM8K marker, thousands separator
    ("x", "reasoning here #### 72", 0.0),
    ("72", "reasoning here #### 72", 1.0),                    # the reference is extracted too
    ("<think>answer: 5</think>answer: 6", "6", 1.0),           # only after </think>
    ("Paris  France", "paris france!", 1.0),                  # case, whitespace, punctuation
    ("3.5", "3", 0.0),
    ("", "", 0.0),                                            # no answer never matches
    ("$12", "12.00", 1.0),
])
def test_answer_match(completion, answer, want):
    assert answer_match(["p"], [completion], answer=[answer]) == [want]
    assert answer_match(["p"], [chat(completion)], answer=[answer]) == [want]


def test_answer_match_options_and_none():
    assert answer_match(["p"] * 2, ["A", "a"], normalize=False, answer=["A", "A"]) == [1.0, 0.0]
    assert answer_match(["p"] * 2, ["1", "2"], column="solution", solution=[1, None]) == [1.0, None]
    with pytest.raises(ValueError, match="no column 'answer'.*solution"):
        answer_match(["p"], ["1"], solution=["1"])


def test_extract_and_text():
    assert extract_answer("\\boxed{unclosed") == "\\boxed{unclosed"
    assert extract_answer("Answer:\n\n  7\nmore") == "  7"
    blocks = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}]
    assert completion_text(blocks) == "ab"


def test_format_reward():
    good, bad = "<think>\nhmm\n</think>\nanswer: 4", "answer: 4"
    assert format_reward(["p"] * 4, [good, bad, "<think>x</think>   ", chat(good)]) == [1.0, 0.0, 0.0, 1.0]
    assert format_reward(["p"] * 2, ["ab", "abc"], pattern=r"a.") == [1.0, 0.0]  # the whole text must match
    with pytest.raises(ValueError, match="not a valid regular expression"):
        format_reward(["p"], ["x"], pattern="(")


def test_length_penalty():
    ids = [[0] * 3, [0] * 4, [0] * 10]
    assert length_penalty(["p"] * 3, ["a"] * 3, ids, target=4, per_token=0.5) == [0.0, 0.0, -3.0]
    assert length_penalty(["p"] * 3, ["a"] * 3, ids, target=4, per_token=0.5, max_penalty=1.0)[2] == -1.0
    with pytest.raises(ValueError, match="completion_ids"):
        length_penalty(["p"], ["a"], None)


# ---- resolve ----

@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A working directory holding the user's own reward file; its module is forgotten afterwards."""
    (tmp_path / "wp_user_rewards.py").write_text(textwrap.dedent("""
        def shout(prompts, completions, **kwargs):
            return [float(c.isupper()) for c in completions]
        class Scorer:
            def __call__(self, prompts, completions, **kwargs):
                return [1.0] * len(completions)
        scorer = Scorer()
        NOT_A_FUNCTION = 3
    """))
    (tmp_path / "wp_broken_rewards.py").write_text("def f(:\n")
    (tmp_path / "wp_needy_rewards.py").write_text("import wp_no_such_dependency\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in ("wp_user_rewards", "wp_broken_rewards", "wp_needy_rewards"):
        sys.modules.pop(name, None)


def test_resolve_names(user_dir):
    funcs = resolve(["wp_user_rewards.shout", "wp_user_rewards:scorer", "answer_match",
                     "waypoint.rewards.functions.length_penalty", {"name": "answer_match", "column": "solution"}])
    assert funcs[0](["p"] * 2, ["HI", "hi"]) == [1.0, 0.0]
    assert funcs[2] is answer_match and funcs[4].keywords == {"column": "solution"}
    assert [reward_name(f) for f in funcs] == ["shout", "Scorer", "answer_match", "length_penalty", "answer_match"]


def test_resolve_dict_from_omegaconf(user_dir):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"reward_funcs": [{"name": "format_reward", "pattern": "x+"}, "wp_user_rewards.shout"]})
    funcs = resolve(cfg.reward_funcs)
    assert funcs[0](["p"], ["xx"]) == [1.0]


@pytest.mark.parametrize("entry, says", [
    ("nope", "nope: not a built-in reward (answer_match, format_reward, length_penalty); give module.function"),
    ("wp_missing.f", "wp_missing.f: no module wp_missing in the working directory"),
    ("wp_user_rewards.nope", "wp_user_rewards.nope: wp_user_rewards ("),
    ("wp_user_rewards.NOT_A_FUNCTION", "is a int, not a function"),
    ("wp_broken_rewards.f", "importing wp_broken_rewards raised SyntaxError: invalid syntax"),
    ("wp_needy_rewards.f", "importing wp_needy_rewards failed: No module named 'wp_no_such_dependency'"),
    ({"name": "answer_match", "colum": "x"}, "answer_match: no option colum (options: column, normalize)"),
    ({"column": "x"}, "needs name: <function>"),
    (3, "3: give module.function"),
])
def test_resolve_errors_are_one_line(user_dir, entry, says):
    with pytest.raises(RewardError) as e:
        resolve([entry])
    assert says in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, CheckpointError)


# ---- score ----

def random_funcs(n, f, seed):
    rng = random.Random(seed)
    table = [[None if rng.random() < 0.3 else rng.uniform(-2, 2) for _ in range(n)] for _ in range(f)]
    table[0][1] = None  # row 1: every function says None
    for column in table:
        column[1] = None
    funcs = []
    for k, column in enumerate(table):
        def reward(prompts, completions, completion_ids, _column=column, **kwargs):
            return list(_column)
        reward.__name__ = f"r{k}"
        funcs.append(reward)
    return funcs, [rng.uniform(-1, 2) for _ in range(f)]


def test_score_is_trls_combination():
    funcs, weights = random_funcs(n=16, f=3, seed=0)
    rewards, per_func = score(funcs, weights, ["p"] * 16, ["c"] * 16, [[1]] * 16, {"answer": ["a"] * 16})
    assert per_func.dtype == rewards.dtype == torch.float32 and per_func.shape == (16, 3)
    assert torch.isnan(per_func).any() and torch.isnan(rewards[1])
    assert same(rewards, trl_combine(per_func, torch.tensor(weights)))
    ones, _ = score(funcs, None, ["p"] * 16, ["c"] * 16, [[1]] * 16)
    assert same(ones, trl_combine(per_func, torch.ones(3)))


def test_score_passes_columns_and_runs_async():
    seen = {}

    def spy(prompts, completions, completion_ids, **kwargs):
        seen.update(kwargs)
        return [True, 2]

    async def later(prompts, completions, **kwargs):
        return [0.5, None]

    rewards, per_func = score([spy, later], [1.0, 2.0], ["p", "q"], [chat("a"), chat("b")], [[1], [2]],
                              {"answer": ["x", "y"], "prompt": ["p", "q"], "trainer_state": "S"})
    assert seen == {"answer": ["x", "y"], "trainer_state": "S"}
    assert rewards.tolist() == [2.0, 2.0]


def bad(out=None, exc=None):
    def bad_reward(prompts, completions, **kwargs):
        if exc:
            raise exc
        return out
    return bad_reward


@pytest.mark.parametrize("func, says", [
    (bad(exc=ZeroDivisionError("division by zero\nmore")), "reward function bad_reward raised ZeroDivisionError: division by zero"),
    (bad([1.0]), "reward function bad_reward returned 1 values for 2 completions"),
    (bad(1.0), "reward function bad_reward returned a float, not a list of 2 values"),
    (bad(["1.0", 1.0]), "reward function bad_reward returned str '1.0' for completion 0; return a number or None"),
    (functools.partial(bad([1.0, {}])), "reward function bad_reward returned dict {} for completion 1"),
])
def test_score_errors_are_one_line(func, says):
    with pytest.raises(RewardError) as e:
        score([func], None, ["p", "q"], ["a", "b"], [[1], [2]], {})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_score_bad_weights_and_columns():
    funcs, _ = random_funcs(n=2, f=2, seed=1)
    with pytest.raises(RewardError, match="reward_weights: 1 weights for 2 reward_funcs"):
        score(funcs, [1.0], ["p"] * 2, ["c"] * 2, None)
    with pytest.raises(RewardError, match="column answer has 1 values for 2 completions"):
        score(funcs, None, ["p"] * 2, ["c"] * 2, None, {"answer": ["a"]})


@pytest.mark.slow
@TRL_ORACLE
def test_per_function_values_are_trls_own():
    """TRL's ``_calculate_rewards``, unbound, on a stand-in: same per-function values; TRL's names."""
    from types import SimpleNamespace

    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import get_callable_name

    funcs, weights = random_funcs(n=8, f=3, seed=2)
    funcs.append(functools.partial(answer_match, column="solution"))
    weights.append(0.5)
    prompts, completions = [chat("q")] * 8, [chat(f"\\boxed{{{i % 3}}}") for i in range(8)]
    ids = [[1] * i for i in range(8)]
    inputs = [{"prompt": p, "completion": c, "solution": str(i % 2)} for i, (p, c) in enumerate(zip(prompts, completions))]
    stand_in = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=SimpleNamespace(report_to=[]), state=SimpleNamespace(global_step=0),
        reward_funcs=funcs, reward_processing_classes=[None] * 4,
        reward_func_names=[get_callable_name(f) for f in funcs], environments=None,
        _log_completion_extra=lambda *a, **k: None, _log_metric=lambda *a, **k: None)
    theirs = GRPOTrainer._calculate_rewards(stand_in, inputs, prompts, completions, ids)
    rewards, ours = score(funcs, weights, prompts, completions, ids, {"solution": [x["solution"] for x in inputs]})
    assert same(ours, theirs)
    assert same(rewards, trl_combine(theirs, torch.tensor(weights)))
    assert [reward_name(f) for f in funcs] == stand_in.reward_func_names


# ---- bounded: a reward that never returns, a preemption while one runs ----

def sleeps(prompts, completions, **kwargs):
    time.sleep(3600)


def spins(prompts, completions, **kwargs):
    while True:  # pure Python: the GIL passes at each switch interval, signal handlers run between bytecodes
        pass


def swallows(prompts, completions, **kwargs):
    try:
        time.sleep(3600)
    except BaseException:  # noqa: BLE001 (the cut too: the call still counts as too long)
        return [1.0] * len(completions)


async def awaits(prompts, completions, **kwargs):
    await asyncio.sleep(3600)


async def blocks(prompts, completions, **kwargs):
    time.sleep(3600)  # blocks its event loop


async def quick(prompts, completions, **kwargs):
    return [0.5] * len(completions)


@pytest.mark.parametrize("funcs, name", [([sleeps], "sleeps"), ([spins], "spins"), ([swallows], "swallows"),
                                         ([quick, awaits], "awaits"), ([blocks, quick], "blocks")],
                         ids=["sleep", "busy-loop", "swallows-the-cut", "async-await", "async-blocking"])
def test_a_reward_that_does_not_return_is_cut_at_its_timeout(funcs, name):
    started = time.monotonic()
    with pytest.raises(RewardError) as e:
        score(funcs, None, ["Write the letter a.", "q"], ["a", "b"], [[1], [2]], timeout=0.3)
    assert time.monotonic() - started < 5
    assert str(e.value).startswith(f"reward function {name} took longer than reward_timeout=0.3 s on 2 completions "
                                   "(the first prompt: 'Write the letter a.')"), e.value
    assert isinstance(e.value, CheckpointError) and "\n" not in str(e.value)
    assert signal.getsignal(bounded.SIGNAL) in (signal.SIG_DFL, None)  # the call's handler is gone
    assert score([quick], None, ["p"], ["a"], [[1]], timeout=0.3)[0].tolist() == [0.5]  # and the next call is fine


def test_a_preemption_signal_while_a_reward_runs_interrupts_it():
    """SIGTERM to this process as PreemptionWatch handles it in a run: the sleeping reward is cut at once, not at its
    timeout, and ``Interrupted`` (not an error) tells the step to save and stop."""
    watch = PreemptionWatch(["SIGTERM"])
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        started = time.monotonic()
        with pytest.raises(Interrupted):
            score([sleeps], None, ["p"], ["a"], [[1]], timeout=60, stop=lambda: watch.requested)
        assert time.monotonic() - started < 5 and watch.received == "SIGTERM"
    finally:
        timer.cancel()
        watch.restore()


# ---- finite: a number that would train nothing ----

def returns(*values):
    def odd(prompts, completions, **kwargs):
        return list(values)
    return odd


@pytest.mark.parametrize("values, says", [
    ((1.0, float("nan")), "reward function odd returned nan for completion 1 (prompt 'q'); return a finite number, "
                          "or None to leave the completion out"),
    ((float("inf"), 1.0), "reward function odd returned inf for completion 0 (prompt 'Write the letter a.')"),
    ((None, -float("inf")), "reward function odd returned -inf for completion 1"),
    ((1e308, 0.0), "reward function odd returned 1e+308 for completion 0, past float32's range"),
    ((torch.tensor(float("nan")), 0.0), "reward function odd returned nan for completion 0"),
], ids=["nan", "inf", "-inf-beside-None", "past-float32", "nan-tensor"])
def test_a_reward_that_is_not_finite_is_one_line(values, says):
    with pytest.raises(RewardError) as e:
        score([returns(*values)], None, ["Write the letter a.", "q"], ["a", "b"], [[1], [2]])
    assert str(e.value).startswith(says) and "\n" not in str(e.value), e.value


def test_weights_and_weighted_sums_that_are_not_finite_are_one_line():
    funcs = [returns(3e38, None), returns(3e38, 1.0)]
    with pytest.raises(RewardError, match=r"^reward_weights: nan is not a finite number"):
        score(funcs, [float("nan"), 1.0], ["p", "q"], ["a", "b"], None)
    with pytest.raises(RewardError, match=r"^reward_weights: the weighted sum of completion 0's rewards "
                                          r"\(odd 3e\+38 x 1, odd 3e\+38 x 1\) is past float32's range \(prompt 'p'\)"):
        score(funcs, None, ["p", "q"], ["a", "b"], None)
    rewards, _ = score(funcs, [1e-3, 1.0], ["p", "q"], ["a", "b"], None)  # None stays TRL's NaN, left out of the sum
    assert torch.isfinite(rewards).all()


def test_group_statistics_that_overflow_are_one_line():
    """Finite rewards whose group mean or spread overflows float32 would become advantages of 0."""
    fine = torch.tensor([1.0, float("nan"), 3.0, 4.0, float("nan"), float("nan"), float("nan"), float("nan")])
    assert all(group_problem(fine, 4, scale, str) is None for scale in ("group", "batch", "none"))
    big = torch.tensor([1e20, -1e20, 0.0, 1.0, 1.0, 2.0, 3.0, 4.0])
    assert group_problem(big, 4, "group", lambda g: f"'P{g}'").startswith(
        "the rewards of prompt 'P0''s group (-1e+20 to 1e+20) overflow float32")
    assert group_problem(big, 4, "none", str) is None  # no spread taken: the advantages are the differences
    huge = torch.tensor([0.0, 0.0, 0.0, 0.0, 3e38, 3e38, 0.0, 0.0])  # group 1's mean
    assert "prompt 'P1''s group (0 to 3e+38)" in group_problem(huge, 4, "none", lambda g: f"'P{g}'")
    split = torch.tensor([1e19, 1e19, 1e19, 1e19, -1e19, -1e19, -1e19, -1e19])  # each group alike, the batch not
    assert group_problem(split, 4, "group", str) is None
    assert "the step's rewards (scale_rewards=batch)" in group_problem(split, 4, "batch", str)


# ---- sys.exit in a user's reward: an error, never the run's exit status ----

async def exits_later(prompts, completions, **kwargs):
    sys.exit(0)


def test_sys_exit_in_a_reward_is_an_error(user_dir):
    def exits(prompts, completions, **kwargs):
        sys.exit(0)
    for func, name in ((exits, "exits"), (exits_later, "exits_later")):
        with pytest.raises(RewardError, match=rf"^reward function {name} called sys.exit\(0\); return its values"):
            score([func], None, ["p"], ["a"], [[1]], timeout=5)
    (user_dir / "wp_exiting_rewards.py").write_text("import sys\nsys.exit(3)\n")
    try:
        with pytest.raises(RewardError, match=r"wp_exiting_rewards.f: importing wp_exiting_rewards called "
                                              r"sys.exit\(3\)"):
            resolve(["wp_exiting_rewards.f"])
    finally:
        sys.modules.pop("wp_exiting_rewards", None)
