import pytest
import torch

from waypoint.converters import CheckpointError, Converter, RopePermute, Rule
from waypoint.families import get_converter
from tests.conftest import tiny_llama_config


@pytest.mark.parametrize("n_heads,head_dim,cols", [(4, 16, 64), (2, 24, 64), (3, 8, 0)])
def test_rope_permute_is_reversible_and_matches_hf_reference(n_heads, head_dim, cols):
    shape = (n_heads * head_dim, cols) if cols else (n_heads * head_dim,)
    w = torch.randn(shape)
    op = RopePermute(n_heads, head_dim)
    native = op.forward([w])[0]
    assert torch.equal(op.inverse([native])[0], w)
    # transformers' convert_llama_weights_to_hf.py: permute(meta) = view(h, hd//2, 2, dim).transpose(1, 2)
    ref = native.reshape(n_heads, head_dim // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
    assert torch.equal(ref, w)
    assert not torch.equal(native, w)


def test_unknown_key_is_named():
    conv = get_converter("LLAMA2", tiny_llama_config().to_dict())
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias.*in shard-1"):
        conv.to_native({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, where={"model.layers.0.self_attn.q_proj.bias": "shard-1"})


def test_inv_freq_ignored_and_unknown_model_type_listed():
    conv = get_converter("llama3", tiny_llama_config().to_dict())
    assert conv.to_native({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}) == {}
    with pytest.raises(CheckpointError, match="known: LLAMA2, LLAMA3"):
        get_converter("GPT9", {})


def test_fused_group_round_trip():
    # A one-to-many rule (as Phi-3's fused qkv will use) goes through the same table machinery.
    class Split:
        def forward(self, ts):
            return list(ts[0].chunk(2))

        def inverse(self, ts):
            return [torch.cat(ts)]

    conv = Converter([Rule("blk.{i}.ab", ("l.{i}.a", "l.{i}.b"), Split())])
    hf = {"blk.3.ab": torch.arange(6.0)}
    native = conv.to_native(hf)
    assert set(native) == {"l.3.a", "l.3.b"}
    assert torch.equal(conv.from_native(native)["blk.3.ab"], hf["blk.3.ab"])
    with pytest.raises(CheckpointError, match=r"l\.3\.b missing"):
        conv.from_native({"l.3.a": native["l.3.a"]})


def test_released_pages_of_a_mapped_tensor_read_back_and_memory_tensors_are_left_alone(tmp_path):
    from safetensors.torch import save_file

    from waypoint.checkpointers.file_formats import read_tensors
    from waypoint.lazy import release_pages

    original = torch.randn(256, 1024)
    save_file({"w": original, "b": torch.randn(3)}, tmp_path / "w.safetensors")
    mapped = read_tensors(tmp_path / "w.safetensors")["w"]
    release_pages(mapped)
    assert torch.equal(mapped, original), "pages dropped from a file mapping fault back in from the file"
    in_memory = original.clone()
    release_pages(in_memory)  # anonymous memory would be zeroed: it must be left alone
    assert torch.equal(in_memory, original)
