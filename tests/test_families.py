"""Every model family against transformers as the oracle: tiny random checkpoints written by the family's own
class, loaded into the native model (logits), saved back (files, keys, bytes) and re-read by transformers."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from waypoint.checkpointers import CheckpointError, HFCheckpointer, load_into, load_model
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.converters import Chain, Identity, PerTensor, RopePermute, Split
from waypoint.families import detect_model_type, from_hf_config, get_converter, model_args_from_hf_config
from waypoint.models import ModelArgs, Transformer
from waypoint.models.transformer import RMSNorm, rope_frequencies
from tests.conftest import tiny_family_config, write_family_checkpoint

# name -> (tiny_family_config family, overrides, detected model type); "-packed": MoE experts in transformers' layout
FAMILIES = {
    "llama2": ("llama", {}, "LLAMA2"),
    "llama3.1-rope-scaling": ("llama31", {}, "LLAMA3"),
    "mistral-sliding-window": ("mistral", {}, "MISTRAL"),  # window 5 < the 13 test tokens
    "qwen2": ("qwen2", {}, "QWEN2"),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}, "QWEN2"),
    "qwen2-sliding-layer-1": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), "QWEN2"),
    "gemma": ("gemma", {}, "GEMMA"),  # tied, head_dim 24 != 64 / 4
    "phi3-sliding-window": ("phi3", dict(bos_token_id=1, eos_token_id=2, sliding_window=6), "PHI3"),
    "llama3.2-tied": ("llama32", {}, "LLAMA3_2"),
    "mistral-nemo-head-dim": ("mistral_nemo", {}, "MISTRAL"),
    "phi4": ("phi4", {}, "PHI3"),
    "qwen3": ("qwen3", {}, "QWEN3"),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}, "QWEN3"),
    "gemma2": ("gemma2", {}, "GEMMA2"),
    "gemma2-untied": ("gemma2", {"tie_word_embeddings": False}, "GEMMA2"),
    "gemma3": ("gemma3", {}, "GEMMA3"),
    "mixtral": ("mixtral", {}, "MIXTRAL"),
    "mixtral-packed": ("mixtral", {}, "MIXTRAL"),
    "qwen3-moe": ("qwen3_moe", {}, "QWEN3_MOE"),
    "qwen3-moe-packed": ("qwen3_moe", {}, "QWEN3_MOE"),
    "qwen2-moe": ("qwen2_moe", {}, "QWEN2_MOE"),  # a gated shared expert in each MoE layer, norm_topk_prob false
    "qwen2-moe-packed": ("qwen2_moe", {}, "QWEN2_MOE"),
    "gpt-oss": ("gpt_oss", {}, "GPT_OSS"),  # dense experts; MXFP4 ones: test_gpt_oss.py
    "deepseek-v3": ("deepseek_v3", {}, "DEEPSEEK_V3"),  # q_lora_rank, YaRN + mscale_all_dim, group-limited sigmoid routing
    "deepseek-v3-packed": ("deepseek_v3", {}, "DEEPSEEK_V3"),
    # one q_proj, the rotary rows in halves (rope_interleave false), ungrouped, plain RoPE
    "deepseek-v3-rope-halves": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "DEEPSEEK_V3"),
    "deepseek-v2-lite": ("deepseek_v2", {}, "DEEPSEEK_V2"),  # one q_proj, greedy routing
    "deepseek-v2-grouped": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                routed_scaling_factor=1.5, attention_bias=True), "DEEPSEEK_V2"),
    # hybrid Gated DeltaNet + gated attention (longer sequences: tests/test_qwen3_5.py)
    "qwen3.5": ("qwen3_5", {}, "QWEN3_5"),
    "qwen3.5-tied": ("qwen3_5", {"tie_word_embeddings": True}, "QWEN3_5"),
    "qwen3.5-moe": ("qwen3_5_moe", {}, "QWEN3_5_MOE"),  # transformers writes its experts packed either way
    "qwen3-next": ("qwen3_next", {}, "QWEN3_NEXT"),  # fused in_proj_qkvz / in_proj_ba, a dense layer, experts per key
    "qwen3-next-packed": ("qwen3_next", {}, "QWEN3_NEXT"),
    # Gemma 4 (more in tests/test_gemma4.py): E2B/E4B's per-layer embeddings, kv-shared layers with double-wide MLPs;
    # 31B's keys as values on full layers with their own k/v heads; 26B-A4B's experts beside the MLP
    "gemma4-e4b": ("gemma4", dict(hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True), "GEMMA4"),
    "gemma4-k-eq-v": ("gemma4", dict(attention_k_eq_v=True, num_global_key_value_heads=1), "GEMMA4"),
    "gemma4-moe": ("gemma4", dict(attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=4,
                                  top_k_experts=2, moe_intermediate_size=32), "GEMMA4"),
}
TIED = {"qwen2-tied", "gemma", "llama3.2-tied", "qwen3-tied", "gemma2", "gemma3", "qwen3.5-tied", "gemma4-e4b", "gemma4-k-eq-v",
        "gemma4-moe"}


def weight_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, checkpoint dir), written once per family for all tests of this module."""
    name = request.param
    fam, overrides, _ = FAMILIES[name]
    path = tmp_path_factory.mktemp(name) / "in"
    hf_model = write_family_checkpoint(path, tiny_family_config(fam, **overrides), packed=name.endswith("-packed"))
    return name, hf_model, path


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(7))


def test_load_matches_transformers_logits(family, tokens):
    name, hf_model, path = family
    assert len(weight_files(path)) >= 3, "the fixture must be sharded"
    ckpt = HFCheckpointer(path, output_dir=path.parent / "unused")
    assert ckpt.model_type == FAMILIES[name][2]
    state = ckpt.load_checkpoint()["model"]
    with torch.device("meta"):
        model = from_hf_config(ckpt.config)
    load_into(model, state)
    model.eval()
    with torch.no_grad():
        expected = hf_model(tokens).logits
        diff = (model(tokens) - expected).abs().max().item()
        again = (load_model(path).eval()(tokens) - expected).abs().max().item()
    print(f"\n{name}: max |native - transformers| logit = {diff:.3g} (load_model: {again:.3g})")
    assert diff <= 1e-5 and again <= 1e-5


def test_save_round_trip_is_bitwise_and_transformers_reads_it(family, tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    name, hf_model, path = family
    ckpt = HFCheckpointer(path, output_dir=tmp_path / "out")
    out = ckpt.save_checkpoint(ckpt.load_checkpoint(), step=3)
    assert weight_files(out) == weight_files(path)
    for f in weight_files(path):
        before, after = read_tensors(path / f), read_tensors(out / f)
        assert sorted(after) == sorted(before), f
        for key in before:
            assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    index_in = json.loads((path / "model.safetensors.index.json").read_text())
    index_out = json.loads((out / "model.safetensors.index.json").read_text())
    assert index_out["weight_map"] == index_in["weight_map"]
    assert index_out["metadata"]["total_size"] == index_in["metadata"]["total_size"]
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf_model)
    # against transformers' own reading of the input: a model it loads and the one it built in memory can take
    # different kernels (packed Qwen2-MoE experts differ by 1.5e-7 with transformers 5.24 even for the input itself)
    original = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, original(tokens).logits)


def test_hf_to_native_to_hf_gives_back_the_input(family, tmp_path):
    """Through the native format and back: the same config, files, key -> file map, index and tensors."""
    from scripts import convert

    name, _, path = family
    assert convert.main([str(path), str(tmp_path / "native"), "--to", "native"]) == 0
    assert convert.main([str(tmp_path / "native"), str(tmp_path / "back"), "--to", "hf"]) == 0
    back = tmp_path / "back"
    assert weight_files(back) == weight_files(path)
    for f in ("config.json", "model.safetensors.index.json"):
        assert json.loads((back / f).read_text()) == json.loads((path / f).read_text()), f
    for f in weight_files(path):
        before, after = read_tensors(path / f), read_tensors(back / f)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), f


def test_tied_head_is_the_embedding_and_written_once(family, tmp_path):
    name, hf_model, path = family
    tied = name in TIED
    assert (hf_model.lm_head.weight is hf_model.model.embed_tokens.weight) == tied
    ckpt = HFCheckpointer(path, output_dir=tmp_path / "out")
    state = ckpt.load_checkpoint()
    with torch.device("meta"):
        model = from_hf_config(ckpt.config)
    load_into(model, state["model"])
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    out = ckpt.save_checkpoint({"model": model.state_dict()}, step=1)
    written = {k: t for f in weight_files(out) for k, t in read_tensors(out / f).items()}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in written) == ("lm_head.weight" in index["weight_map"]) == (not tied)
    unique = {p.data_ptr(): nbytes(p) for p in hf_model.state_dict().values()}  # a tied head counts once
    size = sum(nbytes(t) for t in written.values())
    assert size == sum(unique.values()) == index["metadata"]["total_size"]
    assert sum((out / f).stat().st_size for f in weight_files(out)) < size + 4096 * len(weight_files(out))


# -- what the families add, against transformers' own modules ----------------------------------------------------

def test_llama3_rope_frequencies_are_transformers_bitwise():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for original, head_dim in ((8192, 128), (32, 16)):
        config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=4 * original,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": original})
        expected, scaling = ROPE_INIT_FUNCTIONS["llama3"](config)
        ours = rope_frequencies(model_args_from_hf_config(config.to_dict()))
        assert scaling == 1.0 and torch.equal(ours, expected)
        plain = rope_frequencies(dataclasses.replace(model_args_from_hf_config(config.to_dict()), rope_type="default"))
        assert not torch.equal(plain, expected)


def test_norms_and_embedding_scale_match_transformers_bitwise_in_bf16():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm, GemmaTextScaledWordEmbedding
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    w = torch.randn(48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for ours, theirs in ((RMSNorm(48, 1e-6, plus_one=True), GemmaRMSNorm(48, 1e-6)), (RMSNorm(48, 1e-6), LlamaRMSNorm(48, 1e-6))):
        ours.weight.data, theirs.weight.data = w.clone(), w.clone()
        assert torch.equal(ours(x), theirs(x))
    # in bf16 the order matters (so the check above can fail): Gemma multiplies in fp32, then casts
    gemma_norm = RMSNorm(48, 1e-6, plus_one=True)
    gemma_norm.weight.data = w.clone()
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert not torch.equal(gemma_norm(x), (1 + w) * normed.to(torch.bfloat16))

    args = ModelArgs(dim=48, n_layers=0, n_heads=4, n_kv_heads=4, vocab_size=10, hidden_dim=8, embedding_scale=48 ** 0.5)
    model = Transformer(args).to(torch.bfloat16)
    model.output = torch.nn.Identity()
    model.norm = torch.nn.Identity()
    theirs = GemmaTextScaledWordEmbedding(10, 48, 0, embed_scale=48 ** 0.5).to(torch.bfloat16)
    theirs.weight.data = model.tok_embeddings.weight.data.clone()
    ids = torch.arange(10)[None]
    assert torch.equal(model(ids), theirs(ids))


# -- config.json reading ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fam", ["llama", "llama31", "mistral", "qwen2", "gemma", "phi3"])
def test_fields_a_config_leaves_out_take_the_family_defaults(fam):
    """A config.json with only the shapes gives what transformers builds from it (its class defaults)."""
    required = dict(model_type=tiny_family_config(fam).model_type, vocab_size=128, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=32)  # 32: the default kv heads (8, 16, 32) divide it
    full = type(tiny_family_config(fam))(**{k: v for k, v in required.items() if k != "model_type"}).to_dict()
    assert model_args_from_hf_config(required) == model_args_from_hf_config(full)


def test_gemma_legacy_gelu_is_the_tanh_approximation_as_in_transformers():
    from transformers import GemmaConfig

    legacy = {**tiny_family_config("gemma").to_dict(), "hidden_act": "gelu"}
    assert model_args_from_hf_config(legacy).activation == GemmaConfig(hidden_act="gelu").hidden_act == "gelu_pytorch_tanh"
    assert model_args_from_hf_config({**tiny_family_config("llama").to_dict(), "hidden_act": "gelu"}).activation == "gelu"


def test_v4_rope_scaling_and_v5_rope_parameters_agree():
    v5 = tiny_family_config("llama31").to_dict()
    args = model_args_from_hf_config(v5)
    assert (args.rope_type, args.rope_theta, args.rope_factor, args.rope_original_max_seq_len) == ("llama3", 500000.0, 8.0, 32)
    params = dict(v5.pop("rope_parameters"))
    v4 = {**v5, "rope_theta": params.pop("rope_theta"), "rope_scaling": {**params, "type": params.pop("rope_type")}}
    assert model_args_from_hf_config(v4) == args
    # as in transformers, rope_scaling wins over rope_parameters where a config has both
    assert model_args_from_hf_config({**v4, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}) == args
    # transformers gives a top-level original_max_position_embeddings priority over the rope dict's
    assert model_args_from_hf_config({**v4, "original_max_position_embeddings": 64}).rope_original_max_seq_len == 64
    # and falls back to max_position_embeddings
    del v4["rope_scaling"]["original_max_position_embeddings"]
    assert model_args_from_hf_config(v4).rope_original_max_seq_len == 128


def test_qwen2_sliding_layers_from_layer_types_or_max_window_layers():
    config = tiny_family_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1).to_dict()
    args = model_args_from_hf_config(config)
    assert (args.sliding_window, args.full_attention_layers, args.qkv_bias) == (4, (0,), True)
    assert model_args_from_hf_config({k: v for k, v in config.items() if k != "layer_types"}) == args  # v4 configs
    assert model_args_from_hf_config({**config, "use_sliding_window": False}).sliding_window is None


def test_model_args_survive_a_json_round_trip():
    args = model_args_from_hf_config(tiny_family_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1).to_dict())
    assert args.full_attention_layers == (0,)
    assert ModelArgs(**json.loads(json.dumps(dataclasses.asdict(args)))) == args


# -- bad input ----------------------------------------------------------------------------------------------

def test_unknown_model_type_lists_the_known_ones(tmp_path):
    config = {**tiny_family_config("llama").to_dict(), "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    known = r"known: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, gemma3, phi3, mixtral, qwen3_moe"
    with pytest.raises(CheckpointError, match=rf"config\.json: unknown model_type 'gpt2'; {known}"):
        HFCheckpointer(tmp_path, output_dir=tmp_path / "out")
    with pytest.raises(CheckpointError, match=rf"unknown model_type 'gpt2'; {known}"):
        detect_model_type(config)
    with pytest.raises(ValueError, match=rf"unknown model_type 'gpt2'; {known}"):
        from_hf_config(config)
    with pytest.raises(CheckpointError, match="known: LLAMA2, LLAMA3, LLAMA3_2, LLAMA3_3, MISTRAL, QWEN2, QWEN2_5, QWEN3, GEMMA, "
                                              "GEMMA2, GEMMA3, PHI3, PHI3_MINI, PHI4, MIXTRAL, QWEN3_MOE"):
        get_converter("GPT2", config)


@pytest.mark.parametrize("fam,rope,named", [
    ("llama", {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "rope_theta": 10000.0}, "'longrope'"),
    ("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "'dynamic'"),
    ("phi3", {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "rope_theta": 10000.0}, "'longrope'"),
    ("phi3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 10000.0}, "'llama3'"),
])
def test_unsupported_rope_types_are_one_line_errors_naming_them(fam, rope, named, tmp_path):
    config = {**tiny_family_config(fam).to_dict(), "rope_parameters": rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"^config\.json: rope type {named} is not supported for model_type '{fam}'") as e:
        HFCheckpointer(tmp_path, output_dir=tmp_path / "out")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=named):
        from_hf_config(config)


def test_what_the_native_model_cannot_reproduce_is_refused():
    base = tiny_family_config("llama").to_dict()
    for field, value, message in (("attention_bias", True, "attention_bias=true"), ("hidden_act", "relu", "hidden_act='relu'"),
                                  ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5")):
        with pytest.raises(ValueError, match=message):
            model_args_from_hf_config({**base, field: value})


# -- the fused-tensor ops -------------------------------------------------------------------------------------

def test_split_chain_per_tensor_are_reversible_and_check_shapes():
    fused = torch.randn(16 + 8 + 8, 5)
    op = Chain(Split((16, 8, 8)), PerTensor(RopePermute(4, 4), RopePermute(2, 4), Identity()))
    q, k, v = op.forward([fused])
    assert torch.equal(q, RopePermute(4, 4).forward([fused[:16]])[0]) and torch.equal(v, fused[24:])
    assert torch.equal(op.inverse([q, k, v])[0], fused)
    with pytest.raises(ValueError, match=r"has 31 rows, expected 16 \+ 8 \+ 8 = 32"):
        op.forward([fused[:31]])
    with pytest.raises(ValueError, match=r"a block has 4 rows, expected 8 \(blocks \(16, 8, 8\)\)"):
        Split((16, 8, 8)).inverse([q, k[:4], v])


def test_phi3_fused_tensor_of_the_wrong_size_names_the_key():
    conv = get_converter("PHI3", tiny_family_config("phi3").to_dict())
    key = "model.layers.1.self_attn.qkv_proj.weight"
    with pytest.raises(CheckpointError, match=rf"{key} \(100, 64\) in shard-2: has 100 rows, expected 64 \+ 32 \+ 32 = 128"):
        conv.to_native({key: torch.zeros(100, 64)}, where={key: "shard-2"})


# -- what each family's native model cannot reproduce ---------------------------------------------------------------

@pytest.mark.parametrize("fam,field,value,message", [
    ("llama32", "mlp_bias", True, "mlp_bias=true is not supported for model_type 'llama'"),
    ("mistral_nemo", "rope_parameters", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}, "rope type 'dynamic'"),
    ("qwen2", "rope_parameters", {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "rope_theta": 1e6},
     "rope type 'longrope'"),
    ("qwen3", "attention_bias", True, "attention_bias=true is not supported for model_type 'qwen3'"),
    ("gemma", "use_bidirectional_attention", True, "use_bidirectional_attention=true"),
    ("gemma2", "attention_bias", True, "attention_bias=true is not supported for model_type 'gemma2'"),
    ("gemma3", "use_bidirectional_attention", True, "use_bidirectional_attention=true is not supported for model_type 'gemma3_text'"),
    ("phi4", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
    ("mixtral", "router_jitter_noise", 0.01, "router_jitter_noise=0.01 is not supported for model_type 'mixtral'"),
    ("qwen3_moe", "attention_bias", True, "attention_bias=true is not supported for model_type 'qwen3_moe'"),
    ("gemma4", "use_bidirectional_attention", "all", "use_bidirectional_attention='all' is not supported"),
    ("gemma4", "attention_bias", True, "attention_bias=true is not supported for model_type 'gemma4_text'"),
    ("gemma4", "per_layer_config", {"0": {"head_dim": 8}}, "per_layer_config other than one head_dim"),
    ("gemma4", "rope_parameters", {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "rope type 'dynamic'"),
    # the native model's own checks, in the config's names (families.config_names), a field several families name
    # differently by the name this config holds
    ("gemma4", "num_kv_shared_layers", 7, "num_kv_shared_layers=7 must be 0, or less than num_hidden_layers=6"),
    ("llama", "num_key_value_heads", 3, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("qwen3_next", "linear_num_value_heads", 3, "linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
    ("mixtral", "num_experts_per_tok", 5, "num_experts_per_tok=5 must be between 1 and num_local_experts=4"),
    ("qwen2_moe", "num_experts_per_tok", 5, "num_experts_per_tok=5 must be between 1 and num_experts=4"),
    ("deepseek_v3", "num_experts_per_tok", 9, "num_experts_per_tok=9 must be between 1 and n_routed_experts=8"),
])
def test_a_config_field_the_native_model_cannot_reproduce_is_one_line(fam, field, value, message, tmp_path):
    config = {**tiny_family_config(fam).to_dict(), field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"^config\.json: {message}") as e:
        HFCheckpointer(tmp_path, output_dir=tmp_path / "out")
    assert "\n" not in str(e.value)
