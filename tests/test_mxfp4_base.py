"""quantize_base: mxfp4: a gpt-oss model whose experts are held in MXFP4 (``MXFP4Weight``) computes, in every MoE
implementation, the logits and LoRA gradients of the model holding the dequantized experts, holds about a quarter
of their bf16 bytes, keeps no dense copy of them alive for the backward, and trains in the LoRA recipe, whose
merged/ writes the input's expert bytes back untouched."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from recipes import lora_finetune
from waypoint.checkpointers import CheckpointError, HFCheckpointer, build_model, load_into
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.models import moe as moe_module
from waypoint.models.lora import apply_lora, init_adapters, load_adapter_state
from waypoint.models.mxfp4_weight import EXPERT_WEIGHTS, MXFP4Weight
from waypoint.models.quantized_base import is_quantized_base
from waypoint.training.quantize import quantize_base
from tests.conftest import ROOT, tiny_family_config, write_mxfp4_checkpoint

TARGETS = ["q_proj", "v_proj", "experts_gate_up", "experts_down"]
TOKENS = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(7))
EVERYTHING = lambda key: True  # noqa: E731 (read the files' integer bytes too)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny MXFP4 gpt-oss checkpoint (random blocks and scales) with the tiny Llama's tokenizer."""
    path = tmp_path_factory.mktemp("mxfp4") / "base"
    write_mxfp4_checkpoint(path, tiny_family_config("gpt_oss", vocab_size=512, max_position_embeddings=256))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / name, path / name)
    return path


def load(path, quantize: bool, targets=TARGETS, dtype="fp32"):
    """As recipes/lora_finetune.py builds it: meta model, adapters, quantize_base placeholders, one load; the same
    random adapters (B too) whichever the base."""
    state = HFCheckpointer(path, output_dir=path.parent / "out").load_checkpoint()["model"]
    with torch.device("meta"):
        model = build_model(path)
    apply_lora(model, targets, 4, 8.0)
    lines = quantize_base(model, dtype, "mxfp4" if quantize else None)
    report = load_into(model, state, dtype=dtype, fill_later=[k for k in model.state_dict() if ".lora_" in k])
    init_adapters(model)
    generator = torch.Generator().manual_seed(1)
    load_adapter_state(model, {k: torch.randn(v.shape, generator=generator) * 0.1
                               for k, v in model.state_dict().items() if ".lora_" in k})
    return model, report, lines


def expert_keys(model):
    return [f"layers.{i}.moe.{w}" for i in range(model.args.n_layers) for w in EXPERT_WEIGHTS]


def set_impl(model, impl):
    for layer in model.layers:
        layer.moe.impl = impl


def forward_backward(model, hook=None):
    model.zero_grad(set_to_none=True)
    with saved_tensors_hooks(hook or (lambda t: t), lambda t: t):
        logits = model(TOKENS)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def models(base):
    return load(base, quantize=False)[0], load(base, quantize=True)


def test_the_experts_are_mxfp4_and_hold_a_quarter_of_their_bf16_bytes(models):
    dense, (model, report, lines) = models
    keys = expert_keys(model)
    assert lines == [f"mxfp4: {len(keys)} expert weights held in MXFP4 (4.25 bits a value: blocks of 32 sharing a scale); "
                     "the rest in fp32"]
    assert sorted(report.quantized) == sorted(keys) and not set(keys) & set(report.loaded)
    assert report.lines()[1].startswith(f"quantized to MXFP4 as loaded: {len(keys)} tensors: ")
    assert all(type(model.get_parameter(k)) is MXFP4Weight and not model.get_parameter(k).requires_grad for k in keys)
    assert not any(is_quantized_base(p) for n, p in model.named_parameters() if n not in keys)
    held = sum(model.get_parameter(k).blocks.untyped_storage().nbytes() + model.get_parameter(k).scales.untyped_storage().nbytes()
               for k in keys)  # measured: the storages the weights really hold
    bf16 = sum(dense.get_parameter(k).numel() * 2 for k in keys)
    print(f"\nexperts held in MXFP4: {held} bytes, {held / bf16:.4f} of their bf16 bytes ({bf16})")
    assert held == sum(model.get_parameter(k).held_nbytes for k in keys) and held / bf16 == pytest.approx(4.25 / 16)
    # the values are the file's: the MXFP4 round trip is exact for the checkpoint's blocks
    for key in keys:
        assert torch.equal(model.get_parameter(key).dequantize(), dense.get_parameter(key))


@pytest.mark.parametrize("impl", ["loop", "padded", "grouped"])
def test_logits_and_lora_gradients_are_the_dense_models(models, impl):
    dense, (model, _, _) = models
    set_impl(dense, impl)
    set_impl(model, impl)
    want, want_grads = forward_backward(dense)
    got, grads = forward_backward(model)
    diff = (got - want).abs().max().item()
    grad_diff = max((grads[n] - want_grads[n]).abs().max().item() for n in want_grads)
    print(f"\n{impl}: max |logits diff| {diff:.3g}, max |LoRA grad diff| {grad_diff:.3g} over {len(grads)} adapter weights")
    assert sorted(grads) == sorted(want_grads) and any(".experts_gate_up." in n for n in grads)
    assert all(grads[n].abs().sum() > 0 for n in grads)
    assert diff <= 1e-6 and grad_diff <= 1e-6


def saved_bytes(model, impl) -> int:
    """Bytes of the tensors autograd saves for the backward that are not the model's parameters (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters() if not isinstance(p, MXFP4Weight)}
    storages: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, MXFP4Weight):  # an MXFP4Weight saved is a parameter's packed bytes (or a slice of them)
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
        return t

    set_impl(model, impl)
    forward_backward(model, pack)
    return sum(storages.values())


@pytest.mark.parametrize("impl", ["loop", "padded", "grouped"])
def test_the_backward_keeps_no_dense_copy_of_the_experts(models, impl, monkeypatch):
    dense, (model, _, _) = models
    expert_bytes = sum(dense.get_parameter(k).numel() * 4 for k in expert_keys(dense))  # fp32
    want, got = saved_bytes(dense, impl), saved_bytes(model, impl)
    print(f"\n{impl}: saved for backward beside the parameters: dense {want} bytes, MXFP4 {got} bytes "
          f"(the experts dequantized: {expert_bytes})")
    assert got <= want
    if impl == "loop":
        return
    # the negative control: the same products through the stacked weight's dense fallback save every layer's experts
    monkeypatch.setattr(moe_module, "experts_mm", lambda x, w, offs=None, mm=None:
                        torch.bmm(x, w.transpose(-2, -1)) if offs is None else mm(x, w.transpose(-2, -1), offs=offs))
    assert saved_bytes(model, impl) >= want + expert_bytes


def test_refusals_are_one_line(base):
    with torch.device("meta"):
        model = build_model(base)
    with pytest.raises(CheckpointError, match=r"^quantize_base=mxfp4 is single-process; under torchrun"):
        quantize_base(model, "bf16", "mxfp4", shards=2)
    with torch.device("meta"):
        llama = build_model(ROOT / "assets/tiny_llama")
    with pytest.raises(CheckpointError, match=r"^quantize_base=mxfp4 holds mixture-of-experts weights .* this model has none"):
        quantize_base(llama, "bf16", "mxfp4")


def test_the_recipe_trains_over_mxfp4_experts_and_writes_their_bytes_back(base, tmp_path, capsys):
    out = tmp_path / "run"
    code = lora_finetune.main(["--config", str(ROOT / "configs/tiny_qlora.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", f"output_dir={out}", "epochs=1",
                               "max_steps_per_epoch=2", "batch_size=2", "dataset.max_seq_len=64",
                               "lr_scheduler.num_warmup_steps=1", "quantize_base=mxfp4"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "mxfp4: 6 expert weights held in MXFP4" in printed and "export verified" in printed, printed
    merged = out / "step_2/merged"
    index = "model.safetensors.index.json"
    assert json.loads((merged / index).read_text())["weight_map"] == json.loads((base / index).read_text())["weight_map"]
    packed = 0
    for f in sorted(base.glob("*.safetensors")):
        before, after = read_tensors(f, packed=EVERYTHING), read_tensors(merged / f.name, packed=EVERYTHING)
        assert sorted(after) == sorted(before), f.name
        for key in [k for k in before if k.endswith(("_blocks", "_scales"))]:
            assert after[key].dtype == torch.uint8 and torch.equal(after[key], before[key]), key
            packed += 1
    assert packed == 8  # 2 layers x gate_up / down x blocks / scales
    assert json.loads((merged / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
