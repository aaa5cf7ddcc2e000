"""Block-FP8 inputs Waypoint cannot read are refused at load in one line naming the file and the key (config.json's
block size, nan/inf scales or weights, integer scales), on every path that loads: the checkpointers the recipes
use, generate, convert and eval's loader. scripts/inspect.py counts an FP8 checkpoint's parameters as the model has
them, and generate prints the load report the training recipes print."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from waypoint.checkpointers import CheckpointError, HFCheckpointer, load_model
from tests.conftest import ROOT, tiny_family_config, write_fp8_checkpoint
from tests.test_generate import run_generate

BLOCK = (16, 16)
SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_inputs") / "qwen3"
    write_fp8_checkpoint(path, tiny_family_config("qwen3", vocab_size=512, max_position_embeddings=256), block=BLOCK)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / f, path / f)
    return path


def edited(release, tmp_path, key: str, edit) -> tuple:
    """A copy of ``release`` with ``key`` replaced by ``edit(tensor)``; (its directory, the file holding the key)."""
    path = tmp_path / "ckpt"
    shutil.copytree(release, path)
    name = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(path / name)
    tensors[key] = edit(tensors[key].clone())
    save_file(tensors, path / name, metadata={"format": "pt"})
    return path, path / name


def with_config(release, tmp_path, **quantization) -> object:
    path = tmp_path / "ckpt"
    shutil.copytree(release, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("block", [[0, -1], [128], [16, 16.0], "128"])
def test_a_bad_weight_block_size_is_one_line(release, tmp_path, block):
    path = with_config(release, tmp_path, weight_block_size=block)
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\.weight_block_size .*: expected two "
                                              r"positive integers"):
        HFCheckpointer(path, output_dir=tmp_path / "out").load_checkpoint()


def nan_first(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[0] = float("nan")
    return t


def inf_last(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[-1] = float("inf")
    return t


@pytest.mark.parametrize("edit", [nan_first, inf_last])
def test_nonfinite_scales_are_refused_at_load_on_every_path(release, tmp_path, capsys, edit):
    from scripts import convert
    from waypoint.cli.inference_model import load_for_inference

    path, file = edited(release, tmp_path, SCALE, edit)
    line = rf"{file}: {SCALE}: 1 of its \d+ block scales are nan or inf"
    with pytest.raises(CheckpointError, match=line):  # the recipes' load
        HFCheckpointer(path, output_dir=tmp_path / "out").load_checkpoint()
    with pytest.raises(CheckpointError, match=line):  # eval's (and generate's) load
        load_for_inference(str(path))
    code, out, err = run_generate(capsys, f"checkpoint_dir={path}", "prompt=Hi", "max_new_tokens=3")
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in err and "tokens/s]" not in err, err
    assert SCALE in errors[0] and str(file) in errors[0]
    assert convert.main([str(path), str(tmp_path / "native"), "--to", "native"]) == 1
    err = capsys.readouterr().err
    assert SCALE in err and "bug" not in err and not (tmp_path / "native").exists()


def test_nan_weight_bytes_are_refused_as_the_weight_is_read(release, tmp_path):
    """e4m3fn's NaN bytes (0x7f, 0xff) are not in the scales: found as the weight is dequantized, one at a time."""
    key = SCALE.removesuffix("_scale_inv")

    def nan_byte(t):
        t.view(torch.uint8)[3, 5] = 0xFF
        return t
    path, file = edited(release, tmp_path, key, nan_byte)
    with pytest.raises(CheckpointError, match=rf"^{file.name}: {key}: dequantizes to nan/inf \(row 3 first: NaN bytes"):
        load_model(path)


def test_an_integer_scale_names_the_formats_waypoint_reads(release, tmp_path):
    path, file = edited(release, tmp_path, SCALE, lambda t: t.to(torch.int32))
    with pytest.raises(CheckpointError, match=rf"^{file}: {SCALE} is int32; weights must be floating point, or a "
                                              r"quantized format .* Waypoint reads mxfp4 \(uint8 \*_blocks and \*_scales\) "
                                              r"and block fp8 \(float8_e4m3fn weights, float32 or bfloat16 \*_scale_inv\)$"):
        HFCheckpointer(path, output_dir=tmp_path / "out").load_checkpoint()


def test_inspect_counts_the_parameters_the_model_has_not_the_scales(release, tmp_path, capsys):
    from scripts import inspect as inspect_script
    from tests.conftest import write_family_checkpoint

    dense = tmp_path / "dense"
    write_family_checkpoint(dense, tiny_family_config("qwen3", vocab_size=512, max_position_embeddings=256))
    capsys.readouterr()
    assert inspect_script.main([str(dense)]) == 0 and inspect_script.main([str(release)]) == 0
    dense_out, fp8_out = capsys.readouterr().out.split("manifest:")[:2]
    total = lambda out: [line for line in out.splitlines() if line.startswith("total:")][0].split(",")[:2]  # noqa: E731
    assert total(fp8_out)[0] == total(dense_out)[0]  # "total: N parameters": the same model
    assert "quantized (block FP8: float8_e4m3fn weights, one weight_scale_inv per block of [16, 16]): 21 weights, " \
           "432 block scale values (not counted as parameters):" in fp8_out
    assert "model.layers.{0..2}.mlp.down_proj.weight{,_scale_inv}" in fp8_out and "[64, 96] F8_E4M3, scales [4, 6] F32" in fp8_out


def test_generate_prints_the_load_report_on_stderr(release, capsys):
    """The lines the training recipes print after loading (recipes/full_finetune.py), the quantized input's among
    them; stdout holds the reply alone."""
    code, out, err = run_generate(capsys, f"checkpoint_dir={release}", "prompt=Hi", "max_new_tokens=3")
    assert code == 0, err
    lines = err.splitlines()
    loaded = next(i for i, line in enumerate(lines) if line.startswith("loaded 36 tensors: "))
    assert lines[loaded + 1].startswith("quantized input (fp8): 21 tensors dequantized as loaded into ")
    assert "tokens/s]" in lines[-1] and "loaded" not in out and "quantized" not in out
