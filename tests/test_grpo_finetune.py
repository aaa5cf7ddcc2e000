"""recipes/grpo_finetune.py end to end: it writes the input's format (full) or a PEFT adapter and merged/ (LoRA), logs
TRL's metric names, resumes bit-identically after a preemption or a SIGKILL during generation, between steps or during
a save, refuses a bad reward function in one line with nothing lost (one that never returns, answers NaN or calls
sys.exit too), saves the last whole step when preempted while a reward runs, and two processes under torchrun train as
one; the shipped tiny config learns its task on held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipes.grpo_finetune import main as grpo_finetune
from tests.conftest import ROOT, sigterm_at_step
from tests.recipe_runs import Finished, run_recipe
from tests.test_dpo_bad_input import error_lines
from waypoint.checkpointers.commit import verify
from waypoint.training.distributed import Distributed
from waypoint.training.grpo_loss import GRPOLossOptions
from waypoint.models.sample_group import group_seed
from waypoint.training.grpo_step import GRPOStep, Preempted, RolloutOptions, group_generator, step_seed

FAST = ["epochs=1", "max_steps_per_epoch=4", "validation.every_n_steps=2", "save_every_n_steps=2",
        "keep_last_n_checkpoints=null", "progress=off"]
TRL_METRICS = {"reward", "reward_std", "rewards/letter_share/mean", "rewards/letter_share/std", "completions/mean_length",
               "completions/min_length", "completions/max_length", "completions/clipped_ratio", "frac_reward_zero_std",
               "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}


def args(config: str, out: Path, *more: str) -> list[str]:
    return ["--config", str(ROOT / f"configs/{config}.yaml"), f"output_dir={out}", *FAST, *more]


def run(config: str, out: Path, *more: str, stop_at: int | None = None) -> int:
    with sigterm_at_step(stop_at):
        return grpo_finetune(args(config, out, *more))


def run_process(config: str, out: Path, *more: str, fault: list[str] | None = None, processes: int = 1,
                cwd: Path = ROOT) -> Finished:
    """The run in processes of its own (forked: ``tests/launch.py``): ``processes`` ranks, or one killed by ``fault``."""
    return run_recipe("grpo", args(config, out, *more), fault=fault, processes=processes, cwd=cwd,
                      env={"OMP_NUM_THREADS": "1"})


def final(out: Path) -> Path:
    return max((p for p in out.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))


def tensor_bytes(step: Path, pattern: str = "*.safetensors") -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step.glob(pattern))}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "resumed")} for r in rows]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    assert run("tiny_grpo", out) == 0
    return out


def test_full_run_writes_the_input_format_and_trl_metrics(full_run):
    source = ROOT / "assets/tiny_llama"
    last = final(full_run)
    assert last.name == "step_4" and verify(last).ok
    assert sorted(p.name for p in last.glob("*.safetensors")) == sorted(p.name for p in source.glob("*.safetensors"))
    logged = records(full_run)
    train = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert TRL_METRICS <= train[0].keys()
    assert all(r["completions/max_length"] <= 6 for r in train)  # generation.max_completion_length
    assert [r["step"] for r in logged if "val_reward" in r] == [2, 4]
    state = torch.load(last / "recipe_state.pt", weights_only=True)
    assert isinstance(state["sampling_rng"], torch.Tensor)  # the sampling generator travels with the step
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(last)


def test_signal_then_the_same_command_is_bit_identical(full_run, tmp_path, capsys):
    out = tmp_path / "out"
    assert run("tiny_grpo", out, stop_at=3) == 75
    capsys.readouterr()
    assert run("tiny_grpo", out) == 0
    assert "resuming from step_3" in capsys.readouterr().out
    assert tensor_bytes(final(out)) == tensor_bytes(final(full_run))
    assert without_timing(records(out)) == without_timing(records(full_run))  # the same completions and rewards


@pytest.mark.slow
@pytest.mark.parametrize("fault", [["kill-in-generation", "8", "-"],  # a micro-batch a call: steps 1-2 (4), held out (2), step 3's 2nd
                                   ["kill-group-at-step", "3", "-"],  # step 3 done, not saved
                                   ["kill-in-save", "4", "before-rename"]],  # the final step half committed
                         ids=["during-generation", "between-steps", "during-save"])
def test_sigkill_then_rerun_is_bit_identical(full_run, tmp_path, fault):
    out = tmp_path / "out"
    killed = run_process("tiny_grpo", out, fault=fault)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [p.name for p in out.glob("step_*")] == ["step_2"]  # the newest committed step
    assert run("tiny_grpo", out) == 0
    assert tensor_bytes(final(out)) == tensor_bytes(final(full_run))
    assert without_timing(records(out)) == without_timing(records(full_run))


def test_lora_with_beta_writes_a_peft_adapter_and_merged_model(tmp_path):
    """LoRA and beta > 0: the KL's reference is the base with the adapters off, so the first step's KL is 0 (the
    adapters start as zero) and later ones are not; the adapter loads in PEFT, merged/ in transformers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert run("tiny_grpo_lora", out, "loss.beta=0.04", "max_steps_per_epoch=3", "save_every_n_steps=null") == 0
    train = [r for r in records(out) if "loss" in r]
    assert train[0]["kl"] == 0.0 and train[-1]["kl"] > 0
    last = final(out)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in last.iterdir()}
    assert verify(last / "merged").ok
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ROOT / "assets/tiny_llama"), last)
    AutoModelForCausalLM.from_pretrained(last / "merged")


def test_full_run_with_beta_keeps_a_frozen_reference(tmp_path, capsys):
    out = tmp_path / "out"
    assert run("tiny_grpo", out, "loss.beta=0.04", "max_steps_per_epoch=2", "validation=null") == 0
    assert "a frozen copy of the input model" in capsys.readouterr().out
    train = [r for r in records(out) if "loss" in r]
    assert train[0]["kl"] == 0.0 and train[1]["kl"] > 0


@pytest.mark.parametrize("loss", ["grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"])
def test_every_loss_type_trains(loss, tmp_path):
    out = tmp_path / "out"
    assert run("tiny_grpo", out, f"loss.loss_type={loss}", "max_steps_per_epoch=2", "validation=null",
               "save_every_n_steps=null") == 0
    train = [r for r in records(out) if "loss" in r]
    assert len(train) == 2 and all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in train)


def test_gspo_with_iterations_and_batch_scaling(tmp_path):
    """Sequence-level ratios over num_iterations=2 optimizer steps per sample batch: the second step's ratio moves
    off 1, so the clip metrics are defined; the scheduler counts optimizer steps."""
    out = tmp_path / "out"
    assert run("tiny_grpo", out, "loss.loss_type=grpo", "loss.importance_sampling_level=sequence", "loss.num_iterations=2",
               "loss.scale_rewards=batch", "max_steps_per_epoch=2", "validation=null", "save_every_n_steps=null") == 0
    state = torch.load(final(out) / "recipe_state.pt", weights_only=True)
    assert state["lr_scheduler"]["last_epoch"] == 4


def test_a_reward_function_that_raises_stops_in_one_line_and_keeps_the_steps(tmp_path, monkeypatch, capsys):
    """A user's reward file beside where they run: it fails at step 3; the run stops with one line naming the
    function, and step_2 (saved before) is intact."""
    (tmp_path / "flaky_rewards_a.py").write_text(
        "calls = 0\n"
        "def flaky(prompts, completions, completion_ids, **kw):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 3:\n"
        "        raise KeyError('answer')\n"
        "    return [float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code = run("tiny_grpo", out, "reward_funcs=[flaky_rewards_a.flaky]", "validation=null")
    err = capsys.readouterr().err
    assert code != 0
    assert "reward function flaky raised KeyError: 'answer'" in err and "Traceback" not in err
    assert [p.name for p in out.glob("step_*")] == ["step_2"] and verify(out / "step_2").ok


def test_a_reward_function_given_a_column_the_data_lacks_is_one_line(tmp_path, capsys):
    """answer_match reads the answer column, which the tiny data has not: one line at the first scoring."""
    assert run("tiny_grpo", tmp_path / "out", "reward_funcs=[answer_match]", "validation=null") != 0
    err = capsys.readouterr().err
    assert "reward function answer_match raised" in err and "answer" in err and "Traceback" not in err, err


def test_a_preemption_while_a_reward_runs_saves_the_last_whole_step(tmp_path, monkeypatch, capsys):
    """SIGTERM while step 2's reward runs, which would take a minute more: the reward is cut short at once, step 2's
    samples are dropped (its seed drawn again on resume), step 1 is saved and the run exits with the preemption code."""
    (tmp_path / "slow_rewards_b.py").write_text(
        "import os, signal, time\n"
        "from waypoint.assets.tiny_grpo_rewards import letter_share as share\n"
        "calls = 0\n"
        "def letter_share(prompts, completions, completion_ids, **kw):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 2:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(60)\n"
        "        open('slept', 'w').close()\n"
        "    return share(prompts, completions, completion_ids, **kw)\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code = run("tiny_grpo", out, "reward_funcs=[slow_rewards_b.letter_share]", "validation=null",
               "max_steps_per_epoch=2", "save_every_n_steps=null")
    assert code == 75, capsys.readouterr().err[-2000:]
    assert "stopped by SIGTERM at step 1" in capsys.readouterr().out
    assert [p.name for p in out.glob("step_*")] == ["step_1"] and verify(out / "step_1").ok
    assert not (tmp_path / "slept").exists()
    state = torch.load(out / "step_1" / "recipe_state.pt", weights_only=True)
    one_draw = torch.Generator().manual_seed(1234)  # the config's seed, and step 1's draw only
    step_seed(one_draw)
    assert state["global_step"] == 1 and torch.equal(state["sampling_rng"], one_draw.get_state())


def test_a_preemption_while_an_engine_samples_drops_the_step_before_its_rewards():
    """The step's part (``GRPOStep.rollouts``), with an engine in the policy's place: it samples the step's prompts in
    one batch, one seed a completion (the native sampler's row seeds); a signal while it samples stops the step before
    any reward runs (the policy's own sampler checks before each token: tests/test_sample_group.py)."""
    signalled, sampled, scored = [], [], []

    class Engine:
        def sample(self, prompts, seeds, max_tokens, sampling, stop_ids, stop_strings):
            sampled.append((prompts, seeds))
            signalled.append("SIGTERM")
            return [[3, 4]] * sum(map(len, seeds)), [[-1.0, -1.0]] * sum(map(len, seeds))

    step = GRPOStep(RolloutOptions(num_generations=2), GRPOLossOptions(), [lambda **kw: scored.append(1)], None,
                    tokenizer=None, stop_ids=[], conversational=False, device=torch.device("cpu"), dist=Distributed(),
                    engine=Engine())
    items = [{"prompt_ids": [1, i], "index": i, "prompt": "p", "columns": {}} for i in range(4)]
    with pytest.raises(Preempted):
        step.rollouts(None, [items[:2], items[2:]], seed=0, stop=lambda: bool(signalled))
    assert not scored and len(sampled) == 1
    prompts, seeds = sampled[0]
    assert prompts == [item["prompt_ids"] for item in items]
    bases = [group_seed(group_generator(0, i)) for i in range(4)]
    assert seeds == [[b, b + 1] for b in bases]  # row r of prompt i: the native sampler's row_generator(base, r)


@pytest.mark.parametrize("body, more, says", [
    ("time.sleep(60)", ["reward_timeout=0.5"], "reward function bad took longer than reward_timeout=0.5 s on "),
    ("return [float('nan')] * len(completions)", [], "reward function bad returned nan for completion 0 (prompt '"),
    ("sys.exit(0)", [], "reward function bad called sys.exit(0); return its values"),
], ids=["never-returns", "nan", "sys-exit"])
def test_a_reward_that_cannot_be_trained_on_stops_in_one_line_before_any_update(body, more, says, tmp_path,
                                                                                 monkeypatch, capsys, request):
    """Each used to hang forever, train nothing and report done, or end the run with exit status 0 and no line."""
    module = f"bad_rewards_{request.node.callspec.id.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(f"import sys, time\ndef bad(prompts, completions, **kw):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code = run("tiny_grpo", out, f"reward_funcs=[{module}.bad]", "validation=null", "max_steps_per_epoch=1", *more)
    printed = capsys.readouterr()
    err = error_lines(printed.err)
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: {says}"), err
    assert "Traceback" not in printed.err and "done:" not in printed.out
    assert not list(out.glob("step_*"))


@pytest.mark.slow
def test_two_processes_train_as_one(full_run, tmp_path):
    """torchrun, 2 CPU processes of 2 prompts per micro-batch: each prompt's completions are the same as in one
    process of 4 (its generator is its dataset index's), so the rewards and metrics agree and the weights agree up to
    the order of the sums."""
    out = tmp_path / "two"
    result = run_process("tiny_grpo", out, "batch_size=2", processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = records(full_run), records(out)
    assert len(one) == len(two)
    for a, b in zip(one, two):
        for key in a.keys() - {"tokens_per_s"}:
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5, nan_ok=True), (key, a, b)
    from safetensors.torch import load_file
    mine = {k: v for f in sorted(final(out).glob("model-*.safetensors")) for k, v in load_file(f).items()}
    theirs = {k: v for f in sorted(final(full_run).glob("model-*.safetensors")) for k, v in load_file(f).items()}
    # Adam at lr 1e-2 moves a weight whose gradient is near 0 by up to lr: the sums' order shows there, 1.3e-4 at most
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in theirs) < 1e-3


@pytest.mark.slow
def test_the_tiny_config_raises_the_held_out_reward(tmp_path):
    """The shipped config as it is, its first 25 of 80 steps (stopped there as a preemption stops it, so its
    schedule is the shipped run's; after step 25's record, since a preemption during step 24's validation would cut
    that validation short): the reward on the held-out prompts (never trained on; the same draws at each
    evaluation) rises several times over. (On the machine the suite was written on it goes 0.179, 0.513, 0.75: each
    prompt answered with its own letter, past the 0.5 that one letter for every prompt earns.)"""
    out = tmp_path / "out"
    with sigterm_at_step(25):
        assert grpo_finetune(["--config", str(ROOT / "configs/tiny_grpo.yaml"), f"output_dir={out}", "progress=off"]) == 75
    val = [r["val_reward"] for r in records(out) if "val_reward" in r]
    assert len(val) == 3 and val[-1] > 2.5 * val[0], val


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_hybrid_family_samples_and_trains_conversational_prompts_with_lora(family, tmp_path, monkeypatch):
    """Qwen3.5 (Gated DeltaNet's recurrent state in the sampler's cache, the MoE's routed experts): conversational
    prompts rendered with a chat template, completions handed to the reward function as TRL hands them (a list with
    one assistant message), LoRA on DeltaNet's projections; the adapter and merged/ are written."""
    import shutil

    from tests.conftest import tiny_family_config, write_family_checkpoint

    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config(family, vocab_size=512, max_position_embeddings=256))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / name, base / name)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Write the letter {c}."}], "letter": c})
                            + "\n" for c in "abcdefgh"))
    (tmp_path / "chat_rewards_b.py").write_text(
        "def letters(prompts, completions, completion_ids, letter, **kw):\n"
        "    assert all(isinstance(p, list) and p[-1]['role'] == 'user' for p in prompts)\n"
        "    assert all(isinstance(c, list) and len(c) == 1 and c[0]['role'] == 'assistant' for c in completions)\n"
        "    return [c[0]['content'].count(x) / 6 for c, x in zip(completions, letter)]\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    targets = "[q_proj,v_proj,in_proj_qkv,in_proj_z,out_proj]"
    assert grpo_finetune(["--config", str(ROOT / "configs/tiny_grpo_lora.yaml"), f"output_dir={out}",
                          f"checkpointer.checkpoint_dir={base}", f"dataset.source={data}", "dataset.template=chatml",
                          "reward_funcs=[chat_rewards_b.letters]", "validation=null", "epochs=1", "batch_size=2",
                          f"lora.targets={targets}", "progress=off"]) == 0
    last = final(out)
    assert last.name == "step_2" and verify(last / "merged").ok
    assert (last / "merged" / "chat_template.jinja").is_file()  # prompted as it trained
    assert all(r["completions/mean_length"] > 0 for r in records(out) if "loss" in r)
