"""LoRA: PEFT is the oracle for our adapter files, our merge and adapters PEFT wrote; the recipe trains,
resumes bit-exactly and leaves a merged model with the input's files."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from waypoint.checkpointers import CheckpointError, HFCheckpointer, build_model, load_into
from waypoint.checkpointers.commit import verify
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.checkpointers.peft_adapter import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter,
                                                 vllm_problems, warn_vllm)
from waypoint.models.lora import apply_lora, load_adapter_state, merged_state
from tests.conftest import ROOT, save_adapter, tiny_family_config, write_family_checkpoint
from tests.recipe_runs import run_recipe, run_script

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3", "output"]
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
TOL = 1e-5


def native_model(base_dir, targets=None, rank=4, alpha=8.0):
    """(checkpointer, our model loaded from base_dir with LoRA on ``targets``, eval mode)."""
    checkpointer = HFCheckpointer(base_dir, output_dir=base_dir.parent / "out")
    state = checkpointer.load_checkpoint()["model"]
    with torch.device("meta"):
        model = build_model(base_dir)
    load_into(model, state)
    if targets:
        apply_lora(model, targets, rank, alpha, 0.0)
    return checkpointer, model.eval()


def randomise_lora_b(params, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in params:
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def hf_weights(directory):
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(read_tensors(f))
    return tensors


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


ATTENTION = ["q_proj", "k_proj", "v_proj", "output_proj", "output"]


@pytest.mark.parametrize("family,targets", [("llama", ALL_TARGETS), ("mistral", ALL_TARGETS), ("qwen2", ALL_TARGETS),
                                            ("qwen3", ALL_TARGETS), ("gemma2", ALL_TARGETS[:-1]), ("mixtral", ATTENTION)])
def test_adapter_and_merge_match_peft(tmp_path, family, targets, tokens):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    config = tiny_family_config(family, **({"tie_word_embeddings": False} if family == "gemma2" else {}))
    hf_model = write_family_checkpoint(base, config)  # 4 heads, 2 kv heads: grouped-query
    checkpointer, model = native_model(base, targets)
    randomise_lora_b(model.named_parameters())
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())

    if "output" in targets:
        with pytest.warns(UserWarning, match="lm_head are not supported"):  # vLLM serves no LoRA on the head
            adapter_dir = save_adapter(tmp_path / "adapter", model, checkpointer.converter, str(base))
    else:
        adapter_dir = save_adapter(tmp_path / "adapter", model, checkpointer.converter, str(base))
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["r"] == 4
    expected = [HF_TARGETS[ALL_TARGETS.index(t)] for t in targets]
    assert sorted(config["target_modules"]) == sorted(expected) and config["base_model_name_or_path"] == str(base)
    assert verify(adapter_dir).ok

    peft_model = PeftModel.from_pretrained(hf_model, adapter_dir).eval()
    with torch.no_grad():
        ours, theirs = model(tokens), peft_model(tokens).logits
    diff = max_diff(ours, theirs)
    print(f"\n{family}: our LoRA model vs PeftModel.from_pretrained(our adapter): max |logits diff| = {diff:.3g}")
    assert diff <= TOL

    # Our merged checkpoint equals PEFT's merge_and_unload of the same adapter, in the input's files.
    merged_dir = checkpointer.save_to({"model": merged_state(model)}, tmp_path / "merged")
    peft_merged = {k: v for k, v in peft_model.merge_and_unload().state_dict().items()}
    mine = hf_weights(merged_dir)
    # transformers holds MoE experts packed in memory (gate_up_proj) where the files have per-expert keys: the
    # adapted (attention) weights are compared by name, the files against the input below
    common = mine.keys() & peft_merged.keys()
    weight_diff = max(max_diff(mine[k], peft_merged[k]) for k in common)
    print(f"{family}: our merged weights vs PEFT merge_and_unload: max |diff| = {weight_diff:.3g}")
    assert (common == mine.keys() or family == "mixtral") and any("q_proj" in k for k in common) and weight_diff <= TOL
    assert sorted(p.name for p in merged_dir.glob("*.safetensors")) == sorted(p.name for p in base.glob("*.safetensors"))
    index = "model.safetensors.index.json"
    assert json.loads((merged_dir / index).read_text())["weight_map"] == json.loads((base / index).read_text())["weight_map"]
    reloaded = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        diff = max_diff(reloaded(tokens).logits, ours)
    print(f"{family}: transformers on our merged checkpoint vs our LoRA model: max |logits diff| = {diff:.3g}")
    assert diff <= TOL


def test_adapter_written_by_peft_loads_into_our_model(tmp_path, tokens):
    from peft import LoraConfig, get_peft_model

    base = tmp_path / "base"
    hf_model = write_family_checkpoint(base, tiny_family_config("llama"))
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=HF_TARGETS[:-1], lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_model = get_peft_model(hf_model, lora).eval()
    randomise_lora_b(peft_model.named_parameters(), seed=3)
    peft_model.save_pretrained(tmp_path / "peft_adapter")

    checkpointer, model = native_model(base)
    adapter, config = load_adapter(tmp_path / "peft_adapter", checkpointer.converter)
    assert sorted({k.rsplit('.lora_', 1)[0].rsplit('.', 1)[-1] for k in adapter}) == sorted(ALL_TARGETS[:-1])
    apply_lora(model, config["target_modules"], config["r"], config["lora_alpha"], config["lora_dropout"])  # HF names
    assert sorted(model.lora_config["targets"]) == sorted(ALL_TARGETS[:-1])
    load_adapter_state(model, adapter)
    with torch.no_grad():
        diff = max_diff(model.eval()(tokens), peft_model(tokens).logits)
    print(f"\nPEFT-written adapter in our model vs PEFT: max |logits diff| = {diff:.3g}")
    assert diff <= TOL
    # and back: what we write again equals what PEFT wrote, bitwise (the RoPE permutation round-trips)
    save_adapter(tmp_path / "again", model, checkpointer.converter, str(base))
    theirs, ours = read_tensors(tmp_path / "peft_adapter" / ADAPTER_WEIGHTS), read_tensors(tmp_path / "again" / ADAPTER_WEIGHTS)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)

    # scripts/merge_lora.py on PEFT's adapter: PEFT's merge_and_unload, in the base's files
    from scripts.merge_lora import merge

    merged_dir = merge(base, tmp_path / "peft_adapter", tmp_path / "merged")
    peft_merged = peft_model.merge_and_unload().state_dict()
    mine = hf_weights(merged_dir)
    weight_diff = max(max_diff(mine[k], peft_merged[k]) for k in mine)
    print(f"merge_lora.py on a PEFT-written adapter vs PEFT merge_and_unload: max |diff| = {weight_diff:.3g}")
    assert weight_diff <= TOL and sorted(p.name for p in merged_dir.iterdir()) == sorted(
        [p.name for p in base.iterdir()] + ["MANIFEST.json"])


def test_fused_targets_are_refused_in_one_line(tmp_path):
    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config("phi3"))
    checkpointer, model = native_model(base, ["q_proj"])
    with pytest.raises(CheckpointError, match="one-to-one") as error:
        save_adapter(tmp_path / "adapter", model, checkpointer.converter, str(base))
    assert "\n" not in str(error.value) and not (tmp_path / "adapter").exists()
    result = run_lora(tmp_path / "run", f"checkpointer.checkpoint_dir={base}", *BASE[1:2])  # the recipe, before training
    assert result.returncode == 1 and "q_proj cannot be adapted in phi3 models" in result.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_vllm_readiness_warns(tmp_path):
    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config("llama"))
    checkpointer, model = native_model(base, ["q_proj", "v_proj"], rank=64, alpha=128)
    with pytest.warns(UserWarning, match="rank r=64 exceeds max_lora_rank=16"):
        config = json.loads((save_adapter(tmp_path / "a", model, checkpointer.converter, "x", max_lora_rank=16)
                             / ADAPTER_CONFIG).read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rank 64 is fine where the server allows 64
        assert warn_vllm(config, max_lora_rank=64) == []
    with pytest.warns(UserWarning, match="bias='all'"):
        warn_vllm({**config, "bias": "all"}, max_lora_rank=64)
    problems = vllm_problems({**config, "modules_to_save": ["lm_head"], "target_modules": ["q_proj", "embed_tokens"]}, 64)
    assert len(problems) == 2 and "modules_to_save" in problems[0] and "embed_tokens" in problems[1]


# -- the recipe --------------------------------------------------------------------------------------------

STEPS_PER_EPOCH, EPOCHS = 8, 2
FINAL = f"step_{STEPS_PER_EPOCH * EPOCHS}"
BASE = [f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}",
        f"epochs={EPOCHS}", f"max_steps_per_epoch={STEPS_PER_EPOCH}", "model.attn_dropout=0.1", "lora.dropout=0.1",
        "lora.targets=[q_proj,k_proj,v_proj,w2]", "keep_last_n_checkpoints=null", "save_every_n_steps=4"]


def run_lora(out, *overrides, signal_at=None):
    """The LoRA recipe on the tiny config, in this process (``tests/recipe_runs.py``)."""
    fault = ["signal-at-step", str(signal_at[0]), signal_at[1]] if signal_at else None
    return run_recipe("lora", ["--config", str(ROOT / "configs/tiny_lora.yaml"), f"output_dir={out}", *overrides], fault=fault)


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tiny_lora_recipe_loss_falls(tmp_path):
    out = tmp_path / "run"
    result = run_lora(out, f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
                      f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "epochs=2")
    assert result.returncode == 0, result.stderr[-3000:]
    values = losses(out)
    first, last = values[0], sum(values[-10:]) / 10  # step 1 is the base model's loss (lora_B starts at zero)
    assert last < 0.9 * first, f"loss did not fall clearly: {first:.3f} -> {last:.3f}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_uninterrupted")
    result = run_lora(out, *BASE)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_stop_and_resume_is_bit_exact(tmp_path, reference):
    out = tmp_path / "run"
    stopped = run_lora(out, *BASE, signal_at=(6, "SIGTERM"))
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert sorted(p.name for p in out.glob("step_*")) == ["step_4", "step_6"]
    assert not (out / "step_6" / "merged").exists()  # save_merged: final
    assert sorted(p.name for p in (out / "step_6").iterdir()) == ["MANIFEST.json", ADAPTER_CONFIG, ADAPTER_WEIGHTS,
                                                                  "chat_template.jinja", "recipe_state.pt", "tokenizer.json",
                                                                  "tokenizer_config.json"]
    resumed = run_lora(out, *BASE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step_6 (epoch 0, sample 48/64)" in resumed.stdout
    assert losses(out) == losses(reference), "per-step losses differ from the uninterrupted run"
    for name in (ADAPTER_WEIGHTS, "merged/model-00001-of-00003.safetensors", "merged/model-00003-of-00003.safetensors"):
        mine, theirs = read_tensors(out / FINAL / name), read_tensors(reference / FINAL / name)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name
    assert not list(out.glob(".step_*"))


@pytest.mark.slow
def test_recipe_output_is_peft_and_transformers_ready(reference, tokens):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source, final = ROOT / "assets/tiny_llama", reference / FINAL
    assert verify(final).ok and verify(final / "merged").ok
    merged = final / "merged"
    # the input's files, and the instruction prompt it trained on as its chat template (the input has none)
    assert sorted(set(os.listdir(merged)) - {"MANIFEST.json"}) == sorted(os.listdir(source) + ["chat_template.jinja"])
    index = "model.safetensors.index.json"
    assert json.loads((merged / index).read_text())["weight_map"] == json.loads((source / index).read_text())["weight_map"]
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), final).eval()(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged).eval()(tokens).logits
        base_logits = AutoModelForCausalLM.from_pretrained(source).eval()(tokens).logits
    diff = max_diff(peft_logits, merged_logits)
    print(f"\nrecipe: PEFT on step dir vs transformers on step_N/merged: max |logits diff| = {diff:.3g}")
    assert diff <= TOL and max_diff(base_logits, merged_logits) > 1e-3  # trained, and the training is in both

    # scripts/merge_lora.py gives the recipe's merged model, bitwise, in the same files
    out = reference / "offline_merge"
    result = run_script("merge_lora", [str(source), str(final), str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    # the same files, the prompt template too: the adapter directory carries it
    assert sorted(os.listdir(out)) == sorted(os.listdir(merged))
    assert (out / "chat_template.jinja").read_bytes() == (merged / "chat_template.jinja").read_bytes()
    mine, theirs = hf_weights(out), hf_weights(merged)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_the_adapter_directory_carries_the_tokenizer_and_the_chat_template_the_run_trained_with(tmp_path):
    """Conversations rendered with the built-in chatml (the tiny base has no template): the step's adapter directory
    holds the tokenizer and that template, as its merged/ does, so transformers' AutoTokenizer on the adapter directory
    (what PEFT and vLLM users load beside the adapter) prompts as the run trained (it held no tokenizer: the base's
    template, here none); scripts/merge_lora.py passes the adapter's template on to what it merges."""
    from transformers import AutoTokenizer

    from waypoint.text.chat_template import BUILTIN_TEMPLATES

    out = tmp_path / "run"
    result = run_lora(out, BASE[0], f"dataset.source={ROOT / 'assets/tiny_chat.jsonl'}", "dataset.template=chatml",
                      "dataset._target_=waypoint.data.chat_dataset.ChatDataset", "dataset.max_seq_len=320",
                      "epochs=1", "max_steps_per_epoch=1", "lora.targets=[q_proj,v_proj]")
    assert result.returncode == 0, result.stderr[-3000:]
    step = out / "step_1"
    assert verify(step).ok
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(step))
    assert not (step / "config.json").exists() and not (step / "generation_config.json").exists()  # an adapter, no model
    adapter, merged = AutoTokenizer.from_pretrained(step), AutoTokenizer.from_pretrained(step / "merged")
    assert adapter.chat_template == merged.chat_template == BUILTIN_TEMPLATES["chatml"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert adapter.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        merged.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    result = run_script("merge_lora", [str(ROOT / "assets/tiny_llama"), str(step), str(tmp_path / "offline")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "offline" / "chat_template.jinja").read_text() == BUILTIN_TEMPLATES["chatml"]


@pytest.mark.slow
def test_resume_refuses_a_changed_lora_config(tmp_path, reference):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / FINAL)
    result = run_lora(out, *BASE, "lora.rank=4")
    assert result.returncode == 1 and "the config changed lora" in result.stderr


def test_base_model_name_is_the_hub_repo_when_recorded(tmp_path):
    from waypoint.cli.hub import base_model_name

    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config("llama"))
    assert base_model_name(base) == str(base.resolve())
    (base / "waypoint_source.json").write_text(json.dumps({"repo_id": "meta-llama/Llama-2-7b-hf", "revision": "0" * 40}))
    checkpointer, model = native_model(base, ["v_proj"])
    adapter = save_adapter(tmp_path / "a", model, checkpointer.converter, base_model_name(base))
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == "meta-llama/Llama-2-7b-hf"


@pytest.mark.parametrize("recorded,where,other", [
    ("meta-llama/Llama-2-7b-hf", "hub_repo", False),          # downloaded: its waypoint_source.json's repo
    ("/old/disk/base", "base", False),                       # the same base, moved
    ("org/Base/", "base", False),                            # names compare by their last part, in any case
    ("Qwen/Qwen2-0.5B", "hub_cache", False),                 # a snapshot folder of the hub cache
    ("someone/tiny-from-config", "config", False),           # config.json's _name_or_path
    ("meta-llama/Llama-3.1-8B", "base", True),
    ("", "base", False),                                     # nothing recorded: nothing compared
])
def test_an_adapter_names_its_base_by_any_of_its_names(recorded, where, other, tmp_path):
    from waypoint.checkpointers.peft_adapter import other_base
    from waypoint.cli.hub import base_model_name

    base = tmp_path / ("models--Qwen--Qwen2-0.5B/snapshots/abc" if where == "hub_cache" else "base")
    write_family_checkpoint(base, tiny_family_config("llama"))
    if where == "hub_repo":
        (base / "waypoint_source.json").write_text(json.dumps({"repo_id": recorded, "revision": "0" * 40}))
    if where == "config":
        config = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({**config, "_name_or_path": recorded}))
    reason = other_base({"base_model_name_or_path": recorded}, base, recorded_name=base_model_name(base))
    assert (reason == f"base_model_name_or_path is {recorded!r}, not {base}") if other else reason is None, reason


def test_lora_on_a_tied_head_is_refused(tmp_path):
    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config("gemma"))
    with pytest.raises(CheckpointError, match="tied to the embedding"):
        native_model(base, ["q_proj", "output"])


@pytest.mark.slow
def test_save_merged_every_and_adapter_only(tmp_path):
    short = [*BASE[:2], "epochs=1", "max_steps_per_epoch=4", "save_every_n_steps=2", "keep_last_n_checkpoints=null"]
    every = tmp_path / "every"
    result = run_lora(every, *short, "save_merged=every")
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(verify(every / s / "merged").ok for s in ("step_2", "step_4"))
    adapter_only = tmp_path / "adapter_only"
    result = run_lora(adapter_only, *short, "save_adapter_weights_only=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p for p in adapter_only.glob("step_*/merged")] == [] and verify(adapter_only / "step_4").ok


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["meta", "native"])
def test_meta_and_native_inputs_give_hf_named_adapters(tmp_path, fmt):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from waypoint.checkpointers import load_model

    source, base = ROOT / "assets/tiny_llama", tmp_path / "base"
    converted = run_script("convert", [str(source), str(base), "--to", fmt, *(["--num-shards", "1"] if fmt == "meta" else [])])
    assert converted.returncode == 0, converted.stderr[-3000:]
    out = tmp_path / "run"
    result = run_lora(out, f"checkpointer={fmt}", f"checkpointer.checkpoint_dir={base}", *BASE[1:2], "epochs=1",
                      "max_steps_per_epoch=4", "optimizer.lr=3e-2", "lora.targets=[q_proj,v_proj]")
    assert result.returncode == 0, result.stderr[-3000:]
    step = out / "step_4"
    config = json.loads((step / ADAPTER_CONFIG).read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert all(k.startswith("base_model.model.model.layers.") for k in read_tensors(step / ADAPTER_WEIGHTS))
    tokens = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), step).eval()(tokens).logits
        merged_logits = load_model(step / "merged").eval()(tokens)
    own = read_tensors(step / f"adapter_{fmt}.safetensors")  # the adapter in the input format's own keys
    wq = "layers.0.attention.wq" if fmt == "meta" else "layers.0.attn.q_proj"
    assert {f"{wq}.lora_A.weight", f"{wq}.lora_B.weight"} <= own.keys() and len(own) == 2 * 2 * 4
    peft_b = read_tensors(step / ADAPTER_WEIGHTS)["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(own[f"{wq}.lora_B.weight"].reshape(4, 32, -1)[:, ::2], peft_b.reshape(4, 2, 16, -1)[:, 0]), \
        "Meta/native rows are interleaved where HF's are split in halves"
    diff = max_diff(peft_logits, merged_logits)
    print(f"\n{fmt} input: PEFT (HF twin of the base + our adapter) vs our merged {fmt} checkpoint: max |logits diff| = {diff:.3g}")
    assert diff <= TOL


def test_adapters_on_a_bf16_base_are_fp32(tmp_path, tokens):
    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config("llama"))
    checkpointer = HFCheckpointer(base, output_dir=tmp_path / "out")
    with torch.device("meta"):
        model = build_model(base)
    load_into(model, checkpointer.load_checkpoint()["model"], dtype="bf16")
    apply_lora(model, ["q_proj", "w2"], 4, 8.0)
    randomise_lora_b(model.named_parameters())
    assert {p.dtype for n, p in model.named_parameters() if p.requires_grad} == {torch.float32}
    logits = model(tokens)
    logits.float().sum().backward()
    assert logits.dtype == torch.bfloat16 and model.layers[0].mlp.w2.lora_B.weight.grad.dtype == torch.float32
    merged = merged_state(model)
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    expected = (model.layers[1].attn.q_proj.weight.float() + model.layers[1].attn.q_proj.delta_weight()).bfloat16()
    assert torch.equal(merged["layers.1.attn.q_proj.weight"], expected)
    adapter = save_adapter(tmp_path / "a", model, checkpointer.converter, str(base))
    assert {t.dtype for t in read_tensors(adapter / ADAPTER_WEIGHTS).values()} == {torch.float32}
