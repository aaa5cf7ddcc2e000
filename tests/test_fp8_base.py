"""quantize_base: fp8: a block-FP8 checkpoint's linears held as ``FP8Weight`` keep the file's own bytes and scales
(q/k through the RoPE permutation too), compute bitwise the dense load's logits and LoRA gradients in fp32, hold
about half of their bf16 bytes, keep no dense copy alive for the backward, and train in the LoRA recipe, whose
merged/ writes the untouched weights' bytes back."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from recipes import lora_finetune
from waypoint.checkpointers import CheckpointError, HFCheckpointer, build_model, load_into
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.converters.ops import Identity, Interleave, RopePermute, Split
from waypoint.converters.fp8 import row_plan
from waypoint.fp8 import dequantize_fp8, quantize_fp8
from waypoint.models import fp8_weight
from waypoint.models.fp8_weight import FP8Weight
from waypoint.models.lora import apply_lora, init_adapters, load_adapter_state
from waypoint.training.quantize import quantize_base
from tests.conftest import ROOT, tiny_family_config, write_fp8_checkpoint

BLOCK = (16, 16)
TOKENS = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(7))
HF = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
      "output_proj": "self_attn.o_proj", "w1": "mlp.gate_proj", "w2": "mlp.down_proj", "w3": "mlp.up_proj"}
# head_dim 24 (qwen3: q/k rows permuted across blocks: held in the file's order with their order), 16 (llama: within
# one block: re-ordered once), 32 (llama with 2 heads: across blocks)
SHAPES = {"qwen3_hd24": ("qwen3", {}), "llama_hd16": ("llama", {}),
          "llama_hd32": ("llama", dict(num_attention_heads=2, num_key_value_heads=1))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_base")
    for name, (family, overrides) in SHAPES.items():
        write_fp8_checkpoint(root / name, tiny_family_config(family, **overrides), block=BLOCK)
    return root


def load(path, quantize: bool, dtype="fp32"):
    """As recipes/lora_finetune.py builds it: meta model, adapters, quantize_base placeholders, one load; the same
    random adapters (B too) whichever the base."""
    checkpointer = HFCheckpointer(path, output_dir=path.parent / "out")
    state = checkpointer.load_checkpoint()["model"]
    with torch.device("meta"):
        model = build_model(path)
    apply_lora(model, ["q_proj", "k_proj", "v_proj", "w2"], 4, 8.0)
    lines = quantize_base(model, dtype, "fp8" if quantize else None, checkpointer=checkpointer)
    report = load_into(model, state, dtype=dtype, fill_later=[k for k in model.state_dict() if ".lora_" in k])
    init_adapters(model)
    generator = torch.Generator().manual_seed(1)
    load_adapter_state(model, {k: torch.randn(v.shape, generator=generator) * 0.1
                               for k, v in model.state_dict().items() if ".lora_" in k})
    return model, report, lines


def held(model):
    return {n: p for n, p in model.named_parameters() if isinstance(p, FP8Weight)}


def file_tensors(path):
    return {k: t for f in sorted(path.glob("*.safetensors")) for k, t in read_tensors(f).items()}


def forward_backward(model, hook=None):
    model.zero_grad(set_to_none=True)
    with saved_tensors_hooks(hook or (lambda t: t), lambda t: t):
        logits = model(TOKENS)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_files_bytes_compute_the_dense_models_logits_and_gradients(checkpoints, shape):
    path = checkpoints / shape
    dense, _, _ = load(path, quantize=False)
    model, report, lines = load(path, quantize=True)
    weights = held(model)
    n = len(HF) * model.args.n_layers
    assert lines == [f"fp8: {n} weights held as the file's bytes, 0 re-quantized; block FP8 in blocks of [16, 16], "
                     "the rest in fp32"], lines
    assert len(weights) == n and sorted(report.quantized) == sorted(weights) and report.quantized_as == ["FP8"]
    assert all(p.from_file and not p.requires_grad for p in weights.values())
    files, args = file_tensors(path), model.args
    for name, p in weights.items():
        layer, leaf = name.split(".")[1], name.split(".")[-2]
        key = f"model.layers.{layer}.{HF[leaf]}.weight"
        assert torch.equal(p.scale_inv, files[key + "_scale_inv"]), name  # the file's scales
        expected = files[key].view(torch.uint8)
        if leaf in ("q_proj", "k_proj") and p.rows is None:  # permuted within blocks, once
            expected = RopePermute(args.n_heads if leaf == "q_proj" else args.n_kv_heads, args.resolved_head_dim).forward([expected])[0]
        assert torch.equal(p.weight.view(torch.uint8), expected), name  # the file's bytes
        assert torch.equal(p.dequantize(), dense.get_parameter(name)), name
    permuted = sum(p.rows is not None for p in weights.values())
    assert permuted == (0 if shape == "llama_hd16" else 2 * args.n_layers)  # q and k, where heads cross blocks
    want, want_grads = forward_backward(dense)
    got, grads = forward_backward(model)
    print(f"\n{shape}: {n} FP8 weights ({permuted} with a row order); logits and {len(grads)} LoRA gradients bitwise")
    assert torch.equal(got, want) and sorted(grads) == sorted(want_grads)
    assert all(torch.equal(grads[k], want_grads[k]) and grads[k].abs().sum() > 0 for k in grads)


def saved_bytes(model) -> int:
    """Bytes of the tensors autograd saves for the backward that are not the model's parameters (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters() if not isinstance(p, FP8Weight)}
    storages: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, FP8Weight):  # an FP8Weight saved is a parameter's own bytes
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
        return t

    forward_backward(model, pack)
    return sum(storages.values())


def test_half_the_bytes_and_no_dense_copy_for_the_backward(checkpoints, monkeypatch):
    path = checkpoints / "qwen3_hd24"
    dense, _, _ = load(path, quantize=False)
    model, _, _ = load(path, quantize=True)
    weights = held(model)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for p in weights.values() for t in (p.weight, p.scale_inv, p.rows) if t is not None}
    nbytes, bf16 = sum(storages.values()), sum(p.numel() * 2 for p in weights.values())
    print(f"\nheld: {nbytes} bytes, {nbytes / bf16:.3f} of their bf16 bytes ({bf16})")
    assert nbytes == sum(p.held_nbytes for p in weights.values()) and 0.5 < nbytes / bf16 < 0.56
    fp32 = sum(p.numel() * 4 for p in weights.values())
    want, got = saved_bytes(dense), saved_bytes(model)
    print(f"saved for backward beside the parameters: dense {want} bytes, FP8 {got} (the weights dequantized: {fp32})")
    assert got <= want
    # the negative control: the same products on the dequantized weight save a dense copy of each weight whose input
    # wants a gradient (all but the first layer's q, k, v: their input, the frozen embedding's norm, wants none)
    monkeypatch.setattr(fp8_weight, "PackedMatmul", type("Dense", (), {"apply": staticmethod(
        lambda x, w, b=None: torch.nn.functional.linear(x, w.dequantize(), b))}))
    first = sum(weights[f"layers.0.attn.{k}.weight"].numel() * 4 for k in ("q_proj", "k_proj", "v_proj"))
    assert saved_bytes(model) >= want + fp32 - first


def test_what_is_not_the_files_is_quantized_and_the_weight_ops(checkpoints):
    path = checkpoints / "qwen3_hd24"
    checkpointer = HFCheckpointer(path, output_dir=path.parent / "out")
    state = checkpointer.load_checkpoint()["model"]
    with torch.device("meta"):
        model = build_model(path)
    quantize_base(model, "fp32", "fp8", checkpointer=checkpointer)
    plain = {k: state[k].clone() for k in state}  # the values without their origin: quantized as loaded
    load_into(model, plain, dtype="fp32")
    q = model.get_parameter("layers.0.attn.q_proj.weight")
    assert not q.from_file and q.rows is None
    weight, scale_inv = quantize_fp8(plain["layers.0.attn.q_proj.weight"], BLOCK)
    assert torch.equal(q.weight.view(torch.uint8), weight.view(torch.uint8)) and torch.equal(q.scale_inv, scale_inv)
    # a float .to() changes the compute dtype only; clone keeps the row order; copy_ of dense values quantizes them
    # in the order the destination holds its rows
    exact = held(load(path, quantize=True)[0])["layers.0.attn.q_proj.weight"]
    half = exact.to(torch.bfloat16)
    assert type(half) is FP8Weight and half.dtype == torch.bfloat16 and half.weight.data_ptr() != exact.weight.data_ptr()
    assert torch.equal(half.dequantize(torch.float32), exact.dequantize())
    by_codec = dequantize_fp8(exact.weight, exact.scale_inv, BLOCK, torch.bfloat16)[exact.rows.long()]
    assert torch.equal(half.dequantize(), by_codec)  # the lean dequantization is the codec's, bitwise, in bf16 too
    copy = exact.clone()
    assert copy.rows is not None and torch.equal(copy.dequantize(), exact.dequantize())
    values = exact.dequantize() * 1.5
    copy.copy_(values)
    file_order = torch.empty_like(values).index_copy_(0, copy.rows.long(), values)
    assert not copy.from_file and torch.equal(copy.weight.view(torch.uint8), quantize_fp8(file_order, BLOCK)[0].view(torch.uint8))
    assert torch.equal(copy.dequantize(), dequantize_fp8(*quantize_fp8(file_order, BLOCK), BLOCK, torch.float32)[copy.rows.long()])
    with pytest.raises(RuntimeError, match="an FP8Weight is a frozen base weight"):
        copy.add_(1)


def test_row_plans_say_why_not():
    assert row_plan(Identity(), [(64, 8)], BLOCK)[0] == (0, 0, 64, None)
    assert row_plan(Split((32, 16, 16)), [(64, 8)], BLOCK) == [(0, 0, 32, None), (0, 32, 48, None), (0, 48, 64, None)]
    assert row_plan(Split((24, 40)), [(64, 8)], BLOCK) == ["rows 0:24 of the file's 64 are not whole blocks of 16",
                                                           "rows 24:64 of the file's 64 are not whole blocks of 16"]
    assert row_plan(Interleave(2), [(64, 8)], BLOCK)[0] == "its rows are not a range of the file's rows"
    j, lo, hi, order = row_plan(RopePermute(2, 32), [(64, 8)], BLOCK)[0]
    assert (j, lo, hi) == (0, 0, 64) and torch.equal(order, RopePermute(2, 32).forward([torch.arange(64)])[0])


def test_refusals_are_one_line(checkpoints, tmp_path):
    path = checkpoints / "llama_hd16"
    checkpointer = HFCheckpointer(path, output_dir=tmp_path)
    checkpointer.load_checkpoint()
    with torch.device("meta"):
        model = build_model(path)
    with pytest.raises(CheckpointError, match=r"^quantize_base=fp8 is single-process; under torchrun"):
        quantize_base(model, "bf16", "fp8", shards=2, checkpointer=checkpointer)
    dense = HFCheckpointer(ROOT / "assets/tiny_llama", output_dir=tmp_path)
    dense.load_checkpoint()
    with pytest.raises(CheckpointError, match=r"^quantize_base=fp8 holds a block-FP8 checkpoint's weights as its own "
                                              r"bytes, and .*tiny_llama is not quantized; quantize_base=nf4 holds"):
        quantize_base(model, "bf16", "fp8", checkpointer=dense)


def test_the_recipe_trains_over_an_fp8_base_and_writes_its_bytes_back(tmp_path, capsys):
    base = tmp_path / "base"
    write_fp8_checkpoint(base, tiny_family_config("qwen3", vocab_size=512, max_position_embeddings=256), block=BLOCK)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / f, base / f)
    out = tmp_path / "out"
    code = lora_finetune.main(["--config", str(ROOT / "configs/tiny_qlora.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"output_dir={out}", "epochs=1", "max_steps_per_epoch=2", "batch_size=4",
                               "lora.targets=[q_proj,v_proj]", "lr_scheduler.num_warmup_steps=1", "quantize_base=fp8",
                               "checkpointer.output_quantization=requantize"])  # the default keeps adapted weights unquantized (test_fp8)
    printed = capsys.readouterr().out
    assert code == 0
    assert "fp8: 21 weights held as the file's bytes, 0 re-quantized" in printed and "export verified" in printed, printed
    merged = out / "step_2" / "merged"
    assert json.loads((merged / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    before, after = file_tensors(base), file_tensors(merged)
    assert sorted(after) == sorted(before)
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    differs = {k for k in before if not torch.equal(as_bytes(before[k]), as_bytes(after[k]))}
    assert differs and all(".q_proj." in k or ".v_proj." in k for k in differs)  # the adapted ones, re-quantized


def test_an_adapter_trained_over_the_fp8_base_is_peft_s_over_the_release(checkpoints, tmp_path):
    """LoRA over the FP8 base, against PEFT over transformers' reading of the same release (dequantized): the
    adapter loads with PeftModel.from_pretrained and computes our logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from tests.conftest import save_adapter

    path = checkpoints / "qwen3_hd24"
    model, _, _ = load(path, quantize=True)
    assert any(isinstance(p, FP8Weight) for p in model.parameters())
    save_adapter(tmp_path / "adapter", model, HFCheckpointer(path, output_dir=tmp_path / "out").hf_converter(), str(path))
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        diff = (model.eval()(TOKENS) - peft(TOKENS).logits).abs().max().item()
    print(f"\nLoRA over the FP8 base vs PEFT over transformers' dequantized release: max |dlogit| {diff:.3g}")
    assert diff <= 1e-5
