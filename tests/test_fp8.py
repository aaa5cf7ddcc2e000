"""Block FP8 checkpoints (Qwen3 ``-FP8``, DeepSeek-V3) with transformers as the oracle: the codec is its
``Fp8Quantize`` / ``Fp8Dequantize`` bit for bit, dense and MoE families load with its logits, and the output is
written the way the input came (untouched tensors byte for byte, changed ones re-quantized per block, or a dense
model on request) and read back by transformers with our logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from waypoint.checkpointers import CheckpointError, HFCheckpointer, load_model
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.fp8 import dequantize_fp8, quantize_fp8
from tests.conftest import ROOT, tiny_family_config, write_fp8_checkpoint

TOKENS = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(7))
BLOCK = (16, 16)  # whole blocks in every tiny projection (transformers' dequantization needs them)


def files_of(path):
    return {f.name: read_tensors(f) for f in sorted(path.glob("*.safetensors"))}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "qwen3"
    return path, write_fp8_checkpoint(path, tiny_family_config("qwen3"), block=BLOCK)


def test_the_codec_is_transformers_bit_for_bit():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    class Quantizer:
        quantization_config = type("Config", (), {"weight_block_size": (32, 32), "scale_fmt": "float"})()

    x = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :32, :32] = 0  # an all-zero block: scale 1
    theirs = Fp8Quantize(Quantizer())._quantize_one("a.weight", x)
    weight, scale_inv = quantize_fp8(x, (32, 32))
    assert torch.equal(as_bytes(weight), as_bytes(theirs["a.weight"])) and torch.equal(scale_inv, theirs["a.weight_scale_inv"])
    for scales, dtype in ((scale_inv, torch.float32), (scale_inv.bfloat16(), torch.bfloat16)):
        assert torch.equal(dequantize_fp8(weight, scales, (32, 32), dtype), Fp8Dequantize(None)._dequantize_one(weight, scales, dtype))
    # a partial last block (DeepSeek's grid: ceil(rows / 128)), by the definition
    x = torch.randn(40, 50, generator=torch.Generator().manual_seed(1))
    weight, scale_inv = quantize_fp8(x, (32, 32))
    assert scale_inv.shape == (2, 2)
    expected = weight.float() * scale_inv.repeat_interleave(32, 0)[:40].repeat_interleave(32, 1)[:, :50]
    assert torch.equal(dequantize_fp8(weight, scale_inv, (32, 32), torch.float32), expected)
    assert (expected - x).abs().max() <= x.abs().max() / 448 * 16  # e4m3: 3 mantissa bits
    meta = quantize_fp8(torch.empty(40, 50, device="meta"), (32, 32))
    assert meta[0].is_meta and meta[1].shape == (2, 2) and dequantize_fp8(*meta, (32, 32)).shape == (40, 50)
    with pytest.raises(ValueError, match=r"weight \[40, 50\] in blocks of \[32, 32\] needs scales \[2, 2\], got \[1, 2\]"):
        dequantize_fp8(weight, scale_inv[:1], (32, 32))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_fp8_releases_load_with_transformers_logits(tmp_path, family):
    hf_model = write_fp8_checkpoint(tmp_path / "in", tiny_family_config(family), block=BLOCK)
    with torch.no_grad():
        diff = (load_model(tmp_path / "in", dtype=torch.float32).eval()(TOKENS) - hf_model(TOKENS).logits).abs().max().item()
    print(f"\n{family} block FP8: max |native - transformers| logit = {diff:.3g}")
    assert diff <= 1e-5


def test_untouched_fp8_is_written_back_byte_for_byte(qwen3, tmp_path):
    path, _ = qwen3
    ckpt = HFCheckpointer(path, output_dir=tmp_path)
    state = ckpt.load_checkpoint()
    assert any(line.startswith("quantized input (fp8): ") and "per block of [16, 16]" in line for line in ckpt.notes)
    out = ckpt.save_checkpoint(state, step=1)
    before, after = files_of(path), files_of(out)
    assert sorted(after) == sorted(before)
    for name in before:
        assert sorted(after[name]) == sorted(before[name])
        for key, t in before[name].items():
            assert after[name][key].dtype == t.dtype and torch.equal(as_bytes(after[name][key]), as_bytes(t)), key
    assert json.loads((out / "config.json").read_text()) == json.loads((path / "config.json").read_text())


def test_a_changed_weight_is_requantized_and_transformers_reads_what_we_read(qwen3, tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path, _ = qwen3
    ckpt = HFCheckpointer(path, output_dir=tmp_path)
    state = dict(ckpt.load_checkpoint()["model"])
    changed = state["layers.1.attn.v_proj.weight"].float() + 0.01
    state["layers.1.attn.v_proj.weight"] = changed
    out = ckpt.save_checkpoint({"model": state}, step=2)
    before, after = files_of(path), files_of(out)
    differs = sorted(k for name in before for k in before[name] if not torch.equal(as_bytes(before[name][k]), as_bytes(after[name][k])))
    assert differs == ["model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.v_proj.weight_scale_inv"]
    written = {k: t for name in after for k, t in after[name].items()}
    weight, scale_inv = quantize_fp8(changed, BLOCK)
    assert torch.equal(as_bytes(written["model.layers.1.self_attn.v_proj.weight"]), as_bytes(weight))
    assert torch.equal(written["model.layers.1.self_attn.v_proj.weight_scale_inv"], scale_inv)
    theirs = AutoModelForCausalLM.from_pretrained(out, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32)
    with torch.no_grad():
        assert (load_model(out, dtype=torch.float32).eval()(TOKENS) - theirs.eval()(TOKENS).logits).abs().max().item() <= 1e-5


def test_output_quantization_none_writes_the_dense_model(qwen3, tmp_path):
    from transformers import AutoModelForCausalLM

    path, hf_model = qwen3
    ckpt = HFCheckpointer(path, output_dir=tmp_path, output_quantization="none")
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=1)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    source = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [k for k in index if k.endswith("weight_scale_inv")] and set(index) == {k for k in source if not k.endswith("_inv")}
    assert all(index[k] == source[k] for k in index)  # each weight in the file its FP8 twin was in
    assert {t.dtype for f in files_of(out).values() for t in f.values()} == {torch.float32}  # the input's other weights'
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (theirs(TOKENS).logits - hf_model(TOKENS).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("quantization", ["input", "requantize"])
def test_a_lora_run_over_fp8_writes_fp8_with_the_untouched_weights_as_they_were(tmp_path, quantization):
    """merged/ is FP8 with every untouched weight and scale as it was; the adapted projections are written unquantized
    by default (their modules in modules_to_not_convert, which transformers reads as our merge computes), re-quantized
    with output_quantization=requantize."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from recipes import lora_finetune
    from waypoint.checkpointers import build_model, load_into

    base = tmp_path / "base"
    write_fp8_checkpoint(base, tiny_family_config("qwen3", vocab_size=512, max_position_embeddings=256), block=BLOCK)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / f, base / f)
    out = tmp_path / "out"
    assert lora_finetune.main(["--config", str(ROOT / "configs/tiny_lora.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"output_dir={out}", "epochs=1", "max_steps_per_epoch=2", "batch_size=4",
                               "lora.targets=[q_proj,v_proj]", "lr_scheduler.num_warmup_steps=1",
                               f"checkpointer.output_quantization={quantization}"]) == 0
    merged = out / "step_2" / "merged"
    config, input_config = json.loads((merged / "config.json").read_text()), json.loads((base / "config.json").read_text())
    before, after = files_of(base), files_of(merged)
    if quantization == "requantize":
        assert config == input_config
        differs = {k for name in before for k in before[name] if not torch.equal(as_bytes(before[name][k]), as_bytes(after[name][k]))}
        assert differs and all(".q_proj." in k or ".v_proj." in k for k in differs)  # the adapted ones, re-quantized
        return
    adapted = [f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "v_proj")]
    assert config["quantization_config"].pop("modules_to_not_convert") == sorted(adapted)
    assert config == input_config
    untouched = {k for name in before for k in before[name] if not any(k.startswith(m + ".") for m in adapted)}
    assert all(torch.equal(as_bytes(before[n][k]), as_bytes(after[n][k])) for n in before for k in before[n] if k in untouched)
    written = {k: t for name in after for k, t in after[name].items()}
    assert all(written[f"{m}.weight"].dtype == torch.float32 and f"{m}.weight_scale_inv" not in written for m in adapted)
    theirs = AutoModelForCausalLM.from_pretrained(merged, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                  dtype=torch.float32).eval()
    ours = build_model(merged)
    load_into(ours, HFCheckpointer(merged, output_dir=tmp_path / "unused").load_checkpoint()["model"], dtype=torch.float32)
    with torch.no_grad():
        assert (theirs(TOKENS).logits - ours.eval()(TOKENS)).abs().max().item() <= 1e-5


def test_fp8_config_without_scales_is_one_line(qwen3, tmp_path):
    path, _ = qwen3
    bad = tmp_path / "no_scales"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    from safetensors.torch import save_file

    for f in bad.glob("*.safetensors"):
        tensors = {k: t.float() for k, t in read_tensors(f).items() if not k.endswith("_inv")}
        save_file(tensors, f, metadata={"format": "pt"})
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("_inv")}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="config.json: quantization_config says fp8, but no weight has a weight_scale_inv"):
        HFCheckpointer(bad, output_dir=tmp_path / "out").load_checkpoint()


def test_fp8_experts_round_trip_in_their_per_expert_layout(tmp_path):
    """Qwen3-MoE's experts in FP8, one key each (the hub's layout): stacked on load through the FP8 chain, written
    back expert by expert, every byte as it was; a changed expert stack re-quantizes only its own keys."""
    path = tmp_path / "in"
    write_fp8_checkpoint(path, tiny_family_config("qwen3_moe"), block=BLOCK)
    ckpt = HFCheckpointer(path, output_dir=tmp_path / "out")
    state = dict(ckpt.load_checkpoint()["model"])
    out = ckpt.save_checkpoint({"model": state}, step=1)
    before, after = files_of(path), files_of(out)
    assert all(torch.equal(as_bytes(after[n][k]), as_bytes(t)) for n in before for k, t in before[n].items())
    assert any(".experts.3.down_proj.weight_scale_inv" in k for n in before for k in before[n])
    state["layers.0.moe.w2"] = state["layers.0.moe.w2"].float() * 1.5
    after = files_of(ckpt.save_checkpoint({"model": state}, step=2))
    differs = {k for n in before for k in before[n] if not torch.equal(as_bytes(before[n][k]), as_bytes(after[n][k]))}
    assert differs and all(k.startswith("model.layers.0.mlp.experts.") and ".down_proj." in k for k in differs)
