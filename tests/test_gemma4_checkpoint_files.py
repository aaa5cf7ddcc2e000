"""What Gemma 4's files say about themselves, written back as transformers wrote them: the output index's
``total_parameters`` (the clip bounds of the vision tower and of the carried audio tower, and the tower's
standardization, are buffers, as ``num_parameters()`` counts)."""

from __future__ import annotations

import json

from tests.test_gemma4_vision import AUDIO, TEXT, VISION
from waypoint.checkpointers import HFCheckpointer


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
