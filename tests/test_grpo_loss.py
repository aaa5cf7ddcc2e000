"""training/grpo_loss.py against TRL 1.16's GRPOTrainer, run as the oracle without a model: its own ``_compute_loss``
on a trainer made with ``object.__new__`` whose log-prob forward returns our tensors, and the advantage, reward and
completion-metric blocks of ``_generate_and_score_completions`` (not separable functions) cut from TRL's source by
their first and last lines and executed as they stand."""

from __future__ import annotations

import inspect
import itertools
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import TRL_ORACLE
from waypoint.training.grpo_loss import (
    LOSS_TYPES, GRPOLossOptions, group_advantages, grpo_loss, rollout_metrics, weighted_rewards)

pytestmark = TRL_ORACLE


class _TRL:
    """TRL's GRPO trainer module, imported by the first test that runs it, not when the suite is collected."""

    def __getattr__(self, name):
        if name.startswith("__"):  # what collection asks of any module-level object (__bases__, __wrapped__...)
            raise AttributeError(name)
        return getattr(pytest.importorskip("trl.trainer.grpo_trainer"), name)


trl_grpo = _TRL()

B, T = 6, 9


class Accelerator:
    """One process: gather and reduce are the identity."""
    num_processes, process_index, sync_gradients, device = 1, 0, True, torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_trainer(o: GRPOLossOptions, training: bool = True):
    trainer = object.__new__(trl_grpo.GRPOTrainer)
    trainer.__dict__.update(
        loss_type=o.loss_type, importance_sampling_level=o.importance_sampling_level, beta=o.beta,
        epsilon_low=o.epsilon, epsilon_high=o.epsilon if o.epsilon_high is None else o.epsilon_high,
        num_iterations=o.num_iterations, max_completion_length=o.max_completion_length,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        current_gradient_accumulation_steps=o.gradient_accumulation_steps, accelerator=Accelerator(),
        model=SimpleNamespace(training=training), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(
            delta=o.delta, use_bias_correction_kl=o.use_bias_correction_kl,
            sapo_temperature_pos=o.sapo_temperature_pos, sapo_temperature_neg=o.sapo_temperature_neg,
            vespo_k_pos=o.vespo_k_pos, vespo_lambda_pos=o.vespo_lambda_pos, vespo_k_neg=o.vespo_k_neg,
            vespo_lambda_neg=o.vespo_lambda_neg,
            steps_per_generation=o.steps_per_generation or o.gradient_accumulation_steps))
    return trainer


def trl_loss(o, logps, old, ref, advantages, mask, entropies, num_items_in_batch, training=True):
    trainer = trl_trainer(o, training)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    inputs = {"prompt_ids": torch.zeros(B, 3, dtype=torch.long), "prompt_mask": torch.ones(B, 3, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "num_items_in_batch": num_items_in_batch}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = trainer._compute_loss(None, inputs)
    mode = "train" if training else "eval"
    return loss, {k: v[-1] for k, v in trainer._metrics[mode].items()}


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 1, 4, 7, 0, 5])  # a full, a one-token and an empty completion among them
    mask = (torch.arange(T) < lengths[:, None]).long()
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + 0.3 * torch.randn(B, T, generator=g)  # far enough off-policy that both clips engage
    ref = logps + 0.2 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, generator=g)
    entropies = torch.rand(B, T, generator=g) * 2
    return logps, old, ref, advantages, mask, entropies


def close(a: float, b: float, tol: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol


CASES = list(itertools.product(LOSS_TYPES, ("token", "sequence"), (0.0, 0.04), (None, 0.28)))


@pytest.mark.parametrize("loss_type,level,beta,epsilon_high", CASES)
def test_loss_and_metrics_match_trl(loss_type, level, beta, epsilon_high):
    o = GRPOLossOptions(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                        epsilon_high=5.0 if loss_type == "cispo" and epsilon_high else epsilon_high,
                        max_completion_length=T + 3)
    logps, old, ref, advantages, mask, entropies = batch(len(CASES) + CASES.index((loss_type, level, beta, epsilon_high)))
    for old_logps in (old, None):  # num_iterations > 1, and == 1 (old = the current log-probs, detached)
        ours_in = logps.clone().requires_grad_()
        theirs_in = logps.clone().requires_grad_()
        refs = ref if beta else None
        ours, our_metrics = grpo_loss(ours_in, old_logps, refs, advantages, mask, o, entropies=entropies)
        theirs, their_metrics = trl_loss(o, theirs_in, old_logps, refs, advantages, mask, entropies, mask.sum())
        assert abs(ours.item() - theirs.item()) <= 1e-6, (ours.item(), theirs.item())
        ours.backward()
        theirs.backward()
        assert torch.allclose(ours_in.grad, theirs_in.grad, atol=1e-6, rtol=0)
        assert our_metrics.keys() == their_metrics.keys()
        for name, value in their_metrics.items():
            assert close(our_metrics[name], value, 1e-6), (name, our_metrics[name], value)
        if beta == 0.0 and level == "token" and loss_type in ("grpo", "dapo") and old_logps is not None:
            assert their_metrics["clip_ratio/region_mean"] > 0  # the clipping branch is exercised


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_accumulation_delta_and_eval_match_trl(loss_type):
    """gradient_accumulation_steps with several steps per generation, the generation batch's token count, delta's
    two-sided clipping, and eval mode (no accumulation scaling)."""
    o = GRPOLossOptions(loss_type=loss_type, beta=0.04, delta=1.25, epsilon_high=0.28, gradient_accumulation_steps=4,
                        steps_per_generation=8, use_bias_correction_kl=loss_type != "grpo")
    logps, old, ref, advantages, mask, entropies = batch(7)
    items = torch.tensor(97)
    for training in (True, False):
        ours, our_metrics = grpo_loss(logps, old, ref, advantages, mask, o, entropies, items, training=training)
        theirs, their_metrics = trl_loss(o, logps, old, ref, advantages, mask, entropies, items, training)
        assert abs(ours.item() - theirs.item()) <= 1e-6
        for name, value in their_metrics.items():
            assert close(our_metrics[name], value, 1e-6), name


def trl_block(first: str, last: str) -> str:
    """The lines of TRL's ``_generate_and_score_completions`` from the one holding ``first`` to the one holding
    ``last``, dedented."""
    source = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, line in enumerate(source) if first in line)
    end = next(i for i, line in enumerate(source) if i >= start and last in line)
    return textwrap.dedent("\n".join(source[start:end + 1]))


def trl_advantages_and_reward_metrics(rewards_per_func, names, weights, num_generations, scale_rewards):
    self = SimpleNamespace(
        multi_objective_aggregation="sum_then_normalize", reward_weights=weights, reward_func_names=names,
        scale_rewards={True: "group", False: "none"}.get(scale_rewards, scale_rewards),
        _metrics={"train": defaultdict(list)})
    from trl.trainer.utils import nanstd

    scope = {"self": self, "torch": torch, "nanstd": nanstd, "rewards_per_func": rewards_per_func,
             "num_generations": num_generations, "device": torch.device("cpu"), "mode": "train"}
    exec(trl_block("unscorable_mask = torch.isnan(rewards_per_func)", "advantages = torch.nan_to_num"), scope)
    exec(trl_block("for i, reward_func_name in enumerate(self.reward_func_names)", '"frac_reward_zero_std"'), scope)
    return scope["advantages"], {k: v[-1] for k, v in self._metrics["train"].items()}


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none", True, False])
@pytest.mark.parametrize("num_generations", [1, 4])
def test_advantages_and_reward_metrics_match_trl(scale_rewards, num_generations):
    g = torch.Generator().manual_seed(3)
    rewards_per_func = torch.randn(12, 2, generator=g)
    rewards_per_func[:4, 0] = 1.0  # a group whose rewards are all equal (std 0)
    rewards_per_func[:4, 1] = 0.5
    rewards_per_func[5, 1] = torch.nan  # a function that returned None
    rewards_per_func[9] = torch.nan  # an unscorable completion
    names, weights = ["accuracy", "format"], torch.tensor([1.0, 0.5])
    theirs, their_metrics = trl_advantages_and_reward_metrics(rewards_per_func, names, weights, num_generations,
                                                              scale_rewards)
    rewards = weighted_rewards(rewards_per_func, weights)
    ours, our_metrics = group_advantages(rewards, num_generations, scale_rewards)
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0) and ours[9] == 0
    lengths, terminated = torch.arange(12), torch.ones(12, dtype=torch.bool)
    our_metrics |= rollout_metrics(rewards_per_func, names, lengths, terminated, weights)
    for name, value in their_metrics.items():
        assert close(our_metrics[name], value, 1e-6), name


@pytest.mark.parametrize("truncated", [[], [1, 4], list(range(5))])
def test_completion_metrics_match_trl(truncated):
    eos, pad = 2, 0
    completion_ids = [[5] * n + [eos] for n in (3, 0, 6, 2, 8)]
    for i in truncated:
        completion_ids[i] = completion_ids[i][:-1] + [7]  # cut off before EOS
    self = SimpleNamespace(eos_token_ids=[eos], _tokenizer=SimpleNamespace(pad_token_id=pad),
                           accelerator=Accelerator(), _metrics={"train": defaultdict(list)})
    lengths = torch.tensor([len(ids) for ids in completion_ids])
    scope = {"self": self, "torch": torch, "completion_ids": completion_ids, "agg_completion_lengths": lengths,
             "device": torch.device("cpu"), "mode": "train"}
    lines = inspect.getsource(trl_grpo.GRPOTrainer._generate).splitlines()
    start = next(i for i, line in enumerate(lines) if '"completions/mean_length"' in line)
    end = next(i for i, line in enumerate(lines) if '"completions/max_terminated_length"' in line)
    exec(textwrap.dedent("\n".join(lines[start:end + 1])), scope)
    theirs = {k: v[-1] for k, v in self._metrics["train"].items()}
    terminated = torch.tensor([ids[-1] in (eos, pad) for ids in completion_ids])
    ours = rollout_metrics(torch.zeros(5, 1), ["r"], lengths, terminated)
    for name, value in theirs.items():
        assert close(ours[name], value, 0), name


@pytest.mark.parametrize("field,value,message", [
    ("loss_type", "ppo", "loss_type='ppo': expected one of grpo, bnpo"),
    ("importance_sampling_level", "tok", "importance_sampling_level='tok': expected token or sequence"),
    ("scale_rewards", "std", "scale_rewards='std': expected group, batch, none, True or False"),
    ("beta", -0.1, "beta=-0.1: expected a finite number >= 0"),
    ("epsilon_high", float("nan"), "epsilon_high=nan: expected None or a finite number >= 0"),
    ("max_completion_length", 0, "max_completion_length=0: expected an integer >= 1"),
    ("sapo_temperature_pos", 0.0, "sapo_temperature_pos=0.0: expected a finite number > 0"),
])
def test_options_refuse_in_one_line(field, value, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")) as error:
        GRPOLossOptions(**{field: value})
    assert "\n" not in str(error.value)


def test_defaults_are_trls():
    from trl import GRPOConfig
    config = GRPOConfig.__dataclass_fields__
    for name, field in GRPOLossOptions.__dataclass_fields__.items():
        if name in config and name != "steps_per_generation":
            assert field.default == config[name].default, name
    assert GRPOLossOptions(scale_rewards=True).scale_rewards == "group"
    assert GRPOLossOptions(scale_rewards=False).scale_rewards == "none"
    with pytest.raises(ValueError, match="^ref_per_token_logps: required with beta=0.04"):
        grpo_loss(torch.zeros(1, 2), None, None, torch.zeros(1), torch.ones(1, 2), GRPOLossOptions(beta=0.04))
