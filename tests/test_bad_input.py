"""Bad input: a one-line error naming the file or key, and nothing in output_dir touched."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from waypoint.checkpointers import HFCheckpointer, load_model
from tests.conftest import ROOT, tiny_llama_config, write_hf_checkpoint


def _first_shard(path):
    return sorted(path.glob("model-*.safetensors"))[0]


def missing_config(path):
    (path / "config.json").unlink()
    return r"config\.json: missing"


def truncated_shard(path):
    shard = _first_shard(path)
    shard.write_bytes(shard.read_bytes()[:-100])
    return rf"{shard.name}: unreadable weight file"


def index_names_missing_file(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return r"model\.safetensors\.index\.json: names 'model-00099-of-00099\.safetensors'"


def index_escapes_directory(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../outside.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return r"'\.\./outside\.safetensors' escapes the checkpoint directory"


def unknown_key(path):
    shard = _first_shard(path)
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, shard, metadata={"format": "pt"})
    return rf"unknown hf key 'model\.layers\.0\.self_attn\.q_proj\.bias' in {shard.name}"


def shape_does_not_fit(path):
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 100
    (path / "config.json").write_text(json.dumps(config))
    return r"layers\.0\.mlp\.w1\.weight: checkpoint shape \(96, 64\) does not fit the model's \(100, 64\)"


def heads_do_not_fit(path):
    config = json.loads((path / "config.json").read_text())
    config["num_attention_heads"], config["head_dim"] = 2, 16
    (path / "config.json").write_text(json.dumps(config))
    return r"cannot convert model\.layers\.0\.self_attn\.q_proj\.weight \(64, 64\) in model-"


def int32_tensor(path):
    shard = _first_shard(path)
    tensors = load_file(shard)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, shard, metadata={"format": "pt"})
    return rf"{shard.name}: {re.escape(key)} is int32; weights must be floating point"


def pickle_with_code(path):
    """A zip-format pytorch_model.bin whose pickle calls os.system when loaded without weights_only."""
    for f in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        f.unlink()
    torch.save({"model.norm.weight": os.system}, path / "pytorch_model.bin")
    return r"refused: pickle in \S+pytorch_model\.bin references (posix|nt)\.system, which is not allowed"


CASES = [missing_config, truncated_shard, index_names_missing_file, index_escapes_directory, unknown_key,
         shape_does_not_fit, heads_do_not_fit, int32_tensor, pickle_with_code]


@pytest.mark.parametrize("damage", CASES, ids=lambda f: f.__name__)
def test_bad_checkpoint_one_line_error_and_output_dir_untouched(damage, tmp_path, capsys):
    from recipes.full_finetune import main

    ckpt = tmp_path / "in"
    write_hf_checkpoint(ckpt, tiny_llama_config(), max_shard_size="60KB")
    (ckpt / "tokenizer.json").write_bytes((ROOT / "assets/tiny_llama/tokenizer.json").read_bytes())
    expected = damage(ckpt)
    out = tmp_path / "out"
    (out / "step_3").mkdir(parents=True)
    (out / "step_3" / "model.safetensors").write_bytes(b"the user's earlier checkpoint")
    (out / "metrics.jsonl").write_text("earlier metrics\n")
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    code = main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={ckpt}",
                 f"output_dir={out}", "overwrite=true", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}"])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
    assert code == 1
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(expected, err[0]), err[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snapshot


def test_load_model_errors_name_the_problem(tmp_path):
    write_hf_checkpoint(tmp_path / "in", tiny_llama_config())
    with pytest.raises(Exception, match="config.json"):
        load_model(tmp_path / "nowhere")
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()
    del state["model"]["norm.weight"]
    with pytest.raises(Exception, match="state dict lacks 'model.norm.weight' that the input checkpoint has"):
        ckpt.save_checkpoint(state, step=1)
    assert not (tmp_path / "out").exists(), "a refused save writes nothing"


def test_too_few_samples_for_the_global_batch_is_one_line(tmp_path, capsys):
    from recipes.full_finetune import main

    out = tmp_path / "out"
    code = main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
                 f"output_dir={out}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "batch_size=300",
                 "gradient_accumulation_steps=2"])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
    assert code == 1
    assert err == ["error: dataset has 400 samples: too few for batch_size=300 x gradient_accumulation_steps=2 x 1 processes"]
    assert not out.exists()


class ExitHooks:
    """What ``wandb.init`` leaves in a process: sys.exit replaced by a method that records the code and exits."""

    def exit(self, code=0):
        self.code = code
        raise SystemExit(code)


@pytest.mark.parametrize("wrapped", [False, True], ids=["sys.exit", "sys.exit-wrapped-by-a-tracker"])
def test_sys_exit_in_a_class_the_config_instantiates_is_an_error_not_a_success(tmp_path, monkeypatch, capsys, wrapped):
    """A dataset ``_target_`` of the user's whose constructor calls sys.exit(0) ended the run with exit status 0 and no
    ``done:`` line, which a scheduler records as a success: it is one error line naming the function, exit status 1,
    the user's function, not the hook of a tracker that wrapped sys.exit in this process (W&B's, after wandb.init)."""
    from recipes.full_finetune import main

    if wrapped:
        monkeypatch.setattr(sys, "exit", ExitHooks().exit)

    name = "exiting_data_hooked" if wrapped else "exiting_data_q"  # a module of its own: imports are cached
    (tmp_path / f"{name}.py").write_text("import sys\n\n\nclass Records:\n    def __init__(self, **options):\n"
                                                "        sys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    code = main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
                 f"output_dir={out}", f"dataset._target_={name}.Records"])
    printed = capsys.readouterr()
    err = [line for line in printed.err.replace("\r", "\n").splitlines() if "error" in line]
    assert code == 1 and "done:" not in printed.out
    assert err == [f"error: {name}.Records.__init__ ({tmp_path / f'{name}.py'}:6) called sys.exit(0), "
                   "which ended the run before it finished; raise an exception there instead of exiting (the run stops "
                   "here, exit status 1)"], printed.err[-2000:]


def test_legacy_pickle_bin_loads_without_mmap_and_says_so(tmp_path, capsys):
    """transformers still reads pre-zip pytorch_model.bin files; they cannot be memory-mapped, so they are read whole."""
    from recipes.full_finetune import main

    reference = write_hf_checkpoint(tmp_path / "in", tiny_llama_config(vocab=512), fmt="bin", max_shard_size="60KB")
    shards = sorted((tmp_path / "in").glob("pytorch_model-*.bin"))
    for shard in shards:
        torch.save(torch.load(shard, weights_only=True), shard, _use_new_zipfile_serialization=False)
    model = load_model(tmp_path / "in")
    assert torch.equal(model.tok_embeddings.weight, reference.model.embed_tokens.weight)
    (tmp_path / "in" / "tokenizer.json").write_bytes((ROOT / "assets/tiny_llama/tokenizer.json").read_bytes())
    out = tmp_path / "out"
    assert main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={tmp_path / 'in'}",
                 f"output_dir={out}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "epochs=1",
                 "max_steps_per_epoch=1"]) == 0
    printed = capsys.readouterr().out
    assert (f"note: read into memory, not memory-mapped: {shards[0].name}, {shards[1].name}, {shards[2].name} and "
            f"{len(shards) - 3} more (legacy non-zip PyTorch files cannot be mapped)") in printed
    assert sorted(p.name for p in (out / "step_1").glob("*.bin")) == [p.name for p in shards]


def test_disk_full_while_writing_recipe_state_is_one_line(tmp_path):
    """The model files (< 1.5 MB each) fit under the limit, recipe_state.pt (~7 MB, torch.save's zip writer) does not."""
    from tests.launch import FileSizeLimit
    from tests.recipe_runs import run_recipe

    out = tmp_path / "run"
    result = run_recipe("full", ["--config", str(ROOT / "configs/tiny.yaml"),
                                 f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}", f"output_dir={out}",
                                 f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "epochs=1", "max_steps_per_epoch=1"],
                        preexec_fn=FileSizeLimit(2_000_000))
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert re.match(rf"error: could not write {re.escape(str(out))}/step_1: File too large \(OSError\); nothing was committed", errors[0])
    assert not list(out.glob("step_*")) and not list(out.glob(".step_*"))


def make_adapter(tmp_path):
    from recipes.lora_finetune import main

    out = tmp_path / "lora"
    assert main(["--config", str(ROOT / "configs/tiny_lora.yaml"), f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
                 f"output_dir={out}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "epochs=1", "max_steps_per_epoch=1",
                 "save_merged=never"]) == 0
    return out / "step_1"


def test_merge_lora_adapter_checks_are_one_line(tmp_path, capsys):
    from scripts import merge_lora

    adapter = make_adapter(tmp_path)

    def damaged(name, change):
        target = tmp_path / name
        shutil.copytree(adapter, target)
        change(target)
        return target

    def config_edit(**fields):
        def change(target):
            config = json.loads((target / "adapter_config.json").read_text())
            config.update(fields)
            config = {k: v for k, v in config.items() if v is not None}
            (target / "adapter_config.json").write_text(json.dumps(config))
        return change

    def truncate(target):
        weights = target / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-50])

    cases = [(damaged("r0", config_edit(r=0)), r"adapter_config\.json: r=0, expected an integer >= 1"),
             (damaged("noalpha", config_edit(lora_alpha=None)), r"adapter_config\.json: lacks lora_alpha"),
             (damaged("truncated", truncate), r"adapter_model\.safetensors: unreadable weight file"),
             (tmp_path / "nowhere", r"nowhere/adapter_config\.json: missing")]
    capsys.readouterr()
    for adapter_dir, expected in cases:
        assert merge_lora.main([str(ROOT / "assets/tiny_llama"), str(adapter_dir), str(tmp_path / "merged")]) == 1
        err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
        assert len(err) == 1 and re.search(expected, err[0]), err
    assert not (tmp_path / "merged").exists()
    assert merge_lora.main([str(ROOT / "assets/tiny_llama"), str(adapter), str(adapter / "merged")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert err == [f"error: OUT_DIR {adapter / 'merged'} lies inside the adapter {adapter}, which this command reads; "
                   "choose an output outside it"]


def test_convert_bad_shard_size_and_inspect_of_a_failing_manifest(tmp_path, capsys):
    from scripts import convert, inspect as inspect_script

    with pytest.raises(SystemExit) as usage:
        convert.main([str(ROOT / "assets/tiny_llama"), str(tmp_path / "x"), "--to", "hf", "--max-shard-size", "abc"])
    assert usage.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: argument --max-shard-size: invalid size value: 'abc' (see "), err
    assert not (tmp_path / "x").exists()
    assert convert.main([str(ROOT / "assets/tiny_llama"), str(tmp_path / "copy"), "--to", "hf"]) == 0
    assert inspect_script.main([str(tmp_path / "copy")]) == 0
    shard = tmp_path / "copy" / "model-00003-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert inspect_script.main([str(tmp_path / "copy")]) == 1
    assert "manifest: FAILS: model-00003-of-00003.safetensors does not match its hash" in capsys.readouterr().out
