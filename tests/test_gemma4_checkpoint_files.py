"""What Gemma 4's files say about themselves, written back as transformers wrote them: the output index's
``total_parameters`` (the clip bounds of the vision tower and of the carried audio tower, and the tower's
standardization, are buffers, as ``num_parameters()`` counts), and a checkpoint that lacks a weight its config asks
for (the per-layer embeddings), refused at load in one line naming the file key and the file, with no ``strict=false``
advice: every save writes the input's layout, so a weight trained in from nothing could never be written."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.conftest import tiny_family_config, write_family_checkpoint
from tests.test_gemma4_vision import AUDIO, TEXT, VISION
from waypoint.checkpointers import HFCheckpointer, load_model
from waypoint.checkpointers.load_model import load_into
from waypoint.errors import CheckpointError
from waypoint.models.transformer import Transformer


def test_the_output_index_counts_the_parameters_transformers_counts(tmp_path):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from waypoint.checkpointers.file_formats import read_tensors

    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=dict(TEXT, hidden_size_per_layer_input=8),
                                                     vision_config=VISION, audio_config=AUDIO, image_token_id=260))
    hf.save_pretrained(tmp_path / "in", max_shard_size="200KB")
    index_in = json.loads((tmp_path / "in/model.safetensors.index.json").read_text())
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    out = ckpt.save_checkpoint({"model": ckpt.load_checkpoint()["model"]}, step=1)
    index_out = json.loads((out / "model.safetensors.index.json").read_text())
    assert index_out["metadata"]["total_parameters"] == index_in["metadata"]["total_parameters"] == hf.num_parameters()
    # key by key, the files' own names: a buffer is what transformers registers as one (the audio tower's included)
    parameters = dict(hf.named_parameters())
    keys = [k for f in sorted(set(index_in["weight_map"].values())) for k in read_tensors(tmp_path / "in" / f)]
    assert any(k.startswith("model.audio_tower.") and k.endswith("_max") for k in keys)
    assert [k for k in keys if ckpt.converter.is_parameter(k) != (k in parameters)] == []


@pytest.fixture(scope="module")
def without_ple_table(tmp_path_factory):
    """A text Gemma 4 with per-layer embeddings whose files lack the per-layer table."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("gemma4_no_ple")
    write_family_checkpoint(path, tiny_family_config("gemma4", hidden_size_per_layer_input=8), max_shard_size="10GB")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.embed_tokens_per_layer.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_missing_weight_the_config_asks_for_is_refused_without_strict_false_advice(without_ple_table):
    with pytest.raises(CheckpointError) as e:
        load_model(without_ple_table)
    message = str(e.value)
    assert message.startswith("model.safetensors: checkpoint lacks 'model.embed_tokens_per_layer.weight' (the model's "
                              "'per_layer.embeddings.weight')"), message
    assert "strict=false" not in message and "re-download or re-export it" in message and "\n" not in message


class Scored(nn.Module):
    """A backbone nested under ``backbone.``, with a new head beside it."""

    def __init__(self, args) -> None:
        super().__init__()
        self.backbone = Transformer(args)
        self.score = nn.Linear(args.dim, 1, bias=False)


def test_a_nested_backbone_names_the_file_key_and_a_new_head_keeps_its_advice(without_ple_table):
    """The missing table under a model's ``backbone.`` prefix is still the file's key; a head no file key stands for
    (the saver writes none) is what strict=false is for."""
    ckpt = HFCheckpointer(without_ple_table, output_dir=without_ple_table / "out")
    with torch.device("meta"):
        model = Scored(ckpt.model_args())
    with pytest.raises(CheckpointError, match=r"checkpoint lacks 'model\.embed_tokens_per_layer\.weight' \(the model's "
                                              r"'backbone\.per_layer\.embeddings\.weight'\)") as e:
        load_into(model, ckpt.load_checkpoint()["model"])
    assert "strict=false" not in str(e.value)
    state = dict(ckpt.load_checkpoint()["model"])  # a plain dict: the file keys are not known
    state["per_layer.embeddings.weight"] = torch.zeros(model.backbone.per_layer.embeddings.weight.shape)
    from waypoint.converters.table import ConvertedState

    complete = ConvertedState(ckpt.converter, ["model.safetensors"])
    complete.update(state)
    with torch.device("meta"):
        model = Scored(ckpt.model_args())
    with pytest.raises(CheckpointError, match=r"lacks model key 'score\.weight' \(strict: set strict=false"):
        load_into(model, complete)
