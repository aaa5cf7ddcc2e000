"""Load reports from what was assigned, strictness, and heady/headless/nested prefix mapping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from waypoint.checkpointers import CheckpointError, HFCheckpointer, load_into, load_model
from waypoint.checkpointers.load_report import fold_keys
from waypoint.models import Transformer
from tests.conftest import tiny_llama_config, write_hf_checkpoint


@pytest.fixture
def native(tmp_path):
    write_hf_checkpoint(tmp_path / "hf", tiny_llama_config(layers=3))
    model = load_model(tmp_path / "hf")
    return model.args, {k: v.clone() for k, v in model.state_dict().items()}


def test_fold_keys():
    keys = [f"layers.{i}.attn.q_proj.weight" for i in range(32)] + ["layers.3.mlp.w1.weight", "layers.5.mlp.w1.weight", "norm.weight"]
    assert fold_keys(keys) == ["layers.{0..31}.attn.q_proj.weight", "layers.{3,5}.mlp.w1.weight", "norm.weight"]
    experts = [f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight" for i in range(2) for e in range(8)]
    assert fold_keys(experts) == ["model.layers.{0..1}.mlp.experts.{0..7}.gate_proj.weight"]


def test_report_lists_what_was_assigned(native):
    args, state = native
    with torch.device("meta"):
        model = Transformer(args)
    report = load_into(model, state)
    assert set(report.loaded) == set(state) and not (report.missing or report.unexpected or report.retied)
    assert "loaded 30 tensors: layers.{0..2}.attn.k_proj.weight" in str(report)


def test_untied_checkpoint_into_tied_model_is_reported_as_retied(native):
    """Key lists say output.weight matched; what happened is that it was re-tied to the embedding."""
    from dataclasses import replace

    args, state = native
    with torch.device("meta"):
        model = Transformer(replace(args, tie_embeddings=True))
    report = load_into(model, state)
    assert report.retied == ["output.weight"] and "output.weight" not in report.loaded
    assert model.output.weight is model.tok_embeddings.weight
    assert RETIED in report.lines()


# the report's line for a tied model's head: what "re-tied" means, said where it is printed
RETIED = ("re-tied: output.weight (the same tensor as tok_embeddings.weight: the model ties these weights, so it is not "
          "read from the checkpoint)")


def test_tied_checkpoint_without_a_head_says_what_re_tied_means(native):
    """A tied checkpoint (Llama 3.2's, Qwen2.5's small sizes) has no output.weight: the head is the embedding table."""
    from dataclasses import replace

    args, state = native
    state.pop("output.weight")
    with torch.device("meta"):
        model = Transformer(replace(args, tie_embeddings=True))
    report = load_into(model, state)
    assert report.retied == ["output.weight"] and report.tied_to == {"output.weight": "tok_embeddings.weight"}
    assert RETIED in report.lines()


def test_heady_checkpoint_into_headless_model_drops_and_reports_the_head(native):
    args, state = native
    with torch.device("meta"):
        model = Transformer(args)
    del model.output
    model.tie_weights = lambda: None
    report = load_into(model, state)
    assert report.unexpected == ["output.weight"] and len(report.loaded) == len(state) - 1


def test_headless_checkpoint_needs_strict_false_for_a_new_head(native):
    args, state = native
    state.pop("output.weight")
    with torch.device("meta"):
        model = Transformer(args)
    with pytest.raises(CheckpointError, match="lacks model key 'output.weight'.*strict=false"):
        load_into(model, state)
    with torch.device("meta"):
        model = Transformer(args)
    report = load_into(model, state, strict=False)
    assert report.missing == ["output.weight"] and not model.output.weight.is_meta
    assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, args.vocab_size)


class RewardModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.backbone = Transformer(args)
        self.score = nn.Linear(args.dim, 1, bias=False)


def test_nested_backbone_is_detected(native):
    args, state = native
    with torch.device("meta"):
        model = RewardModel(args)
    with pytest.raises(CheckpointError, match="lacks model key 'score.weight'"):
        load_into(model, state)
    with torch.device("meta"):
        model = RewardModel(args)
    report = load_into(model, state, strict=False)
    assert report.missing == ["score.weight"] and len(report.loaded) == len(state)
    assert "renamed 30 keys: (none) -> backbone." in str(report)
    assert torch.equal(model.backbone.norm.weight, state["norm.weight"])


def test_declared_prefix_map(native):
    args, state = native
    renamed = {"decoder." + k: v for k, v in state.items()}
    with torch.device("meta"):
        model = RewardModel(args)
    report = load_into(model, renamed, strict=False, key_prefix_map={"decoder.": "backbone."})
    assert len(report.loaded) == len(state) and report.missing == ["score.weight"]


def test_headless_hf_checkpoint_round_trips_with_its_own_keys(tmp_path):
    from transformers import LlamaModel


    torch.manual_seed(0)
    LlamaModel(tiny_llama_config()).save_pretrained(tmp_path / "in", max_shard_size="60KB")
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()
    assert "output.weight" not in state["model"] and "tok_embeddings.weight" in state["model"]
    out = ckpt.save_checkpoint(state, step=1)
    from waypoint.checkpointers.file_formats import read_tensors
    for f in sorted((tmp_path / "in").glob("*.safetensors")):
        before, after = read_tensors(f), read_tensors(out / f.name)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        hf = LlamaModel.from_pretrained(out).eval()
        tokens = torch.randint(0, 128, (1, 7))
        with torch.device("meta"):
            ours = Transformer(ckpt.model_args())
        report = load_into(ours, state["model"], strict=False)
        assert report.missing == ["output.weight"]
        h = ours.norm(ours.layers[1](ours.layers[0](ours.tok_embeddings(tokens), ours.rope), ours.rope))
        assert (h - hf(tokens).last_hidden_state).abs().max() <= 1e-5
