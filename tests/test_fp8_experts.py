"""A MoE's experts in block FP8, one key each (the hub's releases) or packed (``mlp.experts.gate_up_proj`` beside
``gate_up_proj_scale_inv``, as transformers names them in memory): both read as the same model (transformers is the
oracle for the per-expert layout; it ignores packed FP8 scales, so the packed one must equal it), both written back
in their own layout byte for byte, and with ``quantize_base: fp8`` the stacked experts held as the file's own bytes,
computing bitwise the dense load's logits and LoRA gradients in every MoE implementation without saving a dense
copy for the backward, and written back unchanged by the LoRA recipe's merged/."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from recipes import lora_finetune
from waypoint.checkpointers import HFCheckpointer, build_model, load_into, load_model
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.fp8 import quantize_fp8
from waypoint.models import moe, packed_weight
from waypoint.models.fp8_weight import FP8Weight
from waypoint.models.lora import apply_lora, init_adapters, load_adapter_state
from waypoint.training.quantize import quantize_base
from tests.conftest import ROOT, pack_fp8_experts, tiny_family_config, write_fp8_checkpoint

BLOCK = (16, 16)
TOKENS = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(7))
EXPERTS = ("w1", "w3", "w2")
# every latent projection in whole blocks of 16 (transformers' dequantization needs them; ours does not)
WHOLE_BLOCKS = {"deepseek_v3": dict(q_lora_rank=32, qk_rope_head_dim=16)}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Per-expert FP8 Qwen3-MoE and DeepSeek-V3 (latent attention, a dense first layer, shared experts), and the
    Qwen3-MoE one packed; with transformers' fp32 logits of the per-expert ones."""
    root = tmp_path_factory.mktemp("fp8_experts")
    logits = {}
    for family in ("qwen3_moe", "deepseek_v3"):
        hf = write_fp8_checkpoint(root / family, tiny_family_config(family, **WHOLE_BLOCKS.get(family, {})), block=BLOCK)
        with torch.no_grad():
            logits[family] = hf(TOKENS).logits
    pack_fp8_experts(root / "qwen3_moe", root / "qwen3_moe_packed")
    logits["qwen3_moe_packed"] = logits["qwen3_moe"]
    return root, logits


def files_of(path):
    return {f.name: read_tensors(f) for f in sorted(path.glob("*.safetensors"))}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("release", ["qwen3_moe", "qwen3_moe_packed", "deepseek_v3"])
def test_fp8_experts_read_with_transformers_logits(releases, release):
    root, logits = releases
    with torch.no_grad():
        diff = (load_model(root / release, dtype=torch.float32).eval()(TOKENS) - logits[release]).abs().max().item()
    print(f"\n{release} in block FP8: max |native - transformers (over the per-expert release)| logit = {diff:.3g}")
    assert diff <= 1e-5


def test_packed_fp8_experts_go_back_as_they_came(releases, tmp_path):
    root, _ = releases
    path = root / "qwen3_moe_packed"
    ckpt = HFCheckpointer(path, output_dir=tmp_path / "out")
    state = dict(ckpt.load_checkpoint()["model"])
    before, after = files_of(path), files_of(ckpt.save_checkpoint({"model": state}, step=1))
    assert sorted(after) == sorted(before) and all(sorted(after[n]) == sorted(before[n]) for n in before)
    assert all(torch.equal(as_bytes(after[n][k]), as_bytes(t)) for n in before for k, t in before[n].items())
    state["layers.2.moe.w1"] = state["layers.2.moe.w1"].float() * 1.5  # the gate half of the packed gate_up only
    after = files_of(ckpt.save_checkpoint({"model": state}, step=2))
    differs = {k for n in before for k in before[n] if not torch.equal(as_bytes(before[n][k]), as_bytes(after[n][k]))}
    assert differs == {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.gate_up_proj_scale_inv"}
    written = {k: t for n in after for k, t in after[n].items() if k.startswith("model.layers.2.mlp.experts.gate_up")}
    # re-quantized per block with transformers' rounding from what the model holds (gate rows, then up rows)
    weight, scale_inv = quantize_fp8(torch.cat([state["layers.2.moe.w1"], state["layers.2.moe.w3"]], dim=1), BLOCK)
    assert torch.equal(as_bytes(written["model.layers.2.mlp.experts.gate_up_proj"]), as_bytes(weight))
    assert torch.equal(written["model.layers.2.mlp.experts.gate_up_proj_scale_inv"], scale_inv)


def load(path, quantize: bool, targets=("q_proj", "v_proj", "w2")):
    """As recipes/lora_finetune.py builds it, the same random adapters whichever the base."""
    checkpointer = HFCheckpointer(path, output_dir=path.parent / "out")
    state = checkpointer.load_checkpoint()["model"]
    with torch.device("meta"):
        model = build_model(path)
    apply_lora(model, list(targets), 4, 8.0)
    lines = quantize_base(model, "fp32", "fp8" if quantize else None, checkpointer=checkpointer)
    report = load_into(model, state, dtype="fp32", fill_later=[k for k in model.state_dict() if ".lora_" in k])
    init_adapters(model)
    generator = torch.Generator().manual_seed(1)
    load_adapter_state(model, {k: torch.randn(v.shape, generator=generator) * 0.1
                               for k, v in model.state_dict().items() if ".lora_" in k})
    return model, report, lines


def forward_backward(model, impl, hook=None):
    for module in model.modules():
        if hasattr(module, "resolved_impl"):
            module.impl = impl
    model.zero_grad(set_to_none=True)
    with saved_tensors_hooks(hook or (lambda t: t), lambda t: t):
        logits = model(TOKENS)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def saved(model, impl) -> Counter:
    """The (shape, dtype) of each tensor autograd saves for the backward that is not a parameter: a dequantized copy
    of a held weight would be one more than the dense model saves."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters() if not isinstance(p, FP8Weight)}
    seen: Counter = Counter()

    def pack(t):
        if not isinstance(t, FP8Weight) and t.untyped_storage().data_ptr() not in params:
            seen[tuple(t.shape), t.dtype] += 1
        return t

    forward_backward(model, impl, pack)
    return seen


@pytest.mark.parametrize("release", ["qwen3_moe", "qwen3_moe_packed", "deepseek_v3"])
def test_quantize_base_fp8_holds_the_experts_as_the_files_bytes(releases, release):
    root, logits = releases
    path = root / release
    dense, _, _ = load(path, quantize=False)
    model, report, lines = load(path, quantize=True)
    held = {n: p for n, p in model.named_parameters() if isinstance(p, FP8Weight)}
    experts = {n: p for n, p in held.items() if n.rpartition(".")[2] in EXPERTS}
    assert lines[0].startswith(f"fp8: {len(held)} weights held as the file's bytes, 0 re-quantized"), lines
    assert experts and all(p.ndim == 3 and p.from_file and not p.requires_grad for p in experts.values())
    assert sorted(report.quantized) == sorted(held)
    files = {k: t for f in sorted(path.glob("*.safetensors")) for k, t in read_tensors(f).items()}
    for name, p in experts.items():
        layer, leaf = name.split(".")[1], name.rpartition(".")[2]
        prefix = f"model.layers.{layer}.mlp.experts"
        if release.endswith("packed"):  # gate rows, then up rows of each expert's gate_up
            key, half = (f"{prefix}.down_proj", slice(None)) if leaf == "w2" else \
                (f"{prefix}.gate_up_proj", slice(0, p.shape[1]) if leaf == "w1" else slice(p.shape[1], None))
            blocks = slice(None) if leaf == "w2" else slice(half.start // BLOCK[0] if half.start else 0,
                                                            half.stop // BLOCK[0] if half.stop else None)
            weight, scales = as_bytes(files[key])[:, half], files[key + "_scale_inv"][:, blocks]
        else:
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[leaf]
            weight = torch.stack([as_bytes(files[f"{prefix}.{e}.{proj}.weight"]) for e in range(p.shape[0])])
            scales = torch.stack([files[f"{prefix}.{e}.{proj}.weight_scale_inv"] for e in range(p.shape[0])])
        assert torch.equal(as_bytes(p.weight), weight) and torch.equal(p.scale_inv, scales), name
        assert torch.equal(p.dequantize(), dense.get_parameter(name)), name
    for impl in ("loop", "padded", "grouped"):
        want, want_grads = forward_backward(dense, impl)
        got, grads = forward_backward(model, impl)
        assert torch.equal(got, want) and sorted(grads) == sorted(want_grads), impl
        assert all(torch.equal(grads[k], want_grads[k]) for k in grads), impl
    assert not saved(model, "grouped") - saved(dense, "grouped")  # no dense copy of a held weight kept
    nbytes = sum(p.held_nbytes for p in experts.values())
    print(f"\n{release}: {len(experts)} expert stacks held in FP8 ({nbytes} bytes, "
          f"{nbytes / sum(p.numel() * 2 for p in experts.values()):.3f} of bf16); logits and "
          f"{len(grads)} LoRA gradients bitwise the dense load's in loop, padded and grouped, saving no dense copy")
    # the negative control: the experts' products on their dequantized values save a dense copy of each stack
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "experts_mm", lambda x, w, offs=None, mm=None: packed_weight.experts_mm(
            x, w.dequantize() if isinstance(w, FP8Weight) else w, offs, mm))
        extra = saved(model, "padded") - saved(dense, "padded")
    assert sum(n for (shape, _), n in extra.items() if len(shape) == 3 and shape[0] == model.args.n_experts) >= 2


def test_the_lora_recipe_over_fp8_experts_writes_their_bytes_back(tmp_path, capsys):
    base = tmp_path / "base"
    write_fp8_checkpoint(base, tiny_family_config("deepseek_v3", vocab_size=512, max_position_embeddings=256,
                                                  **WHOLE_BLOCKS["deepseek_v3"]), block=BLOCK)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / f, base / f)
    out = tmp_path / "out"
    code = lora_finetune.main(["--config", str(ROOT / "configs/tiny_qlora.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"output_dir={out}", "epochs=1", "max_steps_per_epoch=2", "batch_size=2",
                               "lora.targets=[q_b_proj,output_proj]", "lr_scheduler.num_warmup_steps=1",
                               "quantize_base=fp8", "checkpointer.output_quantization=requantize"])  # (default: test_fp8)
    printed = capsys.readouterr().out
    assert code == 0, printed
    held = sum(1 for line in printed.splitlines() if line.startswith("fp8: ") and ", 0 re-quantized" in line)
    assert held == 1 and "export verified" in printed, printed
    assert json.loads((out / "step_2" / "merged" / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    before, after = files_of(base), files_of(out / "step_2" / "merged")
    assert sorted(after) == sorted(before)
    differs = {k for n in before for k in before[n] if not torch.equal(as_bytes(before[n][k]), as_bytes(after[n][k]))}
    # the adapted projections re-quantized; every expert, shared or routed, and the rest byte for byte
    assert differs and all(".q_b_proj." in k or ".o_proj." in k for k in differs), sorted(differs)
