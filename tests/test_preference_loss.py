"""The preference losses and metrics equal TRL's: its loss functions on identical log-probs, and DPOTrainer's whole
forward (tokenization, concatenated chosen/rejected batch, per-sequence log-probs, loss, metrics) on the same tiny
model and pairs, within 1e-5 in fp32."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT, TRL_ORACLE
from waypoint.errors import CheckpointError
from waypoint.training.preference_loss import METRICS, PreferenceLoss, pair_metrics

trl = pytest.importorskip("trl")
pytestmark = TRL_ORACLE
TINY = ROOT / "assets" / "tiny_llama"


def random_logps(pairs: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    policy = -torch.rand(2, pairs, generator=g, dtype=torch.float64) * 40
    reference = policy + torch.randn(2, pairs, generator=g, dtype=torch.float64) * 3
    tokens = torch.randint(1, 30, (2, pairs), generator=g)
    return policy.float(), reference.float(), tokens


def cpo_self(loss_type: str, beta: float, label_smoothing: float, gamma: float = 0.5):
    """What ``CPOTrainer.cpo_loss`` reads of its trainer."""
    return SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type,
                           simpo_gamma=gamma, accelerator=SimpleNamespace(device=torch.device("cpu")))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
def test_sigmoid_with_label_smoothing_is_trls_conservative_dpo(label_smoothing):
    """cDPO: TRL's CPO loss of the log-ratios (the formula DPOTrainer's sigmoid loss had with label_smoothing)."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    (chosen, rejected), (ref_chosen, ref_rejected), (nc, nr) = random_logps()
    ours, our_chosen_rewards, our_rejected_rewards = PreferenceLoss("sigmoid", 0.2, label_smoothing)(
        chosen, rejected, ref_chosen, ref_rejected, nc, nr)
    theirs, their_chosen_rewards, their_rejected_rewards = CPOTrainer.cpo_loss(
        cpo_self("sigmoid", 0.2, label_smoothing), chosen - ref_chosen, rejected - ref_rejected)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_chosen_rewards, their_chosen_rewards, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_rejected_rewards, their_rejected_rewards, atol=1e-5, rtol=0)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.4])
def test_simpo_is_trls_cpo_simpo(gamma, label_smoothing):
    """SimPO: CPOTrainer's ``simpo`` loss (cpo_alpha=0) of the completions' mean log-probs; its rewards are beta
    times those means."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    (chosen, rejected), _, (nc, nr) = random_logps(seed=1)
    loss = PreferenceLoss("simpo", 2.0, label_smoothing, gamma)
    ours, our_chosen_rewards, our_rejected_rewards = loss(chosen, rejected, None, None, nc, nr)
    theirs, their_chosen_rewards, their_rejected_rewards = CPOTrainer.cpo_loss(
        cpo_self("simpo", 2.0, label_smoothing, gamma), chosen / nc, rejected / nr)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_chosen_rewards, their_chosen_rewards, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_rejected_rewards, their_rejected_rewards, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss.logps_logged(chosen, nc), chosen / nc)


def test_label_smoothing_is_refused_where_the_loss_has_none():
    for loss_type in ("ipo", "hinge"):
        with pytest.raises(CheckpointError, match=f"loss.label_smoothing applies to the sigmoid and simpo losses, not {loss_type}"):
            PreferenceLoss(loss_type, 0.1, 0.1)
    with pytest.raises(CheckpointError, match="loss.type: expected one of sigmoid, ipo, hinge, simpo"):
        PreferenceLoss("kto", 0.1)


@pytest.mark.parametrize("loss_type,beta,smoothing,gamma,expected", [
    ("sigmoid", float("inf"), 0.0, 0.5, "loss.beta=inf: expected a finite number > 0"),
    ("ipo", 0.0, 0.0, 0.5, "loss.beta=0.0: expected a finite number > 0"),
    ("hinge", float("nan"), 0.0, 0.5, "loss.beta=nan: expected a finite number > 0"),
    ("simpo", 2.0, 0.0, float("inf"), "loss.gamma=inf: expected a finite number >= 0"),
    ("sigmoid", 0.1, 0.5, 0.5, "loss.label_smoothing=0.5: expected a finite number >= 0 and < 0.5"),
])
def test_a_loss_whose_options_can_only_give_nan_is_refused_when_built(loss_type, beta, smoothing, gamma, expected):
    """The recipe's option checks refuse these first; the loss itself refuses them too (a script or the bench)."""
    with pytest.raises(CheckpointError) as refused:
        PreferenceLoss(loss_type, beta, smoothing, gamma)
    assert str(refused.value) == expected


def test_metrics_are_sums_whose_means_are_trls():
    chosen_rewards, rejected_rewards = torch.tensor([0.3, -0.1, 0.2]), torch.tensor([0.1, -0.1, 0.5])
    sums = pair_metrics(chosen_rewards, rejected_rewards, torch.tensor([-3.0, -4.0, -5.0]), torch.tensor([-6.0, -7.0, -8.0]))
    assert list(sums) == list(METRICS)
    assert float(sums["rewards/accuracies"]) == 1.0  # strictly greater, as TRL counts: a tie is not a win
    assert float(sums["rewards/margins"]) == pytest.approx(0.2 + 0.0 - 0.3)


# -- DPOTrainer's whole forward -----------------------------------------------------------------------------------

PAIRS = [
    {"prompt": "What is two plus two?", "chosen": " Two plus two is four.", "rejected": " I do not know."},
    {"prompt": "Name a color of the sky.", "chosen": " The sky is blue.", "rejected": " Green, maybe, or not at all."},
    {"prompt": "Where is Lima?", "chosen": " Lima is in Peru.", "rejected": " No."},
    {"prompt": "Say hello.", "chosen": " Hello!", "rejected": " I will not say that word today."},
]


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """The tiny checkpoint, and a copy whose weights moved: the reference and the policy."""
    from safetensors.torch import load_file, save_file

    policy = tmp_path_factory.mktemp("policy")
    shutil.copytree(TINY, policy, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(7)
    for file in sorted(policy.glob("*.safetensors")):
        tensors = load_file(file)
        save_file({k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}, file,
                  metadata={"format": "pt"})
    return TINY, policy


def trl_loss_and_metrics(reference_dir, policy_dir, loss_type: str, beta: float, tmp_path):
    """TRL's DPOTrainer on PAIRS: reference log-probs precomputed with the reference, loss and metrics of one batch
    of every pair with the policy's weights."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(TINY / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PAIRS), report_to=[],
                     precompute_ref_log_probs=True, max_length=64, use_cpu=True, beta=beta, loss_type=[loss_type],
                     dataloader_drop_last=False, seed=0, bf16=False)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer)
    columns = ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps")
    batch = trainer.data_collator([{k: trainer.train_dataset[i][k] for k in columns} for i in range(len(PAIRS))])  # in order
    trainer.model.load_state_dict(AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).state_dict())
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), metrics, batch


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("ipo", 0.5), ("hinge", 0.3)])
def test_dpo_step_equals_trls_dpo_trainer(perturbed, tmp_path, loss_type, beta):
    """The same pairs through TRL's DPOTrainer and through ours (PreferenceDataset, preference_collate, the native
    model's fused per-sequence log-probs, the reference pass): the token ids TRL trains on, the loss and every
    rewards/* and logps/* metric agree within 1e-5."""
    import json

    from waypoint.checkpointers import load_model
    from waypoint.text.tokenizer import load_tokenizer
    from waypoint.training.distributed import Distributed
    from waypoint.data.preference_dataset import PreferenceDataset
    from waypoint.training.preference_step import (IndexedPairs, pair_collate, preference_forward_backward,
                                                   reference_pass)

    reference_dir, policy_dir = perturbed
    their_loss, their_metrics, their_batch = trl_loss_and_metrics(reference_dir, policy_dir, loss_type, beta, tmp_path)

    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    tokenizer = load_tokenizer(TINY)
    pairs = IndexedPairs(PreferenceDataset(source, tokenizer, max_length=64))
    collate = pair_collate(tokenizer.pad_id)
    batch = collate([pairs[i] for i in range(len(pairs))])
    # the same sequences and completion positions as TRL's left-flushed batch
    for row in range(2 * len(PAIRS)):
        keep = their_batch["attention_mask"][row].bool()
        n = int(batch["mask"][row].sum())
        assert batch["tokens"][row, :n].tolist() == their_batch["input_ids"][row][keep].tolist()
        ours_completion = (batch["labels"][row, :n] != -100).tolist()
        assert ours_completion == their_batch["completion_mask"][row][keep].bool().tolist()

    dist = Distributed()
    reference = reference_pass(load_model(reference_dir), pairs, 2, collate, torch.device("cpu"), dist)
    # summed log-probabilities of about 150, where fp32's ulp is 1.5e-5: a few ulps apart, as the CPU's kernels sum
    torch.testing.assert_close(reference[:, 0], their_batch["ref_chosen_logps"].float(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(reference[:, 1], their_batch["ref_rejected_logps"].float(), atol=1e-5, rtol=1e-6)
    policy = load_model(policy_dir).train()
    loss, _, metrics, _ = preference_forward_backward(policy, [batch], reference, PreferenceLoss(loss_type, beta),
                                                      torch.device("cpu"), dist)
    assert loss == pytest.approx(their_loss, abs=1e-5)
    for key in METRICS:
        assert metrics[key] == pytest.approx(their_metrics[key], abs=1e-5, rel=1e-6), key
