"""gpt-oss with transformers and PEFT as the oracles: MXFP4 checkpoints in and out the way they came (untouched
tensors byte for byte, changed ones re-quantized, or a dense output on request), and LoRA on attention and on the
experts in PEFT's ``target_parameters`` form. The dense layout's logits and round trips: test_families.py."""

from __future__ import annotations

import json

import pytest
import torch

from waypoint.checkpointers import CheckpointError, HFCheckpointer, build_model, load_into, load_model
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.checkpointers.peft_adapter import load_adapter
from waypoint.converters.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from waypoint.models.lora import adapter_state, adapters_disabled, apply_lora, merged_state
from tests.conftest import ROOT, save_adapter, tiny_family_config, write_family_checkpoint, write_mxfp4_checkpoint

TINY = ROOT / "assets/tiny_llama"

TOKENS = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(7))
EVERYTHING = lambda key: True  # noqa: E731 (read the files' integer bytes too)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(checkpoint dir, the transformers model reading it dequantized)."""
    path = tmp_path_factory.mktemp("gpt_oss") / "mxfp4"
    return path, write_mxfp4_checkpoint(path, tiny_family_config("gpt_oss"))


def files_of(path):
    return {f.name: read_tensors(f, packed=EVERYTHING) for f in sorted(path.glob("*.safetensors"))}


def logits(model):
    with torch.no_grad():
        return model.eval()(TOKENS)


def test_mxfp4_loads_with_transformers_logits(mxfp4):
    path, hf_model = mxfp4
    with torch.no_grad():
        diff = (logits(load_model(path, dtype=torch.float32)) - hf_model(TOKENS).logits).abs().max().item()
    print(f"\ngpt-oss mxfp4: max |native - transformers| logit = {diff:.3g}")
    assert diff <= 1e-5


def test_untouched_mxfp4_is_written_back_byte_for_byte(mxfp4, tmp_path):
    path, _ = mxfp4
    ckpt = HFCheckpointer(path, output_dir=tmp_path)
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=1)
    before, after = files_of(path), files_of(out)
    assert sorted(after) == sorted(before)
    for name in before:
        assert sorted(after[name]) == sorted(before[name]), name
        for key, t in before[name].items():
            assert after[name][key].dtype == t.dtype and torch.equal(after[name][key], t), key
    assert json.loads((out / "config.json").read_text()) == json.loads((path / "config.json").read_text())
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == \
        json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def test_a_changed_expert_is_requantized_and_transformers_reads_what_we_read(mxfp4, tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path, _ = mxfp4
    ckpt = HFCheckpointer(path, output_dir=tmp_path)
    state = dict(ckpt.load_checkpoint()["model"])
    changed = state["layers.1.moe.w3"].float() + 0.01 * torch.randn(state["layers.1.moe.w3"].shape,
                                                                      generator=torch.Generator().manual_seed(0))
    state["layers.1.moe.w3"] = changed
    out = ckpt.save_checkpoint({"model": state}, step=2)
    before, after = files_of(path), files_of(out)
    differs = sorted(k for name in before for k in before[name] if not torch.equal(before[name][k], after[name][k]))
    assert differs == ["model.layers.1.mlp.experts.gate_up_proj_blocks", "model.layers.1.mlp.experts.gate_up_proj_scales"]
    # gate rows (w1) as they were, up rows (w3) changed: the whole parameter re-quantized with the published rounding
    w1 = state["layers.1.moe.w1"].float()
    interleaved = torch.stack([w1, changed], dim=2).flatten(1, 2)  # [E, 2I, H], gate and up rows alternating
    blocks, scales = quantize_mxfp4(interleaved)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    written = {k: t for name in after for k, t in after[name].items()}
    assert torch.equal(written[key + "_blocks"], blocks.view_as(written[key + "_blocks"])) and torch.equal(written[key + "_scales"], scales)
    theirs = AutoModelForCausalLM.from_pretrained(out, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    diff = (logits(load_model(out, dtype=torch.float32)) - theirs.eval()(TOKENS).logits.detach()).abs().max().item()
    assert diff <= 1e-5
    assert torch.equal(load_model(out, dtype=torch.float32).layers[1].moe.w3,
                       dequantize_mxfp4(blocks, scales, torch.float32)[:, 1::2])


def test_output_quantization_none_writes_the_dense_model_transformers_reads(mxfp4, tmp_path):
    from transformers import AutoModelForCausalLM

    path, hf_model = mxfp4
    ckpt = HFCheckpointer(path, output_dir=tmp_path, output_quantization="none")
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=1)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == sorted(f.name for f in path.glob("*.safetensors"))  # the same files
    source = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.mlp.experts.gate_up_proj"] == source["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert not [k for k in index if k.endswith(("_blocks", "_scales"))]
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():  # the dequantized values are exact: the same logits as the quantized input's
        assert (theirs(TOKENS).logits - hf_model(TOKENS).logits).abs().max().item() <= 1e-5
    with pytest.raises(CheckpointError, match="output_quantization='bf16' is not one of input, requantize, none"):
        HFCheckpointer(path, output_dir=tmp_path, output_quantization="bf16")


def test_an_unknown_quantization_is_one_line(mxfp4, tmp_path):
    path, _ = mxfp4
    config = json.loads((path / "config.json").read_text())
    bad = tmp_path / "gptq"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config.quant_method 'gptq' is not supported; supported: mxfp4"):
        HFCheckpointer(bad, output_dir=tmp_path / "out")


# -- LoRA, with PEFT as the oracle ---------------------------------------------------------------------------

TARGETS = ["q_proj", "v_proj", "output_proj", "experts_gate_up", "experts_down"]


def adapted(path, targets=TARGETS):
    """The native model of ``path`` with random adapters on ``targets`` (B too: PEFT starts it at zero)."""
    model = load_model(path, dtype=torch.float32)
    apply_lora(model, targets, rank=4, alpha=6)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return model


@pytest.mark.parametrize("targets", [TARGETS, ["experts_down"]], ids=["attention+experts", "down-only"])
def test_expert_lora_is_peft_s_adapter_and_merge(tmp_path, targets):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config("gpt_oss"))
    ckpt = HFCheckpointer(base, output_dir=tmp_path / "out")
    model = adapted(base, targets)
    save_adapter(tmp_path / "adapter", model, ckpt.hf_converter(), str(base))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    parameters = [p for t, p in (("experts_gate_up", "mlp.experts.gate_up_proj"), ("experts_down", "mlp.experts.down_proj"))
                  if t in targets]
    assert config["target_parameters"] == parameters
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "adapter")
    with torch.no_grad():
        diff = (logits(model) - peft.eval()(TOKENS).logits).abs().max().item()
    print(f"\ngpt-oss LoRA {targets}: max |native - PEFT| logit = {diff:.3g}")
    assert diff <= 1e-5
    with adapters_disabled(model), torch.no_grad():
        assert (logits(model) - peft(TOKENS).logits).abs().max().item() > 0.01  # the adapters change the logits
    # the adapter reads back as it was written, and the merge is PEFT's to the bit
    back, _ = load_adapter(tmp_path / "adapter", ckpt.hf_converter())
    mine = adapter_state(model)
    assert sorted(back) == sorted(mine) and all(torch.equal(back[k], mine[k]) for k in mine)
    merged = peft.merge_and_unload().state_dict()
    ours = merged_state(model)
    for layer in range(2):
        gate_up = merged[f"model.layers.{layer}.mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, H]
        assert torch.equal(ours[f"layers.{layer}.moe.w1"], gate_up[:, 0::2])
        assert torch.equal(ours[f"layers.{layer}.moe.w3"], gate_up[:, 1::2])
        assert torch.equal(ours[f"layers.{layer}.moe.w2"], merged[f"model.layers.{layer}.mlp.experts.down_proj"].transpose(1, 2))


def test_expert_lora_is_the_same_in_every_moe_implementation(tmp_path):
    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config("gpt_oss"))
    model = adapted(base)
    results = {}
    for impl in ("loop", "padded", "grouped"):
        for layer in model.layers:
            layer.moe.impl = impl
        model.zero_grad()
        out = model(TOKENS)
        out.square().mean().backward()
        results[impl] = (out.detach(), model.layers[0].moe.experts_gate_up.lora_B.weight.grad.clone())
    for impl in ("padded", "grouped"):
        assert (results[impl][0] - results["loop"][0]).abs().max() <= 1e-5
        assert (results[impl][1] - results["loop"][1]).abs().max() <= 1e-5


def test_expert_lora_refuses_dropout_and_other_families(tmp_path):
    base = tmp_path / "base"
    write_family_checkpoint(base, tiny_family_config("gpt_oss"))
    with pytest.raises(CheckpointError, match="lora.dropout must be 0 with expert targets"):
        apply_lora(load_model(base), ["experts_down"], rank=2, alpha=4, dropout=0.1)
    llama = tmp_path / "llama"
    write_family_checkpoint(llama, tiny_family_config("llama"))
    with pytest.raises(CheckpointError, match="lora target experts_down adapts mixture-of-experts weights"):
        apply_lora(load_model(llama), ["experts_down"], rank=2, alpha=4)


def test_the_load_report_and_inspect_show_the_quantized_tensors(mxfp4, tmp_path, capsys):
    from scripts import inspect as inspect_script

    path, _ = mxfp4
    ckpt = HFCheckpointer(path, output_dir=tmp_path)
    ckpt.load_checkpoint()
    (note,) = [line for line in ckpt.notes if line.startswith("quantized input")]
    assert "quantized input (mxfp4): 4 tensors dequantized as loaded into" in note and "blocks of 32" in note
    assert "layers.{0..1}.moe.w1, layers.{0..1}.moe.w3 [4, 32, 64]" in note and "layers.{0..1}.moe.w2 [4, 64, 32]" in note
    assert inspect_script.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "model.layers.{0..1}.mlp.experts.gate_up_proj_{blocks,scales} -> [4, 64, 64] dequantized" in out
    dense = tmp_path / "dense"
    write_family_checkpoint(dense, tiny_family_config("gpt_oss"))
    assert inspect_script.main([str(dense)]) == 0
    total = [line for line in out.splitlines() if line.startswith("total:")]
    assert total == [line for line in capsys.readouterr().out.splitlines() if line.startswith("total:")]  # the same parameters


@pytest.mark.parametrize("targets,dtype,quantization", [
    ("[q_proj,v_proj]", "fp32", "input"), ("[q_proj,experts_gate_up,experts_down]", "fp32", "input"),
    ("[q_proj,experts_gate_up,experts_down]", "bf16", "input"), ("[q_proj,experts_gate_up,experts_down]", "fp32", "requantize")],
    ids=["attention", "experts", "experts-bf16", "experts-requantized"])
def test_lora_run_on_mxfp4_merges_into_mxfp4(tmp_path, capsys, targets, dtype, quantization):
    """The LoRA recipe on the MXFP4 release shape: merged/ is MXFP4 again and experts the adapters did not touch are
    the input's bytes. Adapted experts are written unquantized by default (re-quantizing erases most of the update),
    their modules in modules_to_not_convert, and transformers reads the mix as our adapted model computes; with
    output_quantization=requantize they are re-quantized, and the run says how far that moved the logits."""
    import shutil

    from transformers import AutoModelForCausalLM, Mxfp4Config

    from recipes import lora_finetune
    from waypoint.models.lora import merge_state_dict

    base = tmp_path / "base"
    write_mxfp4_checkpoint(base, tiny_family_config("gpt_oss", vocab_size=512, max_position_embeddings=256))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, base / f)
    out = tmp_path / "out"
    assert lora_finetune.main(["--config", str(ROOT / "configs/tiny_lora.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"output_dir={out}", "epochs=1", "max_steps_per_epoch=3", "batch_size=4",
                               f"lora.targets={targets}", "lr_scheduler.num_warmup_steps=1", f"dtype={dtype}",
                               f"checkpointer.output_quantization={quantization}"]) == 0
    printed = capsys.readouterr().out
    final = out / "step_3"
    merged = final / "merged"
    experts_adapted = "experts" in targets
    config, input_config = json.loads((merged / "config.json").read_text()), json.loads((base / "config.json").read_text())
    kept_dense = experts_adapted and quantization == "input"
    if kept_dense:  # the adapted experts' modules, each layer's, not converted
        skipped = config["quantization_config"].pop("modules_to_not_convert")
        assert skipped == input_config["quantization_config"]["modules_to_not_convert"] + \
            ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        input_config["quantization_config"].pop("modules_to_not_convert")
    assert config == input_config
    before, after = files_of(base), files_of(merged)
    experts = {k for name in before for k in before[name] if k.endswith(("_blocks", "_scales"))}
    same = {k for name in before for k in before[name] if k in after[name] and torch.equal(before[name][k], after[name][k])}
    if kept_dense:
        written = {k for name in after for k in after[name]}
        assert not experts & written and {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} <= written
        others = {before[name][k].dtype for name in before for k in before[name] if k.endswith("q_proj.weight")}
        assert {after[name][k].dtype for name in after for k in after[name] if k.endswith(("gate_up_proj", "down_proj"))} == \
            others, "written in the dtype of the input's other weights"
    elif experts_adapted:  # gate_up and down adapted in every layer: all re-quantized
        assert not experts & same
    else:
        assert experts <= same
    if experts_adapted:
        assert json.loads((final / "adapter_config.json").read_text())["target_parameters"] == \
            ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (verified,) = [line for line in printed.splitlines() if line.startswith("export verified")]
    (done,) = [line for line in printed.splitlines() if line.startswith("done:")]
    if quantization == "requantize":  # the check says what the re-quantization cost, and the last line warns
        moved = float(verified.rsplit("up to ", 1)[1].split()[0])
        assert moved > 0.05 and "WARNING: the quantized output differs from the model that trained" in done \
            and "output_quantization: none" in done
    else:
        assert "WARNING" not in done
    # merged/ holds the merge of the input's values (as the format rounds it where it re-quantizes)
    ckpt = HFCheckpointer(base, output_dir=tmp_path / "unused")
    adapter, adapter_config = load_adapter(final, ckpt.hf_converter())
    expected = merge_state_dict(dict(ckpt.load_checkpoint()["model"]), adapter, adapter_config["lora_alpha"] / adapter_config["r"])
    reread = HFCheckpointer(merged, output_dir=tmp_path / "unused").load_checkpoint()["model"]
    if dtype == "bf16":  # the export check passed (routing replayed, the fp32 files read back in bf16); merged in bf16
        return
    for key in ("layers.0.moe.w1", "layers.1.moe.w2"):
        values = expected[key].float()
        if experts_adapted and not kept_dense:
            values = dequantize_mxfp4(*quantize_mxfp4(values), torch.float32)
        assert torch.equal(reread[key].float(), values), key
    if kept_dense:  # transformers reads the mix of packed and unquantized experts as we do
        theirs = AutoModelForCausalLM.from_pretrained(merged, quantization_config=Mxfp4Config(dequantize=True),
                                                      dtype=torch.float32).eval()
        model = build_model(merged)
        load_into(model, reread, dtype=torch.float32)
        with torch.no_grad():
            assert (theirs(TOKENS).logits - model.eval()(TOKENS)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("targets,expected", [
    ("[q_proj,experts_down]", "error: lora target experts_down adapts mixture-of-experts weights, which this model does not have"),
    ("[mlp.experts.gate_up_proj]", "error: lora target experts_gate_up adapts mixture-of-experts weights, which this model does not have"),
], ids=["native-name", "peft-name"])
def test_expert_targets_on_a_dense_model_are_one_line(tmp_path, capsys, targets, expected):
    from recipes import lora_finetune

    out = tmp_path / "out"
    code = lora_finetune.main(["--config", str(ROOT / "configs/tiny_lora.yaml"), f"checkpointer.checkpoint_dir={TINY}",
                               f"output_dir={out}", f"lora.targets={targets}"])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
    assert code == 1 and err == [expected]


def test_a_full_fine_tune_written_back_in_mxfp4_says_how_far_the_files_are_from_the_trained_model(tmp_path, capsys):
    """The export check compares the files with the model as the format rounds it (the layout) and measures that
    rounding against the model that trained: the figure it prints is the logit distance between the MXFP4 output and
    the same run written unquantized, and the run's last line warns and names output_quantization: none."""
    import shutil

    from recipes import full_finetune
    from waypoint.checkpointers.export_check import probe_logits, probe_tokens

    base = tmp_path / "base"
    write_mxfp4_checkpoint(base, tiny_family_config("gpt_oss", vocab_size=512, max_position_embeddings=256))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, base / f)
    printed = {}
    for quantization in ("input", "none"):
        assert full_finetune.main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={base}",
                                   f"output_dir={tmp_path / quantization}", "epochs=1", "max_steps_per_epoch=3",
                                   "batch_size=4", "lr_scheduler.num_warmup_steps=1", "optimizer.lr=3e-3",
                                   f"checkpointer.output_quantization={quantization}"]) == 0
        printed[quantization] = capsys.readouterr().out.splitlines()
    (verified,) = [line for line in printed["input"] if line.startswith("export verified")]
    moved = float(verified.split("moves the logits up to ")[1].split()[0])
    tokens = probe_tokens(512, (2, 64))
    written, trained = (probe_logits(load_model(tmp_path / q / "step_3"), tokens) for q in ("input", "none"))
    measured = (written - trained).abs().max().item()
    assert measured > 0.05 and abs(moved - measured) <= 5e-3 * measured, (moved, measured)  # printed to 3 digits
    (done,) = [line for line in printed["input"] if line.startswith("done:")]
    assert f"WARNING: the quantized output differs from the model that trained by up to {moved:.3g}" in done
    assert "output_quantization: none writes the trained weights unquantized" in done
    assert not any("quantization moves" in line or "WARNING" in line for line in printed["none"])
