"""The tiny recipe end to end: once in a process of its own in another working directory, the rest in this process
(a fresh ``python recipes/full_finetune.py`` is tests/test_import_names.py's, and the wheel's in test_waypoint_command)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from waypoint.checkpointers import load_model
from tests import recipe_runs
from tests.conftest import ROOT


def run_recipe(*overrides, cwd=None):
    """recipes/full_finetune.py on configs/tiny.yaml; with ``cwd``: in a process of its own there (tests/launch.py)."""
    return recipe_runs.run_recipe("full", ["--config", str(ROOT / "configs/tiny.yaml"), *overrides], cwd=cwd)


@pytest.mark.slow
def test_tiny_recipe_loss_falls_and_output_is_a_drop_in_replacement(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    result = run_recipe(f"output_dir={out}", "epochs=1", "checkpointer=hf", f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
                        f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", cwd=tmp_path)  # relative paths from elsewhere
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, f"loss did not fall clearly: {first:.3f} -> {last:.3f}"

    step_dir = out / f"step_{len(records)}"
    source = ROOT / "assets/tiny_llama"
    # the input's files, and the prompt it trained on as its chat template (the input has none): prompted as trained
    assert sorted(set(os.listdir(step_dir)) - {"MANIFEST.json", "recipe_state.pt"}) == sorted(os.listdir(source) + ["chat_template.jinja"])
    assert "note: chat_template.jinja: the built-in template 'alpaca' the run trains with, for the output" in result.stdout
    assert json.loads((step_dir / "model.safetensors.index.json").read_text())["weight_map"] == \
        json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_model(step_dir).eval()(tokens)
        theirs = AutoModelForCausalLM.from_pretrained(step_dir).eval()(tokens).logits
        before = load_model(source).eval()(tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert not torch.allclose(ours, before), "the output must hold the fine-tuned weights"
    assert_prompted_as_trained(step_dir)

    common = [f"output_dir={out}", "epochs=1", f"checkpointer.checkpoint_dir={source}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}"]
    again = run_recipe(*common)
    assert again.returncode == 0 and "run already finished" in again.stdout, again.stdout + again.stderr
    fresh = run_recipe(*common, "resume=false")
    assert fresh.returncode == 1 and "already holds checkpoints" in fresh.stderr


def assert_prompted_as_trained(step_dir):
    """transformers' apply_chat_template on the output renders each instruction as the tokens it was trained on."""
    from transformers import AutoTokenizer

    from waypoint.text.instruction_templates import TEMPLATES
    from waypoint.text.tokenizer import load_tokenizer
    from waypoint.data.instruct_dataset import read_records

    theirs, ours = AutoTokenizer.from_pretrained(step_dir), load_tokenizer(step_dir)
    records = [r for r in read_records(ROOT / "assets/tiny_alpaca.jsonl") if not r["input"]]
    assert records
    for r in records:
        trained = ours.encode(TEMPLATES["alpaca"].format(r["instruction"]), add_bos=True, add_eos=False)
        prompt = theirs.apply_chat_template([{"role": "user", "content": r["instruction"]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        assert list(prompt) == trained, r["instruction"]


def test_gradient_accumulation_equals_the_large_batch(tmp_path):
    """2 x 4 accumulated == 8 in one batch: the same first-step loss and the same weights after it."""
    common = ["epochs=1", "max_steps_per_epoch=1", f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
              f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}"]
    a = run_recipe(f"output_dir={tmp_path / 'a'}", "batch_size=8", "gradient_accumulation_steps=1", *common)
    b = run_recipe(f"output_dir={tmp_path / 'b'}", "batch_size=4", "gradient_accumulation_steps=2", *common)
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    loss_a = json.loads((tmp_path / "a/metrics.jsonl").read_text())["loss"]
    loss_b = json.loads((tmp_path / "b/metrics.jsonl").read_text())["loss"]
    assert abs(loss_a - loss_b) < 1e-5


@pytest.mark.parametrize("recipe", ["full", "lora"])
def test_the_final_export_is_read_back_before_it_is_committed(recipe, tmp_path, capsys, monkeypatch):
    """verify_export: a converter that writes a broken model (the RoPE permutation not undone on the way out) makes
    the final save fail in one line, with nothing of it committed and the earlier step intact; the line of a good
    export is in the log."""
    from recipes import full_finetune, lora_finetune
    from waypoint.checkpointers.commit import verify
    from waypoint.converters.ops import RopePermute

    main = full_finetune.main if recipe == "full" else lora_finetune.main
    args = ["--config", str(ROOT / ("configs/tiny.yaml" if recipe == "full" else "configs/tiny_lora.yaml")),
            f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}", f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}",
            "epochs=1", "max_steps_per_epoch=4", "save_every_n_steps=2", "keep_last_n_checkpoints=null"]
    assert main([*args, f"output_dir={tmp_path / 'good'}"]) == 0
    assert "export verified: max |dlogit|" in capsys.readouterr().out
    monkeypatch.setattr(RopePermute, "inverse", lambda self, tensors: list(tensors))
    assert main([*args, f"output_dir={tmp_path / 'broken'}"]) == 1
    assert "error: the export does not compute what was written" in capsys.readouterr().err
    assert verify(tmp_path / "broken/step_2").ok and not (tmp_path / "broken/step_4").exists()
    assert not list((tmp_path / "broken").glob(".step_*")), "a half-written step was left behind"
