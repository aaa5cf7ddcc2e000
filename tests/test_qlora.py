"""QLoRA: a frozen NF4 base computes what a model holding the dequantized weights computes; the recipe trains,
resumes bit-exactly without ever saving the 4-bit base, and merges onto the input's full-precision weights
exactly as PEFT merges onto the full-precision base (not onto the 4-bit-rounded one); an optimizer built before
a conversion keeps updating the model's live parameters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from recipes import lora_finetune
from waypoint.checkpointers import HFCheckpointer, build_model, load_into
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.models.lora import apply_lora, init_adapters, load_adapter_state
from waypoint.models.nf4 import LINEARS, is_nf4, nf4_nbytes, nf4_tensor_class, quantize_linears
from waypoint.models.swap import swapping_conversions
from tests.conftest import ROOT, sigterm_at_step, tiny_family_config, write_family_checkpoint

TINY = ROOT / "assets/tiny_llama"
BLOCK, SCALER_BLOCK = 64, 8  # the tiny models' k/v projections have too few blocks for the usual 256


def qlora_model(base, dtype, targets=("q_proj", "v_proj"), quantize=True):
    """As recipes/lora_finetune.py builds it: meta model, adapters, NF4 placeholders, then one load."""
    checkpointer = HFCheckpointer(base, output_dir=base.parent / "out")
    state = checkpointer.load_checkpoint()["model"]
    with torch.device("meta"):
        model = build_model(base)
    apply_lora(model, list(targets), 4, 8.0)
    done = quantize_linears(model, dtype, BLOCK, SCALER_BLOCK) if quantize else None
    keys = [k for k in model.state_dict() if ".lora_" in k]
    report = load_into(model, state, dtype=dtype, fill_later=keys)
    init_adapters(model)
    return model.eval(), done, report, state


def random_adapters(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=generator) * 0.1 for k, v in model.state_dict().items() if ".lora_" in k}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nf4_base_computes_what_its_dequantized_weights_compute(tmp_path, family, dtype, tokens):
    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config(family))
    qlora, done, report, _ = qlora_model(base, dtype)
    n_linears = base_linears(qlora)
    assert n_linears == 7 * qlora.args.n_layers
    assert len(done.quantized) == n_linears and not done.kept, done.kept
    assert sorted(report.quantized) == sorted(done.quantized)
    assert all(is_nf4(qlora.get_parameter(k)) for k in done.quantized)
    assert all(not is_nf4(p) and p.dtype == dtype for n, p in qlora.named_parameters() if n not in done.quantized
               and ".lora_" not in n)  # embeddings, norms, biases, head: the compute dtype
    adapters = random_adapters(qlora)
    load_adapter_state(qlora, adapters)

    # The reference: the plain model with each quantized weight replaced by what the NF4 one stands for.
    reference, _, _, _ = qlora_model(base, dtype, quantize=False)
    plain = {k: reference.get_parameter(k).detach().clone() for k in done.quantized}
    with torch.no_grad():
        for key in done.quantized:
            reference.get_parameter(key).copy_(qlora.get_parameter(key).get_original_weight())  # 4-bit values x scales
    load_adapter_state(reference, adapters)
    with torch.no_grad():
        ours, theirs = qlora(tokens).float(), reference(tokens).float()
        for key, weight in plain.items():
            reference.get_parameter(key).copy_(weight)
        unquantized = reference(tokens).float()
    diff, quant_effect = (ours - theirs).abs().max().item(), (ours - unquantized).abs().max().item()
    # the same weights and ops; in bf16 the bias is added after the NF4 matmul's rounding, not fused into it
    tolerance = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps * theirs.abs().max().item()
    print(f"\n{family} {dtype}: NF4 model vs the model on its dequantized weights: max |logits diff| {diff:.3g} "
          f"(tolerance {tolerance:.3g}); vs the unquantized model: {quant_effect:.3g}")
    assert diff <= tolerance
    assert quant_effect > 5 * max(diff, 1e-3), "the 4-bit weights are not what the model computes with"
    held = sum(nf4_nbytes(qlora.get_parameter(k)) for k in done.quantized)
    full = sum(plain[k].numel() * 2 for k in done.quantized)
    assert held < 0.35 * full, f"NF4 holds {held} bytes for {full} bf16 bytes"


def test_blocks_that_do_not_fit_stay_in_the_compute_dtype_and_are_named(tmp_path):
    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config("llama"))
    with torch.device("meta"):
        model = build_model(base)
    done = quantize_linears(model, torch.bfloat16, 64, 256)  # q: 64 blocks of 64, not a multiple of 256
    assert not done.quantized and done.kept["layers.0.attn.q_proj.weight"] == "its 64 blocks do not divide into scaler blocks of 256"
    done = quantize_linears(model, torch.bfloat16, 64, 8, include_output=True, shards=3)
    assert "layers.0.attn.k_proj.weight" in done.kept and "processes" in done.kept["layers.0.attn.k_proj.weight"]
    assert "output.weight" in done.quantized or "output.weight" in done.kept


def test_an_optimizer_built_before_a_swapping_conversion_keeps_training_the_live_parameters(tmp_path):
    """The failure mode the PyTorch swap_tensors recipe opens with: a conversion that replaces the parameter
    objects leaves the optimizer stepping tensors the model no longer uses."""
    model, _, _, state = qlora_model(TINY, torch.float32)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.5)
    fresh = {k: v + 1.0 for k, v in model.state_dict().items() if ".lora_" in k}
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))

    def step_changes_the_model() -> bool:
        before = {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" in k}
        optimizer.zero_grad()
        model(tokens).float().logsumexp(-1).mean().backward()
        optimizer.step()
        return all(not torch.equal(before[k], v) for k, v in model.state_dict().items() if ".lora_B" in k)

    with swapping_conversions():  # as every recipe runs (waypoint.cli.entry)
        model.load_state_dict(fresh, strict=False, assign=True)  # a new tensor for every adapter
        model.to(torch.device("cpu"))  # a device move: NF4 weights are re-made, not copied in place
        assert all(is_nf4(model.get_parameter(k)) for k in ("layers.0.attn.q_proj.weight", "layers.3.mlp.w2.weight"))
        assert [id(p) for p in model.parameters() if p.requires_grad] == [id(p) for p in trainable]
        assert step_changes_the_model()
    with swapping_conversions(False):  # the negative control: without swapping the same load strands the optimizer
        model.load_state_dict(fresh, strict=False, assign=True)
        assert not step_changes_the_model()


def run(base, out, *overrides, stop_at=None):
    with sigterm_at_step(stop_at):
        return lora_finetune.main(["--config", str(ROOT / "configs/tiny_qlora.yaml"), f"checkpointer.checkpoint_dir={base}",
                                   f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", f"output_dir={out}", "epochs=1",
                                   "max_steps_per_epoch=6", "batch_size=4", "lr_scheduler.num_warmup_steps=1", *overrides])


def family_base(path, family):
    write_family_checkpoint(path, tiny_family_config(family, vocab_size=512, max_position_embeddings=256))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, path / f)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_qlora_recipe_resumes_bit_exactly_and_merges_from_the_full_precision_base(tmp_path, family, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = TINY if family == "llama" else family_base(tmp_path / "base", family)
    targets = "lora.targets=[q_proj,k_proj,v_proj,output_proj,w1,w2,w3]"
    assert run(base, tmp_path / "straight", targets) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "straight/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2]), f"the loss did not fall: {losses}"

    assert run(base, tmp_path / "stopped", targets, stop_at=3) == 75
    step_3 = tmp_path / "stopped/step_3"
    assert sorted(p.name for p in step_3.iterdir()) == ["MANIFEST.json", "adapter_config.json", "adapter_model.safetensors",
                                                        "chat_template.jinja", "recipe_state.pt", "tokenizer.json",
                                                        "tokenizer_config.json"]  # the 4-bit base is re-derived, never saved
    assert run(base, tmp_path / "stopped", targets) == 0
    final, expected = tmp_path / "stopped/step_6", tmp_path / "straight/step_6"
    index = "model.safetensors.index.json"  # the merged model: the input's files and key -> file map
    assert sorted(p.name for p in (final / "merged").glob("*.safetensors")) == sorted(p.name for p in base.glob("*.safetensors"))
    assert json.loads((final / "merged" / index).read_text())["weight_map"] == json.loads((base / index).read_text())["weight_map"]
    for name in ["adapter_model.safetensors"] + [f"merged/{p.name}" for p in base.glob("*.safetensors")]:
        mine, theirs = read_tensors(final / name), read_tensors(expected / name)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), f"{name}: not bit-exact"

    # The merge starts from the input's full-precision weights: PEFT's merge on the full-precision base ...
    merged = {k: v for f in sorted((final / "merged").glob("*.safetensors")) for k, v in read_tensors(f).items()}
    original = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in read_tensors(f).items()}
    adapter = read_tensors(final / "adapter_model.safetensors")
    scaling = (lambda c: c["lora_alpha"] / c["r"])(json.loads((final / "adapter_config.json").read_text()))
    deltas = {k.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight"):
              adapter[k.replace("lora_A", "lora_B")].float() @ adapter[k].float() * scaling for k in adapter if ".lora_A." in k}
    assert len(deltas) == 7 * json.loads((base / "config.json").read_text())["num_hidden_layers"]
    peft_merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), final).merge_and_unload().state_dict()
    to_peft = max((merged[k] - peft_merged[k]).abs().max().item() for k in merged)
    # ... and not a merge onto the 4-bit-rounded base, which differs by the quantization error W - deq(nf4(W))
    NF4Tensor = nf4_tensor_class()
    error, gap = 0.0, 0.0
    for key, delta in deltas.items():
        rounded = NF4Tensor.from_tensor(original[key], BLOCK, SCALER_BLOCK).get_original_weight()
        on_rounded = rounded + delta
        gap = max(gap, ((merged[key] - on_rounded) - (original[key] - rounded)).abs().max().item())
        error = max(error, (merged[key] - on_rounded).abs().max().item() / original[key].abs().max().item())
    print(f"\n{family}: our merge vs PEFT's merge on the full-precision base: max |diff| {to_peft:.3g}; vs a merge onto "
          f"the NF4-rounded base: max |diff| / max |W| = {error:.3g}, which is W - deq(nf4(W)) to {gap:.3g}")
    assert to_peft <= 1e-5
    assert 1e-3 < error < 0.2 and gap <= 1e-5
    assert all(torch.equal(merged[k], original[k]) for k in merged if k not in deltas)  # untouched: the input's bits
    if family != "llama":
        return

    # scripts/merge_lora.py needs nothing special for a QLoRA adapter: the same merge, bit for bit
    from scripts.merge_lora import main as merge_lora

    assert merge_lora([str(base), str(final), str(tmp_path / "offline")]) == 0
    offline = {k: v for f in sorted((tmp_path / "offline").glob("*.safetensors")) for k, v in read_tensors(f).items()}
    assert offline.keys() == merged.keys() and all(torch.equal(offline[k], merged[k]) for k in merged)
    # the adapter loads in PEFT over the bf16 base too (no bitsandbytes anywhere)
    bf16 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), final)
    loaded = {k.replace(".default", ""): v for k, v in bf16.state_dict().items() if ".lora_" in k}
    assert loaded.keys() == adapter.keys() and all(torch.equal(loaded[k].float(), adapter[k].float()) for k in adapter)
    # another base (not 4-bit, or other blocks) is another model: resuming onto it is refused
    capsys.readouterr()
    assert run(base, tmp_path / "stopped", targets, "quantize_base=null") == 1
    assert "the config changed quantize_base" in capsys.readouterr().err


@pytest.mark.slow
def test_an_nf4_load_peaks_below_a_bf16_load_of_the_same_checkpoint(monkeypatch, capsys):
    """benchmarks/bench_qlora.py at a test's size: each load in a process of its own, every weight read; the NF4
    load's peak stays within the 4-bit model + the largest tensor + the quantizer's fixed workspace."""
    from benchmarks import bench_qlora
    from tests.launch import forked_fresh_process

    monkeypatch.setattr(bench_qlora, "fresh_process", forked_fresh_process(ROOT / "benchmarks/bench_qlora.py"))
    bench_qlora.main(["--size-gb", "0.1", "--no-steps"])
    printed = capsys.readouterr().out
    print("\n" + "\n".join(printed.splitlines()[:-1]))  # shown with a failure, as the captured output is
    got = json.loads(printed.splitlines()[-1])
    bf16 = got["bf16_peak_rss_gb"] - got["bf16_runtime_gb"]
    nf4 = got["nf4_peak_rss_gb"] - got["nf4_runtime_gb"]
    bound = got["nf4_held_gb"] + got["nf4_largest_gb"] + got["nf4_workspace_gb"]
    assert bf16 >= 0.9 * got["bf16_held_gb"], "the bf16 load did not read its weights"
    assert nf4 < bf16 and nf4 <= bound + 0.02, f"NF4 load peak {nf4:.3f} GB, bf16 {bf16:.3f} GB, bound {bound:.3f} GB"


SHIPPED = {"llama2_7b_qlora": "llama.llama2_7b", "llama3_8b_qlora": "llama.llama3_8b", "mistral_7b_qlora": "mistral.mistral_7b",
           "qwen2_7b_qlora": "qwen2.qwen2_7b", "llama3_2_1b_chat_qlora": "llama.llama3_2_1b",
           "qwen2_5_7b_chat_qlora": "qwen2.qwen2_5_7b", "qwen3_8b_chat_qlora": "qwen3.qwen3_8b",
           "gemma2_9b_chat_qlora": "gemma2.gemma2_9b", "gemma3_1b_chat_qlora": "gemma3.gemma3_1b",
           "phi3_mini_chat_qlora": "phi3.phi3_mini_4k", "phi4_chat_qlora": "phi3.phi4_14b",
           "qwen3_5_27b_chat_qlora": "qwen3_5.qwen3_5_27b", "gemma4_31b_chat_qlora": "gemma4.gemma4_31b"}


def base_linears(model) -> int:
    """How many of the model's modules are base linears NF4 holds (``LINEARS``): attention and MLP in every layer,
    Gated DeltaNet's three in its layers."""
    return sum(1 for name, module in model.named_modules() if name.rpartition(".")[2] in LINEARS and hasattr(module, "weight"))


def test_every_shipped_qlora_config_holds_every_linear_of_its_model_in_4_bits():
    """The published sizes' shapes divide into the configs' NF4 blocks (nothing silently left in bf16)."""
    import importlib

    from omegaconf import OmegaConf

    assert sorted(p.stem for p in (ROOT / "configs").glob("*_qlora.yaml") if not p.stem.startswith("tiny_")) == sorted(SHIPPED)
    for stem, builder in SHIPPED.items():
        cfg = OmegaConf.load(ROOT / f"configs/{stem}.yaml")
        module, _, name = builder.rpartition(".")
        with torch.device("meta"):
            model = getattr(importlib.import_module(f"waypoint.families.{module}"), name)()
        done = quantize_linears(model, torch.bfloat16, cfg.nf4.block_size, cfg.nf4.scaler_block_size, cfg.nf4.output)
        assert cfg.quantize_base == "nf4" and not done.kept, f"{stem}: {done.kept}"
        assert len(done.quantized) == base_linears(model) >= 6 * model.args.n_layers, stem  # DeltaNet layers: 3 + 3


def test_the_meta_placeholder_is_what_the_quantizer_makes_without_its_data():
    from waypoint.models.nf4 import nf4_placeholder

    made = nf4_tensor_class().from_tensor(torch.empty(96, 64, dtype=torch.bfloat16, device="meta"), 64, 8)
    placeholder = nf4_placeholder(torch.Size([96, 64]), torch.bfloat16, 64, 8)
    names, context = made.__tensor_flatten__()
    assert placeholder.__tensor_flatten__()[0] == names
    for name in names:
        a, b = getattr(made, name), getattr(placeholder, name)
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), name
    assert placeholder.__tensor_flatten__()[1] == context and placeholder.shape == made.shape


def test_the_full_recipe_refuses_a_4_bit_base(capsys):
    from recipes import full_finetune

    with pytest.raises(SystemExit) as exited:  # a config error: one line, before anything is read or written
        full_finetune.main(["--config", str(ROOT / "configs/tiny.yaml"), "+quantize_base=nf4"])
    assert exited.value.code == 1
    assert "quantize_base=nf4: expected null (a 4-bit base is frozen: QLoRA is recipes/lora_finetune.py)" in capsys.readouterr().err


def test_module_load_quantizes_into_an_nf4_weight_in_place_or_by_assignment():
    """load_state_dict with swapping on, into a loaded NF4 weight: without assign the data goes into the existing
    buffers (re-quantized with its blocks), with assign a new NF4 tensor takes its place; the Parameter object
    stays either way."""
    NF4Tensor = nf4_tensor_class()
    linear = torch.nn.Linear(64, 96, bias=False)
    quantize_linears(torch.nn.ModuleDict({"w1": linear}), torch.float32, 64, 8)  # a loaded weight: quantized at once
    param, buffer = linear.weight, linear.weight.quantized_data
    new = torch.randn(96, 64)
    expected = NF4Tensor.from_tensor(new, 64, 8).get_original_weight()
    with swapping_conversions():
        linear.load_state_dict({"weight": new})
        assert linear.weight is param and is_nf4(param) and param.quantized_data.data_ptr() == buffer.data_ptr()
        assert torch.equal(param.get_original_weight(), expected)
        linear.load_state_dict({"weight": new * 2}, assign=True)
        assert linear.weight is param and param.quantized_data.data_ptr() != buffer.data_ptr()
        assert torch.allclose(param.get_original_weight(), 2 * expected, atol=1e-6)
        assert not param.requires_grad
