"""A block-FP8 release encoded as DeepSeek's and Qwen's are (``weight_scale_inv = amax / 448`` per block, not our
quantizer's ``1 / (448 / amax)``; scales in float32 or bfloat16) comes back byte for byte through every conversion:
HF -> HF, HF -> native -> HF (the native checkpoint keeps the input's scales beside it) and a LoRA run that leaves
the weights alone; a weight the run changed is re-quantized into scales of the input's dtype."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from waypoint.checkpointers import checkpointer_for
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.checkpointers.hf_source import SCALES_FILE
from scripts import convert
from tests.conftest import ROOT, tiny_family_config, write_encoded_fp8_checkpoint

CASES = {"fp32_scales": (torch.float32, "float32"), "bf16_scales": (torch.bfloat16, "bfloat16")}  # scales, dense dtype


def tensors_of(path):
    return {k: t for f in sorted(path.glob("model*.safetensors")) for k, t in read_tensors(f).items()}


def changed(before, after) -> list[str]:
    """The FP8 weights and scales of ``before`` that ``after`` does not hold with the same dtype and bytes."""
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    return sorted(k for k, t in before.items() if t.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv")
                  if k not in after or after[k].dtype != t.dtype or not torch.equal(as_bytes(after[k]), as_bytes(t)))


@pytest.fixture(scope="module", params=list(CASES))
def release(request, tmp_path_factory):
    scale_dtype, dense = CASES[request.param]
    path = tmp_path_factory.mktemp("fp8_release") / request.param
    config = tiny_family_config("qwen3", vocab_size=512, max_position_embeddings=256, dtype=dense)
    write_encoded_fp8_checkpoint(path, config, scale_dtype=scale_dtype)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / f, path / f)
    return path, scale_dtype


def test_the_release_is_not_our_rounding(release):
    """The premise: re-quantizing the dequantized weights gives other scales for some tensors (fp32: in the last bit;
    bf16: the same values, but our quantizer's are fp32), so keeping them is what keeps the bytes."""
    from waypoint.fp8 import dequantize_fp8, quantize_fp8

    path, scale_dtype = release
    tensors = tensors_of(path)
    scales = [k for k in tensors if k.endswith("_scale_inv")]
    assert len(scales) == 21 and {tensors[k].dtype for k in scales} == {scale_dtype}
    requantized = [k for k in scales if not torch.equal(
        quantize_fp8(dequantize_fp8(tensors[k.removesuffix("_scale_inv")], tensors[k], (128, 128), torch.float32),
                     (128, 128))[1].to(scale_dtype), tensors[k])]
    assert requantized if scale_dtype == torch.float32 else not requantized


def test_hf_native_hf_and_hf_hf_keep_every_fp8_byte(release, tmp_path):
    path, _ = release
    before = tensors_of(path)
    assert convert.main([str(path), str(tmp_path / "native"), "--to", "native"]) == 0
    assert (tmp_path / "native" / SCALES_FILE).is_file()  # the input's scales, beside the dequantized weights
    assert convert.main([str(tmp_path / "native"), str(tmp_path / "back"), "--to", "hf"]) == 0
    assert convert.main([str(path), str(tmp_path / "same"), "--to", "hf", "--no-verify"]) == 0
    assert convert.main([str(path), str(tmp_path / "resharded"), "--to", "hf", "--num-shards", "2", "--no-verify"]) == 0
    for out in ("back", "same", "resharded"):
        after = tensors_of(tmp_path / out)
        assert set(after) == set(before) and changed(before, after) == [], out
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((path / "config.json").read_text())


def test_a_lora_run_keeps_the_weights_it_leaves_alone(release, tmp_path):
    """bf16 scales (fp32 ones: test_fp8.py): the adapted weights re-quantized into bf16 scales read back as written."""
    from recipes import lora_finetune

    path, scale_dtype = release
    if scale_dtype != torch.bfloat16:
        pytest.skip("fp32 scales: tests/test_fp8.py::test_a_lora_run_over_fp8_writes_fp8_with_the_untouched_weights_as_they_were")
    out = tmp_path / "out"
    assert lora_finetune.main(["--config", str(ROOT / "configs/tiny_lora.yaml"), f"checkpointer.checkpoint_dir={path}",
                               f"output_dir={out}", "epochs=1", "max_steps_per_epoch=1", "batch_size=2",
                               "lora.targets=[q_proj,v_proj]", "lr_scheduler.num_warmup_steps=1"]) == 0
    before, after = tensors_of(path), tensors_of(out / "step_1" / "merged")
    differs = changed(before, after)
    assert differs and all(".q_proj." in k or ".v_proj." in k for k in differs)  # the adapted ones, re-quantized
    assert {t.dtype for k, t in after.items() if k.endswith("_scale_inv")} == {scale_dtype}  # in the input's dtype


def test_meta_keeps_them_too(tmp_path):
    """Llama in FP8 -> Meta (its consolidated.00.pth once pickled each weight's FP8 origin and was refused on
    reading) -> HF: every byte back."""
    path = tmp_path / "llama"
    write_encoded_fp8_checkpoint(path, tiny_family_config("llama"), block=(16, 16))
    assert convert.main([str(path), str(tmp_path / "meta"), "--to", "meta"]) == 0
    assert convert.main([str(tmp_path / "meta"), str(tmp_path / "back"), "--to", "hf"]) == 0
    before, after = tensors_of(path), tensors_of(tmp_path / "back")
    assert set(after) == set(before) and changed(before, after) == []


@pytest.mark.parametrize("fmt", ["native", "meta"])
def test_weights_changed_since_the_conversion_go_back_requantized_and_verified_as_such(tmp_path, capsys, fmt):
    """HF block FP8 -> native or Meta, some weights changed there (a full fine-tune's step), -> HF with the export
    check on: the changed weights are re-quantized, and the check compares the output with the model as those files
    hold it (it compared with the dense model, and refused its own output by FP8's rounding); the rest is the
    release's bytes."""
    path = tmp_path / "llama"
    write_encoded_fp8_checkpoint(path, tiny_family_config("llama"), block=(16, 16))
    assert convert.main([str(path), str(tmp_path / fmt), "--to", fmt]) == 0
    checkpointer = checkpointer_for(tmp_path / fmt, output_dir=tmp_path / "run")
    state = dict(checkpointer.load_checkpoint()["model"])
    generator = torch.Generator().manual_seed(0)
    trained = [k for k in state if k.endswith((".q_proj.weight", ".w2.weight"))]
    for key in trained:
        state[key] = state[key] + 0.01 * state[key].abs().max() * torch.randn(state[key].shape, generator=generator)
    step = checkpointer.save_checkpoint({"model": state}, step=1)
    capsys.readouterr()
    assert convert.main([str(step), str(tmp_path / "back"), "--to", "hf"]) == 0, capsys.readouterr().err
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("export verified"))
    assert "the output's quantization moves the logits up to" in line
    differs = changed(tensors_of(path), tensors_of(tmp_path / "back"))
    modules = sorted(f"model.layers.{i}.{m}.weight{s}" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")
                     for s in ("", "_scale_inv"))
    assert len(trained) == 4 and differs == modules  # the changed ones re-quantized, the others as they came


def test_a_lora_run_on_the_native_conversion_carries_the_scales_back_to_hf(release, tmp_path):
    """HF -> native, a LoRA run on the native checkpoint (its merged/ carries the input's scales), merged -> HF: the
    weights the run left alone are the release's bytes, the adapted ones re-quantized, read back as such."""
    from recipes import lora_finetune

    path, scale_dtype = release
    if scale_dtype != torch.float32:
        pytest.skip("one scale dtype is enough for the native run's files")
    assert convert.main([str(path), str(tmp_path / "native"), "--to", "native", "--no-verify"]) == 0
    out = tmp_path / "out"
    assert lora_finetune.main(["--config", str(ROOT / "configs/tiny_lora.yaml"), "checkpointer=native",
                               f"checkpointer.checkpoint_dir={tmp_path / 'native'}", f"output_dir={out}", "epochs=1",
                               "max_steps_per_epoch=1", "batch_size=2", "lora.targets=[q_proj,v_proj]",
                               "lr_scheduler.num_warmup_steps=1", "verify_export=false"]) == 0
    assert (out / "step_1" / "merged" / SCALES_FILE).is_file()
    assert convert.main([str(out / "step_1" / "merged"), str(tmp_path / "back"), "--to", "hf"]) == 0
    differs = changed(tensors_of(path), tensors_of(tmp_path / "back"))
    assert differs and all(".q_proj." in k or ".v_proj." in k for k in differs)  # the adapted ones, re-quantized
