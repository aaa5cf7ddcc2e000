"""Gemma 4 beyond tests/test_families.py: each architectural feature alone against transformers' ``Gemma4ForCausalLM``
(in fp32, and in fp64 with both sides' norms in fp64 too, where the computations must be the same to the last bits),
generation through kv-shared layers, gradients, the multimodal repo (``Gemma4ForConditionalGeneration``: the language
model trained, the vision and audio towers written back byte for byte) and LoRA on every projection against PEFT."""

from __future__ import annotations

import json

import pytest
import torch

from waypoint.checkpointers import HFCheckpointer, load_into, load_model
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.families import family_named, from_hf_config, model_args_from_hf_config
from waypoint.models.kv_cache import KVCache
from waypoint.models.lora import adapter_state, apply_lora, merged_state
from tests.conftest import save_adapter, tiny_family_config, write_family_checkpoint
from tests.test_lora import hf_weights
from tests.test_qwen3_5 import assert_same_files, randomize

LONG = 24  # six times the sliding window of 4
# each feature alone over the tiny base (tests/conftest.py's "gemma4": sliding and full layers of their own shapes)
VARIANTS = {
    "base": {},
    "kv-sharing": dict(num_kv_shared_layers=2),
    "k-eq-v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "per-layer-embeddings": dict(hidden_size_per_layer_input=8),
    "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    "double-wide-mlp": dict(num_kv_shared_layers=2, use_double_wide_mlp=True),
}
EVERYTHING = dict(num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True, num_global_key_value_heads=1,
                  hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def long_tokens():
    return torch.randint(0, 128, (2, LONG), generator=torch.Generator().manual_seed(3))


def hf_logits(hf_model, tokens):
    # output_hidden_states: transformers 5.24 slices the kv-shared layers' inputs for generation otherwise, and without
    # per-layer embeddings that path subscripts None (Gemma4TextModel._maybe_slice_kv_shared_inputs)
    return hf_model(input_ids=tokens, output_hidden_states=True).logits


def fp64_norms(monkeypatch):
    """Both sides' RMSNorms computed in the input's dtype (both cast to fp32 otherwise, which in fp64 leaves each
    side's fp32 rounding in the comparison)."""
    from transformers.models.gemma4 import modeling_gemma4

    from waypoint.models import attention

    def theirs(self, x):
        normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return normed * self.weight if self.with_scale else normed

    def ours(self, x):
        normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return normed if self.weight is None else normed * self.weight

    monkeypatch.setattr(modeling_gemma4.Gemma4RMSNorm, "forward", theirs)
    monkeypatch.setattr(attention.RMSNorm, "forward", ours)


@pytest.mark.parametrize("variant", [*VARIANTS, "everything"])
def test_each_feature_matches_transformers(variant, tmp_path, long_tokens, monkeypatch):
    hf_model = write_family_checkpoint(tmp_path / "in", tiny_family_config("gemma4", **VARIANTS.get(variant, EVERYTHING)))
    model = load_model(tmp_path / "in").eval()
    with torch.no_grad():
        diff32 = (model(long_tokens) - hf_logits(hf_model, long_tokens)).abs().max().item()
        fp64_norms(monkeypatch)
        hf_model.double().config._experts_implementation = "eager"  # transformers' grouped_mm has no fp64
        model.double().reset_rope()
        diff64 = (model(long_tokens) - hf_logits(hf_model, long_tokens)).abs().max().item()
    print(f"\ngemma4 {variant}: max |native - transformers| logit = {diff32:.3g} in fp32, {diff64:.3g} in fp64")
    # fp32: the rounding of attention at scale 1.0 over normed q and k; fp64 with fp64 norms: the same computation,
    # but for the router's softmax, which both take in fp32
    assert diff32 <= (3e-5 if variant == "everything" else 1.5e-5)
    assert diff64 <= (1e-6 if variant in ("moe", "everything") else 1e-12)


def test_generation_through_kv_shared_layers_matches_the_whole_sequence(tmp_path):
    """The kv-shared layers read the cache their source layers extend: prefill then one token at a time gives the
    whole sequence's logits, and sampling a group (its preallocated cache) gives what plain generation gives."""
    from waypoint.models.generate import Sampling, generate
    from waypoint.models.sample_group import generate_group

    hf_model = write_family_checkpoint(tmp_path / "in", tiny_family_config("gemma4", **EVERYTHING))
    model = load_model(tmp_path / "in").eval()
    tokens = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(6))
    cache = KVCache(len(model.layers))
    with torch.no_grad():
        whole = model(tokens)
        steps = [model(tokens[:, :12], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(12, 20)]
    assert cache.keys[4] is None and cache.keys[5] is None  # the shared layers keep nothing of their own
    assert (torch.cat(steps, 1) - whole).abs().max() <= 1e-5
    greedy = generate(model, tokens[0, :8].tolist(), max_new_tokens=6)
    theirs = hf_model.generate(tokens[:, :8], max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 8:].tolist()
    assert greedy == theirs  # transformers' generation with its own cache and kv sharing
    assert generate_group(model, tokens[0, :8].tolist(), 2, 6, Sampling(temperature=0.0)) == [greedy, greedy]


def test_training_gradients_match_transformers(tmp_path, long_tokens):
    """One loss through both models: every parameter's gradient agrees (per-layer embeddings, the router's scales, the
    experts, and the source layers' k projections, which the shared layers' losses reach too)."""
    hf_model = write_family_checkpoint(tmp_path / "in", tiny_family_config("gemma4", **EVERYTHING))
    hf_model.train()
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    model = load_model(tmp_path / "in")
    # no pad token (0) among the inputs: transformers' embeddings keep its row's gradient at zero (padding_idx), ours
    # train it like any row; the same for every family whose config names a pad_token_id
    tokens = long_tokens.clamp_min(1)
    labels = tokens.clone()
    ours = model(tokens, labels=labels, loss_chunk=0)
    theirs = hf_model(input_ids=tokens, labels=labels, output_hidden_states=True).loss * (labels.shape[0] * (labels.shape[1] - 1))
    assert abs(ours.item() - theirs.item()) <= 1e-4 * abs(theirs.item())
    ours.backward(), theirs.backward()
    hf_grads = ckpt.converter.to_native({k: p.grad for k, p in hf_model.named_parameters()})
    assert dict(model.named_parameters()).keys() <= hf_grads.keys()  # (the tied head, output.weight, is not a parameter)
    worst = max(((p.grad - hf_grads[k]).abs().max() / hf_grads[k].abs().max().clamp_min(1e-6)).item()
                for k, p in model.named_parameters())
    print(f"\ngemma4 gradients: max relative difference {worst:.3g}")
    assert worst <= 1e-3


def multimodal_repo(path, seed: int = 0, **text):
    """A tiny Gemma4ForConditionalGeneration (vision and audio towers) saved by transformers into shards."""
    import transformers

    fields = {k: v for k, v in tiny_family_config("gemma4", **text).to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version", "per_layer_config")}
    fields.update(global_head_dim=32)
    config = transformers.Gemma4Config(
        text_config=fields,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           head_dim=16, patch_size=4, position_embedding_size=64, pooling_kernel_size=2),
        audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                          output_proj_dims=32, conv_kernel_size=3))
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if key.endswith(("norm.weight", ".bias")) else p.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size="40KB")
    return model


def test_multimodal_repo_trains_its_language_model_and_keeps_the_rest(tmp_path, long_tokens):
    hf_model = multimodal_repo(tmp_path / "in", **EVERYTHING)
    index_in = json.loads((tmp_path / "in/model.safetensors.index.json").read_text())["weight_map"]
    towers = [k for k in index_in if not k.startswith("model.language_model.")]
    assert any(".vision_tower." in k for k in towers) and any(".audio_tower." in k for k in towers)
    assert any(k.startswith("model.embed_vision.") for k in towers) and any(k.startswith("model.embed_audio.") for k in towers)
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    assert ckpt.model_type == "GEMMA4"
    model = load_model(tmp_path / "in").eval()
    with torch.no_grad():
        diff = (model(long_tokens) - hf_logits(hf_model, long_tokens)).abs().max().item()
    print(f"\ngemma4 multimodal repo, text: max |native - transformers| logit = {diff:.3g}")
    assert diff <= 3e-5
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=1)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == index_in
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "in/config.json").read_text())
    assert_same_files(tmp_path / "in", out, set(index_in.values()))
    # a changed language model: every tower tensor still the input's, bitwise
    state = {k: v + 1 if k.startswith("layers.0.") else v for k, v in ckpt.load_checkpoint()["model"].items()}
    step = ckpt.save_checkpoint({"model": state}, step=2)
    changed, original = hf_weights(step), hf_weights(tmp_path / "in")
    assert all(torch.equal(changed[k], original[k]) for k in towers)
    # byte for byte: every file without a layer-0 tensor, the towers' own files among them
    untouched = {f for f in index_in.values()} - {f for k, f in index_in.items() if ".layers.0." in k and "language_model" in k}
    assert {f for f in index_in.values() if all(not k.startswith("model.language_model.") for k, g in index_in.items() if g == f)} <= untouched
    assert all((tmp_path / "in" / f).read_bytes() == (step / f).read_bytes() for f in untouched)
    assert not torch.equal(changed["model.language_model.layers.0.self_attn.q_proj.weight"],
                           original["model.language_model.layers.0.self_attn.q_proj.weight"])


HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "per_layer_input_gate",
              "per_layer_projection"]


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_lora_on_every_projection_is_peft_s(multimodal, tmp_path, long_tokens):
    """LoRA by HF names on attention (k and v only where a layer has them), the MLP, the per-layer inputs and the
    experts (PEFT's target_parameters): PEFT over transformers' model gives our logits, the adapter reads back as
    written, and merged/ is PEFT's merge in the input's files (a multimodal repo's towers untouched)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from waypoint.checkpointers.peft_adapter import load_adapter

    base = tmp_path / "base"
    hf_model = multimodal_repo(base, **EVERYTHING) if multimodal else write_family_checkpoint(base, tiny_family_config("gemma4", **EVERYTHING))
    ckpt = HFCheckpointer(base, output_dir=tmp_path / "out")
    with torch.device("meta"):
        model = from_hf_config(ckpt.config)
    load_into(model, ckpt.load_checkpoint()["model"])  # the checkpointer learns the repo's nesting (its adapter's names)
    wrapped = apply_lora(model, HF_TARGETS + ["experts_gate_up", "experts_down"], rank=4, alpha=6)
    assert "layers.0.attn.v_proj" in wrapped and "layers.1.attn.v_proj" not in wrapped  # full layers: keys as values
    assert "layers.4.attn.k_proj" not in wrapped and "layers.5.per_layer_input.input_gate" in wrapped
    randomize(model, ".lora_", 0.2)
    adapter = save_adapter(tmp_path / "adapter", model, ckpt.hf_converter(), str(base))
    config = json.loads((adapter / "adapter_config.json").read_text())
    if multimodal:  # a regex over the language model: the towers' q_proj etc. (Gemma4ClippableLinear) stay unwrapped
        assert config["target_modules"] == r"model\.language_model\..*\.(?:" + "|".join(sorted(HF_TARGETS)) + ")"
    else:
        assert sorted(config["target_modules"]) == sorted(HF_TARGETS)
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    prefix = "base_model.model.model." + ("language_model." if multimodal else "")
    assert prefix + "layers.0.per_layer_input_gate.lora_A.weight" in read_tensors(adapter / "adapter_model.safetensors")
    hf_base = hf_model if multimodal else AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf_base, adapter).eval()
    with torch.no_grad():
        diff = (model.eval()(long_tokens) - hf_logits(peft_model, long_tokens)).abs().max().item()
    print(f"\ngemma4 {'multimodal ' if multimodal else ''}LoRA on every projection vs PEFT: max |logits diff| = {diff:.3g}")
    assert diff <= 3e-5
    back, _ = load_adapter(adapter, ckpt.hf_converter())
    mine = adapter_state(model)
    assert sorted(back) == sorted(mine) and all(torch.equal(back[k], mine[k]) for k in mine)
    merged_dir = ckpt.save_to({"model": merged_state(model)}, tmp_path / "merged")
    merged, original = hf_weights(merged_dir), hf_weights(base)
    peft_merged = peft_model.merge_and_unload().state_dict()
    common = [k for k in peft_merged if k in merged]
    assert any(k.endswith("per_layer_input_gate.weight") for k in common) and any(k.endswith("experts.gate_up_proj") for k in common)
    assert max((merged[k] - peft_merged[k]).abs().max().item() for k in common) <= 1e-6
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((merged_dir / "model.safetensors.index.json").read_text())["weight_map"] == index
    untouched = [k for k in index if not k.startswith(("model.language_model.", "model.layers.", "lm_head."))]
    assert all(torch.equal(merged[k], original[k]) for k in untouched)


def test_config_json_for_a_native_checkpoint_reads_back_in_ours_and_transformers():
    import transformers

    config = tiny_family_config("gemma4", **EVERYTHING)
    args = model_args_from_hf_config(config.to_dict())
    written = json.loads(json.dumps(family_named("gemma4").hf_config(args)))
    assert model_args_from_hf_config(written) == args
    theirs = transformers.Gemma4TextConfig(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert model_args_from_hf_config(theirs.to_dict()) == args and theirs.layer_types == config.layer_types
    # the releases' fields (global_head_dim, num_global_key_value_heads) read as v5.24's per_layer_config
    released = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"}
    assert model_args_from_hf_config({**released, "global_head_dim": 32, "num_global_key_value_heads": 1}) == args


def test_meta_build_holds_no_data_and_loads_the_per_layer_table_as_read(tmp_path):
    """The per-layer table is built on the meta device (no init) and the loaded model holds the tensor read."""
    write_family_checkpoint(tmp_path / "in", tiny_family_config("gemma4", **EVERYTHING))
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    with torch.device("meta"):
        model = from_hf_config(ckpt.config)
    assert model.per_layer.embeddings.weight.is_meta
    state = ckpt.load_checkpoint()["model"]
    load_into(model, state)
    assert model.per_layer.embeddings.weight.data_ptr() == state["per_layer.embeddings.weight"].data_ptr()


def recipe_base(path, **fields):
    """The tiny Gemma 4 with every feature, at the tiny tokenizer's vocabulary, with its tokenizer."""
    import shutil

    from tests.conftest import ROOT

    write_family_checkpoint(path, tiny_family_config("gemma4", vocab_size=512, vocab_size_per_layer_input=512,
                                                     max_position_embeddings=256, **{**EVERYTHING, **fields}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / f, path / f)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["full", "qlora"])
def test_recipes_train_stop_and_resume_bit_exactly(recipe, tmp_path):
    """The full fine-tune and QLoRA (NF4 over attention and the dense MLPs; the experts and per-layer inputs in the
    compute dtype) through the real recipes: the loss falls, a SIGTERM checkpoints and exits 75, the rerun finishes
    bit-identical to a run that never stopped, and the output (the merged model for QLoRA) is the input's files."""
    from tests import test_family_training, test_qlora

    base = recipe_base(tmp_path / "base")
    if recipe == "full":
        run, out = test_family_training.run, lambda d: d
    else:
        targets = "lora.targets=[q_proj,k_proj,v_proj,output_proj,w1,w2,w3,input_gate,input_proj]"
        run, out = (lambda b, o, stop_at=None: test_qlora.run(b, o, targets, stop_at=stop_at)), lambda d: d / "merged"
    assert run(base, tmp_path / "straight") == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "straight/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2]), f"the loss did not fall: {losses}"
    assert run(base, tmp_path / "stopped", stop_at=3) == 75
    assert run(base, tmp_path / "stopped") == 0
    final, expected = out(tmp_path / "stopped/step_6"), out(tmp_path / "straight/step_6")
    mine, theirs = hf_weights(final), hf_weights(expected)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), "resume is not bit-exact"
    index = "model.safetensors.index.json"
    assert json.loads((final / index).read_text())["weight_map"] == json.loads((base / index).read_text())["weight_map"]
    original = hf_weights(base)
    changed = [k for k in mine if not torch.equal(mine[k], original[k])]
    assert any("per_layer_input_gate" in k for k in changed) and any("q_proj" in k for k in changed)
    if recipe == "full":
        assert any("experts.gate_up_proj" in k for k in changed) and "model.embed_tokens_per_layer.weight" in changed


@pytest.mark.slow
def test_two_processes_with_activation_checkpointing_match_one(tmp_path):
    """Under torchrun (FSDP2, each block its own unit) with activation checkpointing: the kv-shared layers read keys and
    values their source blocks computed in the same forward, recomputed in the backward, and 2 processes compute what
    1 does, to the export in the input's files. With SGD: AdamW divides each gradient by its own size, so on the tiny
    model's near-zero gradients the two reductions' last-bit differences become whole steps (2e-5 apart by step 4)."""
    from tests import test_distributed as dist

    base = recipe_base(tmp_path / "base")
    one, two = tmp_path / "one", tmp_path / "two"
    for out, processes in ((one, 1), (two, 2)):
        result = dist.run(out, "epochs=1", "save_every_n_steps=null", "enable_activation_checkpointing=true",
                          "optimizer._target_=torch.optim.SGD", source=base,
                          processes=processes)
        assert result.returncode == 0, result.stderr[-3000:]
    assert max(abs(a - b) for a, b in zip(dist.losses(one), dist.losses(two))) < dist.LOSS_TOLERANCE
    final = f"step_{dist.STEPS_PER_EPOCH}"
    assert dist.max_diff(dist.weights(one / final), dist.weights(two / final)) < dist.WEIGHT_TOLERANCE
    index = lambda d: json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731
    assert index(two / final) == index(base)


def test_norms_are_transformers_bitwise_in_bf16():
    """Gemma 4's norms multiply by the weight in fp32 (not 1 + weight, not after the cast) and take pow(-0.5); the
    value and router norms have no weight."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    from waypoint.models.attention import RMSNorm

    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    w = torch.randn(48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ours, theirs = RMSNorm(48, 1e-6, fp32_weight=True), Gemma4RMSNorm(48, 1e-6)
    ours.weight.data, theirs.weight.data = w.clone(), w.clone()
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(RMSNorm(48, 1e-6, fp32_weight=True, weight=False)(x), Gemma4RMSNorm(48, 1e-6, with_scale=False)(x))
    llama_order = RMSNorm(48, 1e-6)
    llama_order.weight.data = w.clone()
    assert not torch.equal(llama_order(x), theirs(x))  # the order matters in bf16: the check above can fail


def test_activation_checkpointing_gives_the_same_gradients(tmp_path, long_tokens):
    """Recomputed blocks (the kv-shared layers reading their sources' keys and values, the per-layer inputs passed in)
    give the gradients of a plain backward, bit for bit."""
    write_family_checkpoint(tmp_path / "in", tiny_family_config("gemma4", **EVERYTHING))
    grads = []
    for checkpointing in (False, True):
        model = load_model(tmp_path / "in").train()
        model.activation_checkpointing = checkpointing
        model(long_tokens, labels=long_tokens, loss_chunk=0).backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    assert grads[0]["layers.1.attn.k_proj.weight"].abs().sum() > 0  # the full layers 4 and 5 read layer 1's keys
