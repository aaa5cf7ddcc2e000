"""Meta (single and model-parallel) and native checkpoints, with transformers as the oracle."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from waypoint.checkpointers import (CheckpointError, HFCheckpointer, MetaCheckpointer, NativeCheckpointer, build_model,
                                    detect_format, load_into, load_model)
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.checkpointers import Conversion, write_checkpoint
from waypoint.families import get_converter
from tests.conftest import tiny_llama_config, write_hf_checkpoint


# -- Meta -------------------------------------------------------------------------------------------
def hf_to_meta_oracle(hf_state, config):
    """Meta keys from HF keys, inverting transformers' convert_llama_weights_to_hf.py (its permute and mapping),
    independently of our converter."""
    n_heads, n_kv, dim = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim = dim // n_heads

    def unpermute(w, heads):  # the script: permute(w) = w.view(h, d1 // h // 2, 2, d2).transpose(1, 2).reshape(d1, d2)
        d1, d2 = w.shape
        return w.view(heads, 2, d1 // heads // 2, d2).transpose(1, 2).reshape(d1, d2)

    meta = {"tok_embeddings.weight": hf_state["model.embed_tokens.weight"], "norm.weight": hf_state["model.norm.weight"],
            "output.weight": hf_state["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        meta.update({
            f"layers.{i}.attention.wq.weight": unpermute(hf_state[p + "self_attn.q_proj.weight"], n_heads),
            f"layers.{i}.attention.wk.weight": unpermute(hf_state[p + "self_attn.k_proj.weight"], n_kv),
            f"layers.{i}.attention.wv.weight": hf_state[p + "self_attn.v_proj.weight"],
            f"layers.{i}.attention.wo.weight": hf_state[p + "self_attn.o_proj.weight"],
            f"layers.{i}.feed_forward.w1.weight": hf_state[p + "mlp.gate_proj.weight"],
            f"layers.{i}.feed_forward.w3.weight": hf_state[p + "mlp.up_proj.weight"],
            f"layers.{i}.feed_forward.w2.weight": hf_state[p + "mlp.down_proj.weight"],
            f"layers.{i}.attention_norm.weight": hf_state[p + "input_layernorm.weight"],
            f"layers.{i}.ffn_norm.weight": hf_state[p + "post_attention_layernorm.weight"],
        })
    assert head_dim * n_heads == dim
    return {k: v.contiguous() for k, v in meta.items()}


def write_meta_checkpoint(path, meta, config, n_files, embedding_dim):
    path.mkdir(parents=True)
    column = ("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "output.weight")
    row = ("wo.weight", "w2.weight")
    for index in range(n_files):
        shard = {}
        for key, t in meta.items():
            split = embedding_dim if key == "tok_embeddings.weight" else 0 if key.endswith(column) else 1 if key.endswith(row) else None
            shard[key] = t.chunk(n_files, dim=split)[index].clone() if split is not None and n_files > 1 else t.clone()
        shard["rope.freqs"] = torch.arange(8.0)
        torch.save(shard, path / f"consolidated.{index:02d}.pth")
    params = {"dim": config.hidden_size, "n_layers": config.num_hidden_layers, "n_heads": config.num_attention_heads,
              "n_kv_heads": config.num_key_value_heads, "vocab_size": -1, "multiple_of": 32, "ffn_dim_multiplier": None,
              "norm_eps": config.rms_norm_eps}
    (path / "params.json").write_text(json.dumps(params))
    (path / "tokenizer.model").write_bytes(b"sentencepiece model bytes")


@pytest.fixture
def meta_case(tmp_path, request):
    n_files, embedding_dim = request.param
    # hidden 64: Meta's FFN width for multiple_of=32 is 192
    config = tiny_llama_config(n_heads=4, n_kv_heads=2, hidden=64)
    config.intermediate_size = 192
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(config).eval()
    meta = hf_to_meta_oracle(hf_model.state_dict(), config)
    write_meta_checkpoint(tmp_path / "meta", meta, config, n_files, embedding_dim)
    return hf_model, config, tmp_path / "meta"


@pytest.mark.parametrize("meta_case", [(1, None), (2, 1), (4, 0)], indirect=True, ids=["1-file", "2-files-llama2", "4-files-llama3"])
def test_meta_loads_with_transformers_logits_and_round_trips_bitwise(meta_case, tokens, tmp_path):
    hf_model, config, path = meta_case
    assert detect_format(path) == "meta"
    model = load_model(path).eval()
    with torch.no_grad():
        diff = (model(tokens) - hf_model(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff

    # Meta -> native -> HF (our Llama converter) loads in transformers with the same logits
    native = {k: v for k, v in model.state_dict().items()}
    hf_state = get_converter("LLAMA2", config.to_dict()).from_native(native)
    from transformers import LlamaForCausalLM
    again = LlamaForCausalLM(config).eval()
    again.load_state_dict(hf_state, strict=True)
    with torch.no_grad():
        assert (again(tokens).logits - hf_model(tokens).logits).abs().max().item() <= 1e-5

    # Meta -> native -> Meta: the same files, each with its twin's keys in its order (rope.freqs, unused by
    # the model, written back as it came), bitwise
    ckpt = MetaCheckpointer(path, output_dir=tmp_path / "out")
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=1)
    files = sorted(f for f in os.listdir(path) if f.endswith(".pth"))
    assert sorted(f for f in os.listdir(out) if f.endswith(".pth")) == files
    for name in files:
        before, after = read_tensors(path / name), read_tensors(out / name)
        assert list(after) == list(before), name
        assert all(torch.equal(before[k], after[k]) for k in before), name
    assert (out / "params.json").read_text() == (path / "params.json").read_text()
    assert (out / "tokenizer.model").read_bytes() == (path / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("meta_case", [(2, 1)], indirect=True)
def test_meta_bad_input(meta_case):
    _, _, path = meta_case
    params = json.loads((path / "params.json").read_text())
    (path / "params.json").write_text(json.dumps({**params, "n_kv_heads": 4}))
    with pytest.raises(CheckpointError, match="params.json is inconsistent with the tensors: n_kv_heads 4"):
        MetaCheckpointer(path, output_dir=path).load_checkpoint()
    (path / "params.json").write_text(json.dumps(params))
    shard = torch.load(path / "consolidated.01.pth", weights_only=True)
    shard["layers.0.attention.wo.weight"] = shard["layers.0.attention.wo.weight"][:10]
    torch.save(shard, path / "consolidated.01.pth")
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attention\.wo\.weight' does not join along dim 1"):
        MetaCheckpointer(path, output_dir=path).load_checkpoint()


# -- native -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_native_round_trip_and_tied_storage(tmp_path, tokens, tie):
    hf_model = write_hf_checkpoint(tmp_path / "hf", tiny_llama_config(tie=tie))
    hf = HFCheckpointer(tmp_path / "hf", output_dir=tmp_path)
    state = hf.load_checkpoint()["model"]
    with torch.device("meta"):
        model = build_model(tmp_path / "hf")
    load_into(model, state)
    native_dir = write_checkpoint(model.state_dict(), Conversion(model.args), "native", tmp_path / "native",
                                         side_files=[tmp_path / "hf" / "tokenizer_config.json"])
    assert detect_format(native_dir) == "native"

    reloaded = load_model(native_dir).eval()
    with torch.no_grad():
        assert (reloaded(tokens) - hf_model(tokens).logits).abs().max().item() <= 1e-5
    with safe_open(str(native_dir / "model.safetensors"), "pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    if tie:
        assert "output.weight" not in keys and json.loads(metadata["waypoint_aliases"]) == {"output.weight": "tok_embeddings.weight"}
        assert reloaded.output.weight is reloaded.tok_embeddings.weight
        assert sum(p.numel() for p in reloaded.parameters()) == sum(v.numel() for v in read_tensors(native_dir / "model.safetensors").values())
    else:
        assert "output.weight" in keys

    ckpt = NativeCheckpointer(native_dir, output_dir=tmp_path / "out")
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=3)
    before, after = read_tensors(native_dir / "model.safetensors"), read_tensors(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert (out / "waypoint_model.json").read_text() == (native_dir / "waypoint_model.json").read_text()
    assert (out / "tokenizer_config.json").is_file()


def test_native_reads_torch_files(tmp_path, tokens):
    hf_model = write_hf_checkpoint(tmp_path / "hf", tiny_llama_config())
    model = load_model(tmp_path / "hf")
    native_dir = write_checkpoint(model.state_dict(), Conversion(model.args), "native", tmp_path / "native")
    tensors = read_tensors(native_dir / "model.safetensors")
    (native_dir / "model.safetensors").unlink()
    (native_dir / "MANIFEST.json").unlink()
    torch.save(tensors, native_dir / "model.pt")
    with torch.no_grad():
        assert (load_model(native_dir).eval()(tokens) - hf_model(tokens).logits).abs().max().item() <= 1e-5


# -- extra state in every format (the resume issue) ----------------------------------------------------
@pytest.mark.parametrize("fmt", ["hf", "meta", "native"])
def test_extra_state_survives_every_checkpointer(tmp_path, fmt):
    from waypoint.checkpointers import checkpointer_for

    hf_model = write_hf_checkpoint(tmp_path / "hf", tiny_llama_config())
    if fmt == "hf":
        source = tmp_path / "hf"
    elif fmt == "native":
        model = load_model(tmp_path / "hf")
        source = write_checkpoint(model.state_dict(), Conversion(model.args), "native", tmp_path / "native")
    else:
        config = tiny_llama_config()
        meta = hf_to_meta_oracle(hf_model.state_dict(), config)
        write_meta_checkpoint(tmp_path / "meta", meta, config, 2, 1)
        params = json.loads((tmp_path / "meta/params.json").read_text())
        params.pop("multiple_of")
        (tmp_path / "meta/params.json").write_text(json.dumps(params))
        source = tmp_path / "meta"
    ckpt = checkpointer_for(source, output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()
    assert not any(k.endswith("_extra_state") for k in state["model"]), "the input has no extra state"
    lazy = {"p": torch.randn(5), "draws": 1, "note": "set at step 3"}
    state["model"]["calibration._extra_state"] = lazy
    out = ckpt.save_checkpoint(state, step=3)
    back = checkpointer_for(out).load_checkpoint()["model"]["calibration._extra_state"]
    assert torch.equal(back["p"], lazy["p"]) and back["draws"] == 1 and back["note"] == "set at step 3"
    with pytest.raises(CheckpointError, match="calibration._extra_state: extra state holds a object"):
        ckpt.save_checkpoint({"model": {**state["model"], "calibration._extra_state": {"x": object()}}}, step=4)


@pytest.mark.parametrize("meta_case", [(1, None)], indirect=True)
def test_meta_llama31_scaled_rope_matches_transformers(meta_case, tokens):
    """params.json use_scaled_rope == transformers' rope_type llama3 with factor 8, low 1, high 4, 8192 positions."""
    from transformers import LlamaForCausalLM

    hf_model, config, path = meta_case
    params = json.loads((path / "params.json").read_text())
    (path / "params.json").write_text(json.dumps({**params, "use_scaled_rope": True, "rope_theta": 500000.0}))
    scaled = config.to_dict() | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192}}
    reference = LlamaForCausalLM(type(config).from_dict(scaled)).eval()
    reference.load_state_dict(hf_model.state_dict())
    model = load_model(path).eval()
    assert model.args.rope_type == "llama3"
    with torch.no_grad():
        assert (model(tokens) - reference(tokens).logits).abs().max().item() <= 1e-5
