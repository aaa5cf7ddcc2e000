"""vLLM as GRPO's sampler, in vLLM's own environment (vllm-cpu 0.32 here: `.venv-vllm`, made by
scripts/make_vllm_env.sh; run by tests/test_vllm_environment.py): after every sync the engine serves the policy's
weights (its greedy tokens are the native model's), requests sample alike alone or batched, and a tiny GRPO run
sampled by vLLM learns its task, logs TRL's sampling metrics, and, stopped and rerun, retraces the run never stopped bit for bit."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (vLLM's CPU default takes far more)
pytest.importorskip("vllm")

from recipes.grpo_finetune import main as grpo_finetune  # noqa: E402
from tests.conftest import ROOT, sigterm_at_step  # noqa: E402
from waypoint.checkpointers.file_formats import read_tensors  # noqa: E402
from waypoint.errors import CheckpointError  # noqa: E402
from waypoint.checkpointers.formats import checkpointer_for  # noqa: E402
from waypoint.checkpointers.load_model import model_from  # noqa: E402
from waypoint.models.generate import Sampling  # noqa: E402
from waypoint.models.sample_group import generate_group  # noqa: E402
from waypoint.sampling.grpo_engine import PolicyEngine  # noqa: E402
from waypoint.sampling.vllm_engine import VLLMEngine  # noqa: E402
from waypoint.sampling.vllm_options import VLLMOptions  # noqa: E402

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 30, 31, 32, 33, 34]]


def tied_llama(path: Path) -> Path:
    """The tiny Llama with its head tied to its embedding (as Gemma, Qwen's small models and Llama 3.2 tie them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / name, path / name)
    return path


def policy_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The policy's log-prob of each completion token after the prompt (temperature 1)."""
    tokens = torch.tensor([prompt + completion])
    labels = tokens.clone()
    labels[:, : len(prompt)] = -100
    with torch.no_grad():
        return model(tokens, labels=labels, per_token=True, temperature=1.0)[0][0, len(prompt) - 1:]


@pytest.fixture(scope="module", params=["untied", "tied"])
def served(request, tmp_path_factory):
    """(the policy, its engine in step with it): the input's model, then a changed one pushed (as after a step)."""
    path = ROOT / "assets/tiny_llama" if request.param == "untied" else tied_llama(tmp_path_factory.mktemp("tied"))
    checkpointer = checkpointer_for(path)
    model = model_from(checkpointer, checkpointer.load_checkpoint()["model"], "fp32")
    engine = PolicyEngine(VLLMEngine(path, torch.float32, VLLMOptions(), 128, seed=0, device=torch.device("cpu")),
                          checkpointer, [1, 5, 6, 7, 9, 11, 13, 15], checkpointer.model_type, VLLMOptions())
    assert engine.sync(model, 0, "at start")["sampling/weight_sync_logp_gap"] < 1e-4
    with torch.no_grad():  # a step's change, large enough to change every greedy token
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    yield model, engine, request.param
    del engine


def test_after_a_sync_the_engine_samples_greedily_what_the_policy_does(served):
    model, engine, kind = served
    before = engine.engine.sample(PROMPTS, [[0]] * 3, 8, Sampling(temperature=0), stop_ids=[])[0]
    metrics = engine.sync(model, 1, "before step 2")
    assert metrics["sampling/weight_sync_logp_gap"] < 1e-4 and engine.sync(model, 1, "again") == {}
    native = [generate_group(model, p, 1, 8, Sampling(temperature=0))[0] for p in PROMPTS]
    served_tokens, logps = engine.engine.sample(PROMPTS, [[0]] * 3, 8, Sampling(temperature=0), stop_ids=[])
    assert served_tokens == native != before, (kind, served_tokens, native, before)
    # a stop token ends a completion where the native sampler ends it (kept), whatever vLLM's own EOS is
    stop = native[0][2]
    assert engine.engine.sample(PROMPTS[:1], [[0]], 8, Sampling(temperature=0), stop_ids=[stop])[0][0] == \
        generate_group(model, PROMPTS[0], 1, 8, Sampling(temperature=0), stop_ids=[stop])[0] == \
        native[0][: native[0].index(stop) + 1]
    # a stop string ends it at the token whose text completes it, that token kept whole, as the native sampler does
    from waypoint.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(engine.checkpointer.checkpoint_dir)
    # a string of whole characters (vLLM holds a partial UTF-8 character back) ending within a later token
    row, stop_string = next((i, tokenizer.decode(c[:k])[-2:]) for i, c in enumerate(native) for k in range(2, 8)
                            if "\ufffd" not in tokenizer.decode(c[:k])[-2:]
                            and tokenizer.decode(c[:k])[-2:] not in tokenizer.decode(c[:k - 1]))
    ours = generate_group(model, PROMPTS[row], 1, 8, Sampling(temperature=0), stop_strings=[stop_string],
                          decode=tokenizer.decode)[0]
    theirs = engine.engine.sample([PROMPTS[row]], [[0]], 8, Sampling(temperature=0), stop_ids=[],
                                  stop_strings=[stop_string])[0][0]
    assert theirs == ours and len(ours) < 8, (theirs, ours, stop_string)
    # the engine's log-prob of each token it sampled is the policy's (processed: temperature 1 here)
    assert torch.allclose(policy_logps(model, PROMPTS[1], native[1]), torch.tensor(logps[1]), atol=1e-4)


def test_a_stale_engine_is_caught_by_the_probe(served):
    model, engine, _ = served
    engine.sync(model, 1, "before step 2")
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight.add_(0.5)  # a change never pushed
    try:
        with pytest.raises(CheckpointError, match=r"^generation.engine=vllm: the policy's weights did not reach vLLM after "
                                                  r"step 2 \(LLAMA\w*: its log-probs of a probe sequence differ"):
            engine.engine.check(engine.probe, engine._policy_logps(model), engine.family, "after step 2")
    finally:
        with torch.no_grad():
            model.layers[0].attn.q_proj.weight.sub_(0.5)


def test_each_request_samples_alike_alone_and_in_a_batch(served):
    model, engine, _ = served
    engine.sync(model, 1, "before step 2")
    batch, _ = engine.engine.sample(PROMPTS, [[11, 12], [13], [14, 15]], 8, Sampling(temperature=1.0), stop_ids=[])
    alone = [engine.engine.sample([p], [[s]], 8, Sampling(temperature=1.0), stop_ids=[])[0][0]
             for p, s in [(PROMPTS[0], 12), (PROMPTS[2], 14)]]
    assert [batch[1], batch[3]] == alone and batch[0] != batch[1]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


CONFIG = ["--config", str(ROOT / "configs/tiny_grpo.yaml")]
GRPO = ["+generation.engine=vllm", "progress=off", "save_every_epoch=false", "save_every_n_steps=5",
        "keep_last_n_checkpoints=null"]


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """The shipped tiny config with vLLM as its sampler, stopped by SIGTERM after 25 steps (a step_N every 5)."""
    whole = tmp_path_factory.mktemp("whole")
    with sigterm_at_step(25):
        assert grpo_finetune([*CONFIG, f"output_dir={whole}", *GRPO]) == 75
    return whole


def test_a_grpo_run_sampled_by_vllm_learns_and_logs_trls_metrics(learned):
    """Its first 25 steps raise the held-out reward several times over as the native sampler's do
    (tests/test_grpo_finetune.py); every step logs TRL's sampling metrics (the engine and the policy agree: fp32,
    synced every step)."""
    rows = records(learned)
    val = [r["val_reward"] for r in rows if "val_reward" in r]
    assert len(val) == 3 and val[-1] > 2.5 * val[0], val
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 25
    for r in steps:
        assert r["sampling/sampling_logp_difference/max"] < 1e-3, r
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, r
    gaps = [r["sampling/weight_sync_logp_gap"] for r in rows if "sampling/weight_sync_logp_gap" in r]
    assert len(gaps) == 25 and max(gaps) < 1e-4  # one sync a step (before it, or before the validation after it)


def test_stopped_then_rerun_with_vllm_is_bit_identical(learned, tmp_path):
    """Preempted after step 7 with step_5 its newest checkpoint, then rerun: a run sampled by vLLM retraces the run
    never stopped. The rerun's engine starts again from the input and is given the resumed policy before its first
    step, and step 10 (and a validation on the way) is byte for byte and record for record the uninterrupted run's.
    The stopped run is the uninterrupted one's directory as it stood then (its later steps and records dropped): a
    run of its own would start a second engine for steps the first already took; what a kill or a stop leaves (a
    commit cut short, records past the checkpoint) the native sampler's tests check (tests/test_grpo_finetune.py),
    and the engine takes no part in a commit."""
    from tests.test_grpo_finetune import without_timing

    stopped = shutil.copytree(learned, tmp_path / "stopped")
    for later in stopped.glob("step_*"):
        if int(later.name.removeprefix("step_")) > 5:
            shutil.rmtree(later)
    (stopped / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(learned) if r["step"] <= 7))
    with sigterm_at_step(10):
        assert grpo_finetune([*CONFIG, f"output_dir={stopped}", *GRPO]) == 75
    assert sorted(p.name for p in stopped.glob("step_*")) == ["step_10", "step_5"]
    for name in sorted(p.name for p in (learned / "step_10").glob("*.safetensors")):
        a, b = read_tensors(learned / "step_10" / name), read_tensors(stopped / "step_10" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # the records equal but for the syncs' own (a resumed run's fresh engine takes one sync more, logged at its step)
    unsynced = lambda rows: [{k: v for k, v in r.items() if not k.startswith("sampling/weight_sync")}  # noqa: E731
                             for r in without_timing(rows) if r["step"] <= 10]
    assert any("val_reward" in r for r in unsynced(records(stopped)))
    assert unsynced(records(stopped)) == unsynced(records(learned))


@pytest.mark.parametrize("push", ["adapter", "merged"])
def test_a_lora_policy_reaches_the_engine(push, tmp_path):
    """A LoRA run gives vLLM its PEFT adapter over the base the engine loaded (a new LoRARequest each sync), or, where
    vLLM cannot serve the adapter, the base with each adapter's update folded in; either way the probe checks it and
    the engine's greedy tokens are the LoRA model's."""
    from waypoint.models.lora import apply_lora
    from waypoint.sampling.adapter_push import AdapterPush

    path = ROOT / "assets/tiny_llama"
    checkpointer = checkpointer_for(path)
    model = model_from(checkpointer, checkpointer.load_checkpoint()["model"], "fp32")
    apply_lora(model, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # adapters that change every greedy token
    converter = checkpointer.hf_converter()
    assert AdapterPush.why_not(model, converter) is None
    adapters = AdapterPush(model, converter, tmp_path / "adapters") if push == "adapter" else None
    engine = PolicyEngine(VLLMEngine(path, torch.float32, VLLMOptions(), 128, seed=0, device=torch.device("cpu"),
                                     max_lora_rank=adapters and adapters.max_lora_rank),
                          checkpointer, [1, 5, 6, 7, 9, 11, 13, 15], checkpointer.model_type, VLLMOptions(), adapters)
    base = engine.engine.sample(PROMPTS, [[0]] * 3, 8, Sampling(temperature=0), stop_ids=[])[0]
    for step in (1, 2):  # a second sync: a new adapter, not the one vLLM cached under the first id
        assert engine.sync(model, step, f"before step {step + 1}")["sampling/weight_sync_logp_gap"] < 1e-4
        native = [generate_group(model, p, 1, 8, Sampling(temperature=0))[0] for p in PROMPTS]
        assert engine.engine.sample(PROMPTS, [[0]] * 3, 8, Sampling(temperature=0), stop_ids=[])[0] == native != base
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.5)
    assert (engine.engine.lora_request is not None) == (push == "adapter")


def test_a_grpo_lora_run_pushes_its_adapter_and_checks_every_sync(tmp_path, capsys):
    out = tmp_path / "lora"
    with sigterm_at_step(4):
        assert grpo_finetune(["--config", str(ROOT / "configs/tiny_grpo_lora.yaml"), f"output_dir={out}",
                              "+generation.engine=vllm", "progress=off", "validation=null",
                              "+vllm={vllm_push_adapters: true}"]) == 75  # on the CPU the default merges (slower LoRA kernels)
    assert "sampling: vLLM is given the adapter (PEFT's, rank 8) before every step" in capsys.readouterr().out
    steps = [r for r in records(out) if "loss" in r]
    assert len(steps) == 4 and all(r["sampling/weight_sync_logp_gap"] < 1e-4 for r in steps)
    assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for r in steps)


def test_what_vllm_refuses_on_this_backend_is_one_line(tmp_path):
    """vLLM's own refusal (sleep mode on its CPU build) reaches the user as one line naming the way out."""
    from tests.recipe_runs import run_recipe

    out = tmp_path / "out"
    done = run_recipe("grpo", ["--config", str(ROOT / "configs/tiny_grpo.yaml"), f"output_dir={out}",
                               "+generation.engine=vllm", "+vllm={vllm_enable_sleep_mode: true}", "progress=off"])
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and errors == [
        "error: generation.engine=vllm: vLLM cannot serve assets/tiny_llama here: Sleep mode is not "
        "supported on current platform.; set generation.engine=native"], done.stderr[-2000:]
    assert not list(out.glob("step_*"))
