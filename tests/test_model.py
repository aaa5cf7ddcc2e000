import json

import pytest
import torch

from waypoint.families import from_hf_config, model_args_from_hf_config
from waypoint.families.llama import llama2_7b, llama3_8b
from waypoint.models import ModelArgs, Transformer, parse_dtype


def tiny_args(**kw):
    return ModelArgs(**{**dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, hidden_dim=48, max_seq_len=32), **kw})


def test_logits_shape_and_activation_checkpointing_changes_nothing():
    torch.manual_seed(0)
    model = Transformer(tiny_args())
    model.init_weights()
    tokens = torch.randint(0, 50, (3, 9))
    out = model(tokens)
    assert out.shape == (3, 9, 50)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.activation_checkpointing = True
    out2 = model(tokens)
    out2.sum().backward()
    assert torch.equal(out, out2)
    assert all(torch.allclose(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_tied_output_is_one_parameter():
    model = Transformer(tiny_args(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_meta_build_allocates_nothing():
    with torch.device("meta"):
        model = llama2_7b()
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616  # Llama-2-7b-hf's parameter count
    with torch.device("meta"):
        assert sum(p.numel() for p in llama3_8b().parameters()) == 8_030_261_248


def test_hf_config_fields_v4_and_v5():
    v5 = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 100, "head_dim": 24, "rms_norm_eps": 1e-6,
          "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "max_position_embeddings": 77,
          "tie_word_embeddings": True, "dtype": "bfloat16"}
    args = model_args_from_hf_config(v5)
    assert (args.resolved_head_dim, args.rope_theta, args.norm_eps, args.max_seq_len, args.tie_embeddings, args.n_kv_heads) == (24, 500000.0, 1e-6, 77, True, 2)
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "head_dim", "num_key_value_heads")} | {"rope_theta": 1234.0}
    args = model_args_from_hf_config(v4)
    assert (args.rope_theta, args.resolved_head_dim, args.n_kv_heads) == (1234.0, 16, 4)
    with pytest.raises(KeyError, match="vocab_size"):
        model_args_from_hf_config({k: v for k, v in v5.items() if k != "vocab_size"})
    assert parse_dtype("bf16") is parse_dtype("torch.bfloat16") is torch.bfloat16


def test_from_hf_config_accepts_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                                                      "num_hidden_layers": 1, "vocab_size": 10}))
    assert from_hf_config(tmp_path).args.dim == 32
