"""recipes/dpo_finetune.py end to end: it learns the preference on held-out pairs, writes the input's format (full)
or a PEFT adapter and merged/ (LoRA, QLoRA), computes the reference log-probs once and keeps them with the run, and
resumes bit-identically after a preemption, a kill during the reference pass or before the first checkpoint; two
processes under torchrun train as one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipes.dpo_finetune import main as dpo_finetune
from tests.conftest import ROOT, sigterm_at_step
from tests.recipe_runs import Finished, run_recipe
from waypoint.checkpointers.commit import verify
from waypoint.run.reference_logps import REFERENCE_DIR, REFERENCE_FILE, ReferenceLogps

PAIRS = 48  # a subset of assets/tiny_dpo.jsonl: 43 training pairs (5 held out), 5 steps of 8
FAST = ["epochs=1", "validation={fraction: 0.1, every_n_steps: 3}", "save_every_n_steps=2", "keep_last_n_checkpoints=null"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    path.write_text("".join((ROOT / "assets/tiny_dpo.jsonl").read_text().splitlines(keepends=True)[:PAIRS]))
    return path


def args(config: str, out: Path, data: Path, *more: str) -> list[str]:
    return ["--config", str(ROOT / f"configs/{config}.yaml"), f"output_dir={out}", f"dataset.source={data}", *FAST, *more]


def run(config: str, out: Path, data: Path, *more: str, stop_at: int | None = None) -> int:
    with sigterm_at_step(stop_at):
        return dpo_finetune(args(config, out, data, *more))


def run_process(config: str, out: Path, data: Path, *more: str, fault: list[str] | None = None, processes: int = 1,
                recipe: str = "dpo") -> Finished:
    """The run in processes of its own (forked: ``tests/launch.py``): ``processes`` ranks, or one killed by ``fault``."""
    return run_recipe(recipe, args(config, out, data, *more), fault=fault, processes=processes, cwd=ROOT,
                      env={"OMP_NUM_THREADS": "1"})


def final(out: Path) -> Path:
    return max((p for p in out.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))


def tensor_bytes(step: Path, pattern: str = "*.safetensors") -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step.glob(pattern))}


def saved_reference(step: Path) -> dict | None:
    return torch.load(step / "recipe_state.pt", weights_only=True).get("reference_logps")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, pairs):
    out = tmp_path_factory.mktemp("full")
    assert run("tiny_dpo", out, pairs) == 0
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, pairs):
    out = tmp_path_factory.mktemp("lora")
    assert run("tiny_dpo_lora", out, pairs) == 0
    return out


@pytest.mark.slow
def test_tiny_dpo_learns_the_preference_on_held_out_pairs(tmp_path):
    """The shipped config (one epoch of it): the held-out pairs, never trained on, end with the chosen answer's reward
    above the rejected one's for nearly all of them and a clear margin, from a start where policy = reference
    (every reward 0)."""
    out = tmp_path / "out"
    assert dpo_finetune(["--config", str(ROOT / "configs/tiny_dpo.yaml"), f"output_dir={out}", "epochs=1",
                         "validation={fraction: 0.1, every_n_steps: 9}"]) == 0
    logged = records(out)
    train = [r for r in logged if "loss" in r]
    assert {"loss", "lr", "tokens_per_s", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected"} <= train[0].keys()
    assert abs(train[0]["rewards/margins"]) < 1e-3  # the first step's policy is the reference
    val = [r for r in logged if "val_loss" in r]
    assert [r["step"] for r in val] == [9, 18]
    # (its lr, 1e-4, suits its use after SFT, which a larger one undoes; from the random base the margin grows slower)
    assert val[-1]["val_rewards/accuracies"] >= 0.9 and val[-1]["val_rewards/margins"] > 0.5, val
    assert val[-1]["val_loss"] < 0.5 < 0.6931  # below log 2, the loss where policy = reference


def test_full_run_writes_the_input_format_and_keeps_the_reference_with_every_step(full_run):
    source = ROOT / "assets/tiny_llama"
    last = final(full_run)
    assert last.name == "step_5" and verify(last).ok
    # the input's files, and no other tensor file (a loader of every *.safetensors would take it for weights)
    assert sorted(p.name for p in last.glob("*.safetensors")) == sorted(p.name for p in source.glob("*.safetensors"))
    index = lambda d: json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731
    assert index(last) == index(source)
    reference = ReferenceLogps.read(full_run / REFERENCE_DIR / REFERENCE_FILE)
    assert verify(full_run / REFERENCE_DIR).ok and reference.train.shape == (43, 2) and reference.validation.shape == (5, 2)
    for step in ("step_2", "step_4", "step_5"):  # each step's copy, in its recipe state (hashed into its manifest)
        saved = saved_reference(full_run / step)
        assert saved["fingerprint"] == reference.fingerprint
        assert torch.equal(saved["train"], reference.train) and torch.equal(saved["validation"], reference.validation)
    assert (reference.train < 0).all()
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(last)  # transformers reads it


def test_signal_then_the_same_command_is_bit_identical(full_run, pairs, tmp_path, capsys):
    out = tmp_path / "out"
    assert run("tiny_dpo", out, pairs, stop_at=3) == 75  # preempted: saves step_3, exits 75
    capsys.readouterr()
    assert run("tiny_dpo", out, pairs) == 0
    assert "resuming from step_3" in capsys.readouterr().out
    assert tensor_bytes(final(out)) == tensor_bytes(final(full_run))
    mine, theirs = records(out), records(full_run)
    assert [{k: v for k, v in r.items() if k not in ("tokens_per_s", "resumed")} for r in mine] == \
        [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in theirs]


@pytest.mark.slow
def test_kill_during_the_reference_pass_then_rerun_is_bit_identical(full_run, pairs, tmp_path):
    out = tmp_path / "out"
    killed = run_process("tiny_dpo", out, pairs, fault=["kill-in-reference", "16", "-"])
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / REFERENCE_DIR).exists() and not list(out.glob("step_*"))
    assert run("tiny_dpo", out, pairs) == 0
    assert not list(out.glob(".reference.tmp-*"))  # the killed pass's staging is gone
    assert tensor_bytes(final(out)) == tensor_bytes(final(full_run))


@pytest.mark.slow
def test_a_rerun_before_the_first_checkpoint_reuses_the_reference_pass(full_run, pairs, tmp_path, capsys):
    out = tmp_path / "out"
    killed = run_process("tiny_dpo", out, pairs, fault=["kill-group-at-step", "1", "-"])
    assert killed.returncode == -9 and verify(out / REFERENCE_DIR).ok and not list(out.glob("step_*"))
    capsys.readouterr()
    assert run("tiny_dpo", out, pairs) == 0
    assert "(computed by an earlier attempt from the same inputs)" in capsys.readouterr().out
    assert tensor_bytes(final(out)) == tensor_bytes(final(full_run))


def test_lora_writes_a_peft_adapter_and_merged_model_and_its_reference_is_the_base(lora_run, full_run):
    """The adapters switched off, the LoRA run's reference pass is the input model's: the same table as the full
    run's. Its adapter loads in PEFT; merged/ is the input's format."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (ReferenceLogps.read(lora_run / REFERENCE_DIR / REFERENCE_FILE).train ==
            ReferenceLogps.read(full_run / REFERENCE_DIR / REFERENCE_FILE).train).all()
    last = final(lora_run)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in last.iterdir()}
    assert saved_reference(last) is not None
    assert verify(last / "merged").ok
    base = AutoModelForCausalLM.from_pretrained(ROOT / "assets/tiny_llama")
    PeftModel.from_pretrained(base, last)
    AutoModelForCausalLM.from_pretrained(last / "merged")
    val = [r for r in records(lora_run) if "val_loss" in r]
    assert val[-1]["val_rewards/margins"] > 0


def test_the_output_is_prompted_with_the_template_the_run_trained_with(full_run, lora_run, pairs):
    """tiny_dpo renders its pairs with the built-in chatml over a checkpoint that has no template: each model it
    writes (the full run's step, the LoRA run's merged/) holds it as chat_template.jinja, as the SFT recipes' do, and
    transformers renders a prompt from it into the very ids the run trained on (the pair's prompt, as the dataset
    tokenized it). (An adapter directory carries no template, in the SFT LoRA recipe either.)"""
    from transformers import AutoTokenizer

    from waypoint.text.chat_template import BUILTIN_TEMPLATES
    from waypoint.text.tokenizer import load_tokenizer
    from waypoint.data.preference_dataset import PreferenceDataset

    chatml = BUILTIN_TEMPLATES["chatml"]
    trained = PreferenceDataset(pairs, load_tokenizer(ROOT / "assets/tiny_llama"), max_length=256, template="chatml")
    assert trained.prompt_format.text == chatml
    record = json.loads(pairs.read_text().splitlines()[0])
    for out in (final(full_run), final(lora_run) / "merged"):
        assert (out / "chat_template.jinja").read_text() == chatml, out
        tokenizer = AutoTokenizer.from_pretrained(out)
        ids = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        assert list(ids) == trained[0]["prompt"], out


@pytest.mark.slow
def test_lora_signal_then_rerun_is_bit_identical(lora_run, pairs, tmp_path):
    out = tmp_path / "out"
    assert run("tiny_dpo_lora", out, pairs, stop_at=3) == 75
    assert run("tiny_dpo_lora", out, pairs) == 0
    assert tensor_bytes(final(out), "adapter_model.safetensors") == tensor_bytes(final(lora_run), "adapter_model.safetensors")
    assert tensor_bytes(final(out) / "merged") == tensor_bytes(final(lora_run) / "merged")


@pytest.mark.slow
def test_qlora_trains_over_the_4bit_base_and_merges_from_full_precision(pairs, tmp_path):
    out = tmp_path / "out"
    assert run("tiny_dpo_qlora", out, pairs, "max_steps_per_epoch=2", "validation=null") == 0
    last = final(out)
    assert verify(last / "merged").ok and (last / "adapter_model.safetensors").is_file()
    assert records(out)[-1]["rewards/margins"] != 0


@pytest.mark.parametrize("loss", ["ipo", "hinge", "simpo", "sigmoid_smoothed"])
def test_every_loss_type_trains(loss, pairs, tmp_path):
    """Each loss runs end to end; SimPO, reference-free, makes no reference pass."""
    out = tmp_path / "out"
    more = ["loss.type=sigmoid", "loss.label_smoothing=0.1"] if loss == "sigmoid_smoothed" else [f"loss.type={loss}"]
    assert run("tiny_dpo", out, pairs, "max_steps_per_epoch=2", "validation=null", *more) == 0
    assert (out / REFERENCE_DIR).exists() == (loss != "simpo")
    assert (saved_reference(final(out)) is not None) == (loss != "simpo")
    assert all(r["loss"] == r["loss"] for r in records(out))


@pytest.mark.slow
def test_two_processes_train_as_one(full_run, pairs, tmp_path):
    """torchrun, 2 CPU processes of 4 pairs each: the same losses and metrics as one process of 8, the same weights
    up to the order of the sums."""
    out = tmp_path / "two"
    result = run_process("tiny_dpo", out, pairs, "batch_size=4", processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = records(full_run), records(out)
    assert len(one) == len(two)
    for a, b in zip(one, two):
        for key in a.keys() - {"tokens_per_s"}:
            # a few ulps of a sequence's summed log-probabilities (about 150 here: one ulp is 1.5e-5)
            assert b[key] == pytest.approx(a[key], abs=2e-5, rel=1e-6), (key, a, b)
    from safetensors.torch import load_file
    mine = {k: v for f in sorted(final(out).glob("model-*.safetensors")) for k, v in load_file(f).items()}
    theirs = {k: v for f in sorted(final(full_run).glob("model-*.safetensors")) for k, v in load_file(f).items()}
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in theirs) < 1e-4
    assert (ReferenceLogps.read(out / REFERENCE_DIR / REFERENCE_FILE).train -
            ReferenceLogps.read(full_run / REFERENCE_DIR / REFERENCE_FILE).train).abs().max() < 1e-4


@pytest.mark.slow
def test_lora_on_two_processes_trains_as_one(lora_run, pairs, tmp_path):
    """LoRA under torchrun: the base sharded (FSDP2), the reference pass with the adapters off split over the ranks,
    the adapters gathered whole into the same PEFT files as one process writes."""
    from safetensors.torch import load_file

    out = tmp_path / "two"
    result = run_process("tiny_dpo_lora", out, pairs, "batch_size=4", processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    for a, b in zip(records(lora_run), records(out), strict=True):
        for key in a.keys() - {"tokens_per_s"}:
            assert b[key] == pytest.approx(a[key], abs=5e-5, rel=1e-6), (key, a, b)
    mine, theirs = (load_file(final(o) / "adapter_model.safetensors") for o in (out, lora_run))
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in theirs) < 1e-5


def test_a_mixture_of_experts_model_adds_its_balance_loss(pairs, tmp_path):
    """Mixtral: the load-balancing loss over the chosen and rejected rows' own tokens joins the preference loss (as
    in SFT), logged as aux_loss."""
    from tests.test_family_training import base_checkpoint

    base = base_checkpoint(tmp_path / "base", "mixtral")
    out = tmp_path / "out"
    assert run("tiny_dpo", out, pairs, f"checkpointer.checkpoint_dir={base}", "max_steps_per_epoch=2",
               "validation=null") == 0
    steps = [r for r in records(out) if "loss" in r]
    assert len(steps) == 2 and all(0 < r["aux_loss"] < 10 for r in steps), steps
