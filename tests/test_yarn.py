"""YaRN RoPE (``rope_type: yarn``) against transformers: the inverse frequencies and the attention factor of
``_compute_yarn_parameters`` for published parameter sets, tiny random checkpoints written by transformers'
``save_pretrained`` and loaded through the checkpointers (fp32 logits over a sequence longer than the original
context), and ModelArgs -> config.json -> ModelArgs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from waypoint.checkpointers import HFCheckpointer, load_into, load_model
from waypoint.families import from_hf_config, hf_config_for, model_args_from_hf_config
from waypoint.models import ModelArgs
from waypoint.models.transformer import rope_attention_factor, rope_cache, rope_frequencies
from tests.conftest import tiny_family_config, write_family_checkpoint

SEQ = 96  # longer than the tiny checkpoints' original context (64)


def _theirs(config):
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    return _compute_yarn_parameters(config)


def _config(class_name: str, head_dim: int, max_positions: int, **rope):
    import transformers

    return getattr(transformers, class_name)(vocab_size=100, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                             max_position_embeddings=max_positions, **rope)


# name -> (transformers config, the config.json dict we read: None for the config's own to_dict())
PARAMETER_SETS = {
    # gpt-oss's published parameters: not truncated
    "gpt-oss": lambda: (_config("Qwen3Config", 64, 131072, rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}), None),
    # Qwen2.5's long-context recipe, as v4's rope_scaling with a top-level rope_theta
    "qwen2.5-v4": lambda: (_config("Qwen2Config", 128, 131072, rope_theta=1000000.0, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        {"model_type": "qwen2", "vocab_size": 100, "hidden_size": 512, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072,
         "rope_theta": 1000000.0, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}),
    # DeepSeek-style mscale / mscale_all_dim, ramp ends not whole dimensions
    "mscale": lambda: (_config("LlamaConfig", 64, 163840, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}), None),
    "attention-factor": lambda: (_config("MistralConfig", 32, 8192, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "original_max_position_embeddings": 1024,
        "attention_factor": 1.25, "beta_fast": 16.0, "beta_slow": 2.0}), None),
    # a null factor: max_position_embeddings / original_max_position_embeddings
    "null-factor": lambda: (_config("Qwen2Config", 16, 256, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "original_max_position_embeddings": 64}), None),
}


@pytest.mark.parametrize("name", list(PARAMETER_SETS))
def test_frequencies_and_attention_factor_are_transformers(name):
    config, raw = PARAMETER_SETS[name]()
    args = model_args_from_hf_config(raw if raw is not None else config.to_dict())
    expected, factor = _theirs(config)
    assert args.rope_type == "yarn" and factor != 1.0
    assert torch.equal(rope_frequencies(args), expected), name  # bitwise
    assert rope_attention_factor(args) == factor
    # the ramp matters: neither all extrapolated nor all interpolated
    plain = rope_frequencies(dataclasses.replace(args, rope_type="default"))
    assert (expected == plain).any() and (expected < plain).any()
    # the table's cos and sin are scaled, in fp32, as transformers' rotary embedding scales them
    table = rope_cache(args.resolved_head_dim, 8, args.rope_theta, inv_freq=expected, scale=factor)
    angles = torch.outer(torch.arange(8, dtype=torch.float32), expected)
    assert torch.equal(table, torch.stack([angles.cos() * factor, angles.sin() * factor], dim=-1))


def test_a_top_level_original_context_wins_as_in_transformers():
    from transformers import Qwen2Config

    raw = {**_config("Qwen2Config", 16, 256, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}).to_dict(),
        "original_max_position_embeddings": 32}
    args = model_args_from_hf_config(raw)
    expected, factor = _theirs(Qwen2Config.from_dict(raw))
    assert args.rope_original_max_seq_len == 32 and torch.equal(rope_frequencies(args), expected)
    # absent everywhere: max_position_embeddings, as transformers' standardisation fills it in
    del raw["original_max_position_embeddings"], raw["rope_parameters"]["original_max_position_embeddings"]
    assert model_args_from_hf_config(raw).rope_original_max_seq_len == 256


def test_yarn_without_factor_is_a_value_error_naming_it():
    raw = {**tiny_family_config("qwen2").to_dict(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match="yarn rope parameters lack factor"):
        model_args_from_hf_config(raw)


def test_phi3_refuses_yarn_as_transformers_turns_it_into_longrope():
    raw = {**tiny_family_config("phi3").to_dict(), "rope_parameters": {**YARN}}
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported for model_type 'phi3'"):
        model_args_from_hf_config(raw)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
CHECKPOINTS = {
    "qwen2": ("qwen2", dict(rope_parameters=dict(YARN))),
    "qwen3-untruncated": ("qwen3", dict(rope_parameters={**YARN, "beta_fast": 8.0, "truncate": False})),
    "mistral-attention-factor": ("mistral", dict(rope_parameters={**YARN, "attention_factor": 1.3})),
    # transformers' yarn reads Mixtral's head_dim attribute, which must then be set (its default null fails there)
    "mixtral": ("mixtral", dict(head_dim=16, rope_parameters=dict(YARN))),
    # the full-attention layers' table scaled, the sliding layers' unscaled (transformers truncates here regardless)
    "gemma3": ("gemma3", dict(rope_parameters={"full_attention": {**YARN, "truncate": False},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_checkpoint_logits_match_transformers_past_the_original_context(name, tmp_path):
    fam, overrides = CHECKPOINTS[name]
    config = tiny_family_config(fam, vocab_size=100, max_position_embeddings=256, **overrides)  # 256 / 64: the factor
    hf_model = write_family_checkpoint(tmp_path / "in", config)
    ckpt = HFCheckpointer(tmp_path / "in", output_dir=tmp_path / "unused")
    with torch.device("meta"):
        model = from_hf_config(ckpt.config)
    assert model.args.rope_type == "yarn" and model.args.rope_original_max_seq_len == 64 < SEQ
    load_into(model, ckpt.load_checkpoint()["model"])
    model.eval()
    tokens = torch.randint(0, 100, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        diff = (model(tokens) - expected).abs().max().item()
        again = (load_model(tmp_path / "in").eval()(tokens) - expected).abs().max().item()
        unscaled = model
        unscaled.rope = rope_cache(model.args.resolved_head_dim, model.args.max_seq_len, model.args.rope_theta,
                                   inv_freq=rope_frequencies(model.args))  # without the attention factor
        moved = (unscaled(tokens) - expected).abs().max().item()
    print(f"\n{name}: max |native - transformers| logit = {diff:.3g} (load_model: {again:.3g}; unscaled table: {moved:.3g})")
    assert diff <= 1e-5 and again <= 1e-5 and moved > 1e-3


@pytest.mark.parametrize("fields", [
    dict(rope_factor=32.0, rope_original_max_seq_len=4096, rope_truncate=False),
    dict(rope_factor=40.0, rope_original_max_seq_len=4096, rope_beta_fast=16.0, rope_beta_slow=2.0, rope_mscale=1.0,
         rope_mscale_all_dim=0.8),
    dict(rope_factor=8.0, rope_original_max_seq_len=1024, rope_attention_factor=1.25),
])
def test_model_args_to_config_json_and_back(fields):
    from transformers import Qwen2Config

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, hidden_dim=96, head_dim=16, qkv_bias=True,
                     max_seq_len=int(fields["rope_factor"] * fields["rope_original_max_seq_len"]), rope_theta=150000.0,
                     rope_type="yarn", **fields)
    written = json.loads(json.dumps(hf_config_for(args, "QWEN2")))
    rope = written["rope_parameters"]
    assert set(rope) == {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                         "truncate"} | {key for key in ("attention_factor", "mscale", "mscale_all_dim") if f"rope_{key}" in fields}
    assert model_args_from_hf_config(written) == args
    # and transformers reads the same frequencies and factor from it
    expected, factor = _theirs(Qwen2Config(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")}))
    assert torch.equal(rope_frequencies(args), expected) and rope_attention_factor(args) == factor
