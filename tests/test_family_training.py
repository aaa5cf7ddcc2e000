"""Each 2026 family and MoE layout through the real recipe: a tiny checkpoint written by the family's own
transformers class trains with the loss falling, a SIGTERM mid-run checkpoints and exits 75, rerunning the same
command finishes bit-identical to a run that never stopped, and the output is the input's files and key map.

In-process (``full_finetune.main``) to keep the suite fast; the signal is a real one sent to this process."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from recipes import full_finetune
from waypoint.checkpointers.file_formats import read_tensors
from tests.conftest import ROOT, sigterm_at_step, tiny_family_config, write_family_checkpoint, write_mxfp4_checkpoint

TINY = ROOT / "assets/tiny_llama"
STEPS, STOP_AT = 6, 3
# name -> (tiny_family_config family, packed MoE experts)
FAMILIES = {
    "llama3.2": ("llama32", False),
    "mistral-nemo": ("mistral_nemo", False),
    "phi4": ("phi4", False),
    "qwen3": ("qwen3", False),
    "gemma2": ("gemma2", False),
    "gemma3": ("gemma3", False),
    "mixtral": ("mixtral", False),
    "qwen3-moe-packed": ("qwen3_moe", True),
    "qwen2-moe": ("qwen2_moe", False),  # a gated shared expert beside the routed ones
    "gpt-oss-mxfp4": ("gpt_oss", False),  # the experts in MXFP4, as released: written back so
    "deepseek-v3": ("deepseek_v3", False),  # latent attention, grouped sigmoid routing, shared experts
}


def base_checkpoint(path, name):
    family, packed = FAMILIES[name]
    # the tiny tokenizer's vocabulary; positions for the 128-token samples
    config = tiny_family_config(family, vocab_size=512, max_position_embeddings=256)
    if name.endswith("mxfp4"):
        write_mxfp4_checkpoint(path, config)
    else:
        write_family_checkpoint(path, config, packed=packed)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, path / f)
    return path


def run(base, out, stop_at=None):
    with sigterm_at_step(stop_at):
        return full_finetune.main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={base}",
                                   f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", f"output_dir={out}", "epochs=1",
                                   f"max_steps_per_epoch={STEPS}", "batch_size=4", "lr_scheduler.num_warmup_steps=1",
                                   "save_every_epoch=true"])


def weights(step_dir):
    return {k: t for f in sorted(step_dir.glob("*.safetensors")) for k, t in read_tensors(f, packed=lambda key: True).items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_stops_on_sigterm_and_resumes_bit_exactly(name, tmp_path):
    base = base_checkpoint(tmp_path / "base", name)
    assert run(base, tmp_path / "straight") == 0
    records = [json.loads(line) for line in (tmp_path / "straight/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == STEPS and sum(losses[-2:]) < sum(losses[:2]), f"{name}: the loss did not fall: {losses}"
    assert ("aux_loss" in records[0]) == name.startswith(("mixtral", "qwen3-moe", "qwen2-moe", "gpt-oss", "deepseek")), "MoE runs log their load-balancing loss"

    assert run(base, tmp_path / "stopped", stop_at=STOP_AT) == 75
    assert (tmp_path / "stopped" / f"step_{STOP_AT}").is_dir()
    assert run(base, tmp_path / "stopped") == 0
    records = [json.loads(line) for line in (tmp_path / "stopped/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "the rerun continued from the checkpoint, not from the start"
    assert [r["step"] for r in records if r.get("resumed")] == [STOP_AT + 1], "the resumed segment is marked"
    final, expected = tmp_path / "stopped" / f"step_{STEPS}", tmp_path / "straight" / f"step_{STEPS}"
    mine, theirs = weights(final), weights(expected)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), f"{name}: resume is not bit-exact"
    # the output is the input's files, key map and config
    assert sorted(p.name for p in final.glob("*.safetensors")) == sorted(p.name for p in base.glob("*.safetensors"))
    index = json.loads((final / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((final / "config.json").read_text()) == json.loads((base / "config.json").read_text())
