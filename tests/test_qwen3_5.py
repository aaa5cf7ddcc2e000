"""Qwen3.5/3.6 (dense, MoE, the multimodal repos) and Qwen3-Next beyond tests/test_families.py: sequences of several
delta-rule chunks against transformers, the delta rule and its gradients against transformers' own, the multimodal
repo's language model trained with its vision tower and MTP layers written back bitwise, packing without leaks,
generation through the recurrent state, and LoRA on the DeltaNet projections against PEFT."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from waypoint.checkpointers import CheckpointError, HFCheckpointer, load_into, load_model
from waypoint.checkpointers.file_formats import read_tensors
from safetensors.torch import save_file
from waypoint.families import from_hf_config, model_args_from_hf_config
from waypoint.models.delta_rule import chunk_gated_delta_rule
from waypoint.models.kv_cache import KVCache
from waypoint.models.lora import apply_lora, merged_state
from tests.conftest import HYBRID, save_adapter, tiny_family_config, write_family_checkpoint
from tests.test_lora import hf_weights

LONG = 150  # > 2 chunks of 64


@pytest.fixture(scope="module")
def long_tokens():
    return torch.randint(0, 128, (2, LONG), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("fam", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_long_sequences_match_transformers(fam, tmp_path, long_tokens):
    hf_model = write_family_checkpoint(tmp_path / "in", tiny_family_config(fam))
    model = load_model(tmp_path / "in").eval()
    with torch.no_grad():
        diff = (model(long_tokens) - hf_model(long_tokens).logits).abs().max().item()
    print(f"\n{fam}: {LONG} tokens, max |native - transformers| logit = {diff:.3g}")
    assert diff <= 1e-5


def random_inputs(batch=2, seq=150, k_heads=2, v_heads=4, k_dim=8, v_dim=12, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, seq, k_heads, k_dim, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, seq, v_heads, v_dim, generator=gen, dtype=dtype)
    g = -torch.rand(batch, seq, v_heads, generator=gen, dtype=dtype) * 2
    beta = torch.rand(batch, seq, v_heads, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def test_delta_rule_is_the_recurrence_with_its_state_and_gradients():
    """Against transformers' token-by-token recurrence (the definition), from a given state; gradients against
    autograd through transformers' chunked form."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule

    q, k, v, g, beta = random_inputs()
    state = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours, ours_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    ref, ref_state = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    assert (ours - ref).abs().max() <= 1e-5 and (ours_state - ref_state).abs().max() <= 1e-5
    # split in two calls through the state: the same as one
    first, mid = chunk_gated_delta_rule(*(t[:, :70] for t in (q, k, v, g, beta)), initial_state=state, output_final_state=True)
    second, _ = chunk_gated_delta_rule(*(t[:, 70:] for t in (q, k, v, g, beta)), initial_state=mid)
    assert (torch.cat([first, second], 1) - ref).abs().max() <= 1e-5

    leaves = [t.float().requires_grad_() for t in random_inputs(seed=2)]
    weights = torch.randn(2, 150, 4, 12, generator=torch.Generator().manual_seed(3))
    (chunk_gated_delta_rule(*leaves)[0] * weights).sum().backward()
    ours_grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    q, k, v, g, beta = leaves
    (torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0] * weights).sum().backward()
    for name, a, t in zip("q k v g beta".split(), ours_grads, leaves):
        assert torch.allclose(a, t.grad, rtol=1e-4, atol=1e-4), (name, (a - t.grad).abs().max())


def test_training_gradients_match_transformers(tmp_path, long_tokens):
    """One loss, backpropagated through both models: every parameter's gradient agrees (DeltaNet's included)."""
    hf_model = write_family_checkpoint(tmp_path / "in", tiny_family_config("qwen3_5"))
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    model = load_model(tmp_path / "in")
    labels = long_tokens.clone()
    ours = model(long_tokens, labels=labels, loss_chunk=0)
    theirs = hf_model(input_ids=long_tokens, labels=labels).loss * (labels.shape[0] * (labels.shape[1] - 1))
    assert abs(ours.item() - theirs.item()) <= 1e-3 * abs(theirs.item())
    ours.backward(), theirs.backward()
    hf_grads = ckpt.converter.to_native({k: p.grad for k, p in hf_model.named_parameters()})
    worst = max(((p.grad - hf_grads[k]).abs().max() / hf_grads[k].abs().max().clamp_min(1e-6)).item()
                for k, p in model.named_parameters())
    print(f"\nqwen3.5 gradients: max relative difference {worst:.3g}")
    assert worst <= 1e-4


def randomize(model, part: str, std: float, seed: int = 1) -> None:
    """Every parameter whose name holds ``part`` drawn anew."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if part in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def multimodal_repo(path, moe: bool = False, seed: int = 0):
    """A tiny Qwen3_5(Moe)ForConditionalGeneration saved by transformers, plus an ``mtp.*`` shard as the releases
    carry (transformers neither loads nor writes those)."""
    import transformers

    text = {k: v for k, v in tiny_family_config("qwen3_5_moe" if moe else "qwen3_5").to_dict().items()
            if k not in ("model_type", "architectures", "transformers_version")}
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                             num_position_embeddings=16, patch_size=4))
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if key.endswith(("norm.weight", ".bias")) else p.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size="40KB")
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64)}
    save_file(mtp, path / "mtp.safetensors", metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "mtp.safetensors" for k in mtp})
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in mtp.values())  # as a release counts them
    index["metadata"]["total_parameters"] += sum(t.numel() for t in mtp.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return model


def assert_same_files(a, b, names):
    for f in names:
        before, after = read_tensors(a / f), read_tensors(b / f)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), f


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_multimodal_repo_trains_its_language_model_and_keeps_the_rest(moe, tmp_path, long_tokens):
    hf_model = multimodal_repo(tmp_path / "in", moe)
    index_in = json.loads((tmp_path / "in/model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("model.visual.") for k in index_in) and any(k.startswith("model.language_model.") for k in index_in)
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    assert ckpt.model_type == ("QWEN3_5_MOE" if moe else "QWEN3_5")
    model = load_model(tmp_path / "in").eval()
    with torch.no_grad():
        diff = (model(long_tokens) - hf_model(input_ids=long_tokens).logits).abs().max().item()
    print(f"\nqwen3.5{'-moe' if moe else ''} multimodal repo, text: max |native - transformers| logit = {diff:.3g}")
    assert diff <= 1e-5
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=1)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == index_in
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "in/config.json").read_text())
    assert_same_files(tmp_path / "in", out, set(index_in.values()))
    # through the native format and back: the vision tower and MTP layers travel beside the native weights
    from scripts import convert

    assert convert.main([str(tmp_path / "in"), str(tmp_path / "native"), "--to", "native"]) == 0
    assert convert.main([str(tmp_path / "native"), str(tmp_path / "back"), "--to", "hf"]) == 0
    back = tmp_path / "back"
    for f in ("config.json", "model.safetensors.index.json"):
        assert json.loads((back / f).read_text()) == json.loads((tmp_path / "in" / f).read_text()), f
    assert_same_files(tmp_path / "in", back, set(index_in.values()))


def test_lora_merged_from_a_multimodal_repo_keeps_the_vision_tower_and_loads_in_peft(tmp_path, long_tokens):
    """LoRA on DeltaNet's and attention's projections and the MLP: the adapter names the multimodal model's modules
    (PEFT over Qwen3_5ForConditionalGeneration gives our logits), merged/ is PEFT's merge in the input's files with
    every tensor outside the language model (vision tower, MTP) bitwise the input's."""
    from peft import PeftModel

    base = tmp_path / "base"
    hf_model = multimodal_repo(base)
    ckpt = HFCheckpointer(base, output_dir=tmp_path / "out")
    with torch.device("meta"):
        model = from_hf_config(ckpt.config)
    load_into(model, ckpt.load_checkpoint()["model"])
    wrapped = apply_lora(model, ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "v_proj", "output_proj", "w1", "w2"], 4, 8.0)
    assert {"layers.0.attn.in_proj_qkv", "layers.0.attn.out_proj", "layers.1.attn.q_proj", "layers.2.mlp.w2"} <= set(wrapped)
    randomize(model, "lora_B", 0.1)  # PEFT starts B at zero: random, so the adapters count
    adapter = save_adapter(tmp_path / "adapter", model, ckpt.hf_converter(), str(base))
    keys = read_tensors(adapter / "adapter_model.safetensors")
    assert "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight" in keys
    peft_model = PeftModel.from_pretrained(hf_model, adapter).eval()
    with torch.no_grad():
        diff = (model.eval()(long_tokens) - peft_model(input_ids=long_tokens).logits).abs().max().item()
    print(f"\nqwen3.5 multimodal LoRA vs PEFT: max |logits diff| = {diff:.3g}")
    assert diff <= 1e-5
    merged_dir = ckpt.save_to({"model": merged_state(model)}, tmp_path / "merged")
    merged = hf_weights(merged_dir)
    peft_merged = peft_model.merge_and_unload().state_dict()
    assert set(peft_merged) <= set(merged)
    assert max((merged[k] - peft_merged[k]).abs().max().item() for k in peft_merged) <= 1e-6
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((merged_dir / "model.safetensors.index.json").read_text())["weight_map"] == index
    untouched = [k for k in index if not k.startswith("model.language_model.") and k != "lm_head.weight"]
    assert any(k.startswith("model.visual.") for k in untouched) and "mtp.fc.weight" in untouched
    original = hf_weights(base)
    assert all(torch.equal(merged[k], original[k]) for k in untouched)


def test_packed_documents_do_not_leak_state(tmp_path):
    """Documents packed in one row give each token the logits (and the loss) it has alone: the delta rule's state and
    the convolution's window restart at each document, wherever in a chunk it starts. In fp64, where the chunks' other
    cut (and so rounding) leaves no trace; fp32 within its rounding."""
    write_family_checkpoint(tmp_path / "in", tiny_family_config("qwen3_5"))
    model = load_model(tmp_path / "in").double().eval()
    model.reset_rope()
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 128, (n,), generator=gen) for n in (70, 3, 90)]
    packed = torch.cat(docs)[None]
    documents = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        together = model(packed, positions=positions, document_ids=documents)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
        leaky = model(packed)[0]
        losses = (model(packed, positions=positions, document_ids=documents, labels=packed.masked_fill(positions == 0, -100)),
                  sum(model(d[None], labels=d[None]) for d in docs))
        model.float().reset_rope()
        single = model(packed, positions=positions, document_ids=documents)[0]
    diff, diff32 = (together - alone).abs().max().item(), (single.double() - alone).abs().max().item()
    print(f"\nqwen3.5 packed vs alone: max |logits diff| = {diff:.3g} in fp64, {diff32:.3g} in fp32; "
          f"losses {losses[0].item():.9f} vs {losses[1].item():.9f}")
    assert diff <= 1e-10 and diff32 <= 1e-4 and (leaky[70:] - alone[70:]).abs().max() > 1e-2  # without ids it would leak
    assert torch.allclose(*losses, rtol=1e-12)


def test_generation_through_the_recurrent_state_matches_the_whole_sequence(tmp_path):
    write_family_checkpoint(tmp_path / "in", tiny_family_config("qwen3_5"))
    model = load_model(tmp_path / "in").eval()
    tokens = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(6))
    cache = KVCache(len(model.layers))
    with torch.no_grad():
        whole = model(tokens)
        steps = [model(tokens[:, :70], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(70, 80)]
    assert (torch.cat(steps, 1) - whole).abs().max() <= 1e-5


def test_qwen3_next_fused_projections_split_and_refuse_lora(tmp_path):
    from waypoint.checkpointers.peft_adapter import check_targets

    write_family_checkpoint(tmp_path / "in", tiny_family_config("qwen3_next"))
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    native = ckpt.load_checkpoint()["model"]
    assert native["layers.0.attn.in_proj_qkv.weight"].shape == (2 * 16 + 48, 64) and "layers.0.attn.in_proj_z.weight" in native
    model = load_model(tmp_path / "in")
    apply_lora(model, ["in_proj_qkv"], rank=2, alpha=4)
    with pytest.raises(CheckpointError, match="in_proj_qkv") as e:
        check_targets(model, ckpt.hf_converter(), ckpt.family)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fam,targets", [
    ("qwen3_5", ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3"]),
    ("qwen3_next", ["out_proj", "q_proj", "v_proj", "output_proj"])])
def test_the_vllm_check_follows_what_vllm_serves_for_the_family(fam, targets, tmp_path):
    """vLLM serves LoRA on the Gated DeltaNet's projections (its Qwen3.5 keeps in_proj_qkv and in_proj_z apart when
    LoRA is on; both serve out_proj): such an adapter saves without a vLLM warning (each save warned they were not
    supported); one on the head, which vLLM does not serve, still warns."""
    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config(fam, tie_word_embeddings=False))
    converter = HFCheckpointer(base, output_dir=tmp_path / "out").hf_converter()
    model = load_model(base)
    apply_lora(model, targets, rank=4, alpha=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_adapter(tmp_path / "adapter", model, converter, str(base))
    model = load_model(base)
    apply_lora(model, [*targets, "output"], rank=4, alpha=8)
    with pytest.warns(UserWarning, match=r"vLLM: target module\(s\) lm_head are not supported LoRA modules \(supported: "):
        save_adapter(tmp_path / "with_head", model, converter, str(base))


def test_config_defaults_and_interval_read_as_transformers():
    from transformers import Qwen3_5TextConfig

    required = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4)
    ours = model_args_from_hf_config({"model_type": "qwen3_5_text", **required, "full_attention_interval": 4})
    theirs = model_args_from_hf_config(Qwen3_5TextConfig(**required).to_dict())
    assert ours == theirs and ours.linear_attention_layers == (0, 1, 2, 4, 5, 6) and ours.rotary_dim == 64
    assert HYBRID["linear_num_value_heads"] % HYBRID["linear_num_key_heads"] == 0


def blocks(scale: torch.Tensor, shape, block: int = 32) -> torch.Tensor:
    """A block-FP8 scale [.., rows / block, cols / block] spread over its weight's elements (partial blocks cut)."""
    return scale.repeat_interleave(block, -2)[..., : shape[-2], :].repeat_interleave(block, -1)[..., : shape[-1]]


@pytest.mark.parametrize("fam", ["qwen3_5", "qwen3_5_moe"])
def test_block_fp8_release_loads_and_is_written_back_byte_for_byte(fam, tmp_path, long_tokens):
    """A ``-FP8`` release (DeltaNet's and attention's projections and the experts in float8 with 32-blocks of scales):
    dense, transformers' dequantized reading's logits; MoE, whose packed FP8 experts transformers 5.24 does not read
    (their scales are "unexpected" to it), each expert weight is its float8 values times its blocks' scales. A save of
    the untouched model writes every file back byte for byte."""
    from tests.conftest import write_fp8_checkpoint

    # value heads of 16 and a shared expert of 64: whole 32-blocks along every quantized weight's columns, as every
    # release's are (transformers' dequantizing reader mis-scales partial blocks; ours reads them as the format says)
    moe = fam.endswith("moe")
    config = tiny_family_config(fam, linear_value_head_dim=16, **(dict(shared_expert_intermediate_size=64) if moe else {}))
    oracle = write_fp8_checkpoint(tmp_path / "in", config, packed=moe)
    model = load_model(tmp_path / "in").eval()
    if moe:
        disk = hf_weights(tmp_path / "in")
        for i in range(3):
            stem = f"model.layers.{i}.mlp.experts."
            gate_up = disk[stem + "gate_up_proj"].float() * blocks(disk[stem + "gate_up_proj_scale_inv"], disk[stem + "gate_up_proj"].shape)
            down = disk[stem + "down_proj"].float() * blocks(disk[stem + "down_proj_scale_inv"], disk[stem + "down_proj"].shape)
            moe_layer = model.layers[i].moe
            assert torch.equal(torch.cat([moe_layer.w1, moe_layer.w3], 1), gate_up) and torch.equal(moe_layer.w2, down)
    else:
        with torch.no_grad():
            expected = oracle(input_ids=long_tokens).logits
            diff = (model(long_tokens) - expected).abs().max().item()
        print(f"\n{fam} block FP8: max |native - transformers dequantized| logit = {diff:.3g}")
        assert diff <= 1e-5
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=1)
    files = sorted(p.name for p in (tmp_path / "in").glob("*.safetensors"))
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert all((tmp_path / "in" / f).read_bytes() == (out / f).read_bytes() for f in files)


@pytest.mark.parametrize("fam", ["qwen3_5_moe", "qwen3_next"])
def test_lora_on_the_routed_experts_is_peft_s_target_parameters(fam, tmp_path, long_tokens):
    """LoRA on the stacked experts (``experts_gate_up``, ``experts_down``) with DeltaNet and attention: PEFT's
    ``target_parameters`` adapter over transformers' packed experts (gate and up as halves), our logits, read back
    as written, and PEFT's merge in the input's files."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from waypoint.checkpointers.peft_adapter import load_adapter
    from waypoint.models.lora import adapter_state

    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config(fam), packed=True)
    ckpt = HFCheckpointer(base, output_dir=tmp_path / "out")
    model = load_model(base)
    apply_lora(model, ["q_proj", "out_proj", "experts_gate_up", "experts_down"], rank=4, alpha=6)
    randomize(model, ".lora_", 0.2)
    adapter = save_adapter(tmp_path / "adapter", model, ckpt.hf_converter(), str(base))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        diff = (model.eval()(long_tokens) - peft_model(input_ids=long_tokens).logits).abs().max().item()
    print(f"\n{fam} LoRA on experts + DeltaNet + attention vs PEFT: max |logits diff| = {diff:.3g}")
    assert diff <= 1e-5
    back, _ = load_adapter(adapter, ckpt.hf_converter())
    mine = adapter_state(model)
    assert sorted(back) == sorted(mine) and all(torch.equal(back[k], mine[k]) for k in mine)
    merged = hf_weights(ckpt.save_to({"model": merged_state(model)}, tmp_path / "merged"))
    peft_merged = peft_model.merge_and_unload().state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in merged
    assert max((merged[k] - peft_merged[k]).abs().max().item() for k in peft_merged) <= 1e-6


@pytest.mark.parametrize("fam", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_config_json_written_for_a_native_checkpoint_reads_back_in_ours_and_transformers(fam):
    import transformers

    from waypoint.families import family_named

    config = tiny_family_config(fam)
    args = model_args_from_hf_config(config.to_dict())
    written = json.loads(json.dumps(family_named(fam).hf_config(args)))
    assert model_args_from_hf_config(written) == args
    theirs = type(config)(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert model_args_from_hf_config(theirs.to_dict()) == args and theirs.layer_types == config.layer_types
    assert hasattr(transformers, written["architectures"][0])
    with pytest.raises(ValueError, match="attn_output_gate=false"):
        model_args_from_hf_config({**config.to_dict(), "attn_output_gate": False})


@pytest.mark.parametrize("fam", ["qwen3_5", "qwen3_5_moe"])
def test_the_written_config_keeps_an_mrope_section_of_its_own(fam):
    """A tiny head's mRoPE section (not transformers' default [11, 11, 10]) survives ModelArgs -> config.json -> ModelArgs:
    a multimodal model reads it for its image tokens' positions."""
    from waypoint.families import family_named

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}
    args = model_args_from_hf_config(tiny_family_config(fam, rope_parameters=rope).to_dict())
    written = json.loads(json.dumps(family_named(fam).hf_config(args)))
    assert args.mrope_section == (2, 1, 1) and model_args_from_hf_config(written) == args
