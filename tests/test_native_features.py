"""The native model's Qwen3 / Gemma 2 / Gemma 3 features against transformers' own models.

Tiny random fp32 models (every parameter randomised, norm weights included) are built by transformers, their
weights converted into the native model by the family's converter (``waypoint.families``), and the
logits compared on a [2, 13] batch with a sliding window of 4. Each feature is then switched off to show the
comparison depends on it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from waypoint.converters.ops import RopePermute
from waypoint.families import family_of, model_args_from_hf_config
from waypoint.models.transformer import (ModelArgs, Transformer, rope_cache, rope_frequencies, sliding_window_mask,
                                         softcapped_attention)

SEQ, WINDOW, HEAD_DIM = 13, 4, 24  # the window is shorter than the batch; head_dim != hidden 64 / 4 heads
TOL = 1e-5  # fp32 agreement with transformers
CHANGED = 1e-3  # what a switched-off feature must at least move the logits by


def _shape(**kw):
    return dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=HEAD_DIM, max_position_embeddings=64, rms_norm_eps=1e-6, **kw)


def hf_config(family: str):
    from transformers import Gemma2Config, Gemma3TextConfig, Qwen3Config

    if family == "qwen3":  # layer 0 full, layers 1 and 2 sliding
        return Qwen3Config(**_shape(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    if family == "gemma2":  # transformers' default layer_types: sliding, full, sliding, full
        return Gemma2Config(**_shape(num_hidden_layers=4, query_pre_attn_scalar=12, sliding_window=WINDOW,
                                     attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    return Gemma3TextConfig(**_shape(
        num_hidden_layers=4, query_pre_attn_scalar=12, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}))


def native_args(config) -> ModelArgs:
    """The ModelArgs the family's config reader makes of ``config``."""
    return model_args_from_hf_config(config.to_dict())


def native_state(hf_model, args: ModelArgs, permute_norms: bool = True) -> dict[str, torch.Tensor]:
    """transformers' state dict through the family's converter; ``permute_norms=False`` undoes the RoPE permutation
    of the per-head q/k norm weights, to show that it is needed."""
    converter = family_of(hf_model.config.to_dict()).converter(args)
    state = dict(converter.to_native(hf_model.state_dict()))
    if not permute_norms:
        undo = RopePermute(1, args.resolved_head_dim)
        state = {k: undo.inverse([t])[0] if k.endswith(("q_norm.weight", "k_norm.weight")) else t for k, t in state.items()}
    return state


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.add_(noise) if name.endswith("norm.weight") else p.copy_(noise)


def native_model(args: ModelArgs, state: dict[str, torch.Tensor], strict: bool = True) -> Transformer:
    model = Transformer(args).eval()
    model.load_state_dict(state, strict=strict)
    return model


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def built():
    """family -> (transformers model, its ModelArgs, native state): built once for the module."""
    from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM, Qwen3ForCausalLM

    classes = {"qwen3": Qwen3ForCausalLM, "gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}
    out = {}
    for seed, (family, cls) in enumerate(classes.items()):
        hf = cls(hf_config(family)).eval()
        randomise(hf, seed)
        args = native_args(hf.config)
        out[family] = hf, args, native_state(hf, args)
    return out


def max_diff(model: torch.nn.Module, hf_model, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(tokens) - hf_model(tokens).logits).abs().max().item()


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3"])
def test_logits_match_transformers(built, tokens, family):
    hf, args, state = built[family]
    layer_types = hf.config.layer_types
    assert {"sliding_attention", "full_attention"} <= set(layer_types) and WINDOW < SEQ  # both kinds of layer
    diff = max_diff(native_model(args, state), hf, tokens)
    print(f"\n{family}: max |native - transformers| logit = {diff:.3g}")
    assert diff <= TOL


# each feature switched off (or its weights mis-converted): the logits no longer match
OFF = {
    "qwen3-no-qk-norm": ("qwen3", dict(qk_norm=False)),
    "qwen3-unpermuted-qk-norm": ("qwen3", "unpermuted"),
    "qwen3-no-sliding-window": ("qwen3", dict(sliding_window=None, full_attention_layers=())),
    "qwen3-all-layers-sliding": ("qwen3", dict(full_attention_layers=())),
    "gemma2-no-attn-softcap": ("gemma2", dict(attn_softcap=None)),
    "gemma2-no-final-softcap": ("gemma2", dict(final_softcap=None)),
    "gemma2-default-attn-scale": ("gemma2", dict(attn_scale=None)),
    "gemma2-no-sandwich-norms": ("gemma2", dict(sandwich_norms=False)),
    "gemma2-no-sliding-window": ("gemma2", dict(sliding_window=None, full_attention_layers=())),
    "gemma2-all-layers-sliding": ("gemma2", dict(full_attention_layers=())),
    "gemma3-no-qk-norm": ("gemma3", dict(qk_norm=False)),
    "gemma3-unpermuted-qk-norm": ("gemma3", "unpermuted"),
    "gemma3-unscaled-global-rope": ("gemma3", dict(rope_type="default")),
    "gemma3-no-local-rope": ("gemma3", dict(local_rope_theta=None)),
    "gemma3-local-rope-scaled-too": ("gemma3", "local-scaled"),
    "gemma3-no-sandwich-norms": ("gemma3", dict(sandwich_norms=False)),
    "gemma3-default-attn-scale": ("gemma3", dict(attn_scale=None)),
    "gemma3-all-layers-full": ("gemma3", dict(full_attention_layers=(0, 1, 2, 3))),
}


@pytest.mark.parametrize("case", list(OFF))
def test_each_feature_changes_the_logits(built, tokens, case):
    family, change = OFF[case]
    hf, args, state = built[family]
    if change == "unpermuted":
        model = native_model(args, native_state(hf, args, permute_norms=False))
    elif change == "local-scaled":  # the sliding layers' table must not take the global rope's linear scaling
        model = native_model(args, state)
        scaled = rope_frequencies(dataclasses.replace(args, rope_theta=args.local_rope_theta))
        model.local_rope = rope_cache(args.resolved_head_dim, args.max_seq_len, args.local_rope_theta, inv_freq=scaled)
    else:
        args = dataclasses.replace(args, **change)
        model = native_model(args, state, strict=False)  # the weights of a switched-off feature go unused
    diff = max_diff(model, hf, tokens)
    print(f"\n{case}: max |native - transformers| logit = {diff:.3g}")
    assert diff > CHANGED, f"{case}: logits moved by only {diff:.3g}"


@pytest.mark.parametrize("family,layer", [("qwen3", 0), ("gemma3", 2)])
def test_qk_norm_weights_need_the_rope_permutation(built, family, layer):
    """One attention layer against transformers': projection rows and per-head norm weights permuted agree; the
    same with the norm weights left in rotate-half order do not."""
    hf, args, state = built[family]
    x = torch.randn(2, SEQ, args.dim, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ)[None]
    rotary = hf.model.rotary_emb
    cos_sin = rotary(x, positions, "full_attention") if family == "gemma3" else rotary(x, positions)
    causal = torch.full((SEQ, SEQ), torch.finfo(torch.float32).min).triu(1)[None, None]  # additive: eager or sdpa
    with torch.no_grad():
        expected, _ = hf.model.layers[layer].self_attn(x, position_embeddings=cos_sin, attention_mask=causal)
        diffs = {}
        for permute in (True, False):
            model = native_model(args, native_state(hf, args, permute_norms=permute))
            diffs[permute] = (model.layers[layer].attn(x, model.rope) - expected).abs().max().item()
    assert diffs[True] <= TOL and diffs[False] > CHANGED, diffs


def test_transformers_gemma3_ignores_attn_logit_softcapping(built, tokens):
    """Gemma 3's attention never passes its softcap on, so a Gemma 3 config's attn_logit_softcapping means
    attn_softcap=None (unlike Gemma 2's)."""
    from transformers import Gemma3ForCausalLM

    hf, args, state = built["gemma3"]
    config = hf_config("gemma3")
    config.attn_logit_softcapping = 5.0
    capped = Gemma3ForCausalLM(config).eval()
    capped.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert torch.equal(capped(tokens).logits, hf(tokens).logits)
    assert max_diff(native_model(dataclasses.replace(args, attn_softcap=5.0), state), hf, tokens) > CHANGED


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_sliding_window_mask_is_transformers(family):
    """The mask transformers builds for Gemma 2/3's sliding layers: query i sees keys i - window < j <= i."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    config = hf_config(family)
    config._attn_implementation = "sdpa"
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=torch.zeros(1, SEQ, 64), attention_mask=None,
                                             past_key_values=None, position_ids=torch.arange(SEQ)[None])
    assert mask.dtype == torch.bool and torch.equal(mask[0, 0], sliding_window_mask(SEQ, WINDOW))


def test_softcapped_attention_is_sdpa_when_the_cap_is_far_and_differs_when_near():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, SEQ, 8, generator=g) * 2, torch.randn(2, 2, SEQ, 8, generator=g) * 2, torch.randn(2, 2, SEQ, 8, generator=g)
    for mask in (None, sliding_window_mask(SEQ, WINDOW)):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=0.3, enable_gqa=True)
        assert (softcapped_attention(q, k, v, mask, 0.3, softcap=1e6) - expected).abs().max() <= 1e-6
        assert (softcapped_attention(q, k, v, mask, 0.3, softcap=1.0) - expected).abs().max() > 0.01


def test_softcapped_attention_is_transformers_eager_bitwise_in_bf16():
    """transformers' order (scores in the query's dtype, capped, masked, softmax in fp32 cast back) bit for bit;
    in bf16 scores computed in fp32 would not agree."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, SEQ, 16, generator=g).to(torch.bfloat16) * 3 for h in (4, 2, 2))
    module = SimpleNamespace(num_key_value_groups=2, training=False, head_dim=16)
    for mask in (None, sliding_window_mask(SEQ, WINDOW)):
        allowed = mask if mask is not None else torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        additive = torch.zeros(SEQ, SEQ, dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min)
        expected, _ = eager_attention_forward(module, q, k, v, additive[None, None], scaling=0.25, softcap=5.0)
        assert torch.equal(softcapped_attention(q, k, v, mask, 0.25, 5.0), expected.transpose(1, 2))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_activation_checkpointing_gives_the_same_logits_and_grads(built, tokens, family):
    _, args, state = built[family]
    results = []
    for checkpointing in (False, True):
        model = native_model(args, state).train()
        model.activation_checkpointing = checkpointing
        logits = model(tokens)
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, grads), (checkpointed, grads_ckpt) = results
    assert torch.equal(plain, checkpointed)
    assert grads.keys() == grads_ckpt.keys() and any("post_attn_norm" in n for n in grads)
    for name in grads:
        assert torch.allclose(grads[name], grads_ckpt[name], atol=1e-7), name


@pytest.mark.parametrize("plus_one", [False, True])
def test_init_weights_sets_every_norm_to_identity(plus_one):
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=16, hidden_dim=48, norm_plus_one=plus_one,
                     qk_norm=True, sandwich_norms=True)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    model.init_weights()
    norms = {n: p for n, p in model.named_parameters() if n.endswith("norm.weight")}
    assert {n.split(".", 2)[-1] for n in norms if n.startswith("layers.0.")} == {
        "sa_norm.weight", "mlp_norm.weight", "post_attn_norm.weight", "post_mlp_norm.weight",
        "attn.q_norm.weight", "attn.k_norm.weight"}
    assert norms["layers.1.attn.k_norm.weight"].shape == (8,)
    for name, p in norms.items():
        assert torch.equal(p, torch.full_like(p, 0.0 if plus_one else 1.0)), name


def test_defaults_add_no_parameters_or_buffers():
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=16, hidden_dim=48)
    model = Transformer(args)
    assert sorted(model.state_dict()) == sorted([
        "tok_embeddings.weight", "norm.weight", "output.weight", "layers.0.sa_norm.weight", "layers.0.mlp_norm.weight",
        *(f"layers.0.attn.{p}_proj.weight" for p in ("q", "k", "v", "output")), *(f"layers.0.mlp.w{i}.weight" for i in (1, 2, 3))])
    assert [n for n, _ in model.named_buffers()] == ["rope"]
    gemma3 = Transformer(dataclasses.replace(args, sliding_window=4, local_rope_theta=10.0))
    assert [n for n, _ in gemma3.named_buffers()] == ["rope", "local_rope"]
    assert sorted(gemma3.state_dict()) == sorted(model.state_dict())  # the extra table is not saved


def test_meta_build_then_reset_rope_fills_both_tables(built):
    _, args, state = built["gemma3"]
    with torch.device("meta"):
        model = Transformer(args)
    assert model.rope.is_meta and model.local_rope.is_meta
    model.to_empty(device="cpu")
    model.reset_rope()
    reference = native_model(args, state)
    assert torch.equal(model.rope, reference.rope) and torch.equal(model.local_rope, reference.local_rope)
    assert model.local_rope.shape == (args.max_seq_len, HEAD_DIM // 2, 2) and not torch.equal(model.rope, model.local_rope)


def test_new_fields_survive_a_json_round_trip(built):
    for _, args, _ in built.values():
        assert ModelArgs(**json.loads(json.dumps(dataclasses.asdict(args)))) == args


@pytest.mark.parametrize("bad,message", [
    (dict(attn_softcap=0.0), r"attn_softcap=0.0 must be positive"),
    (dict(final_softcap=-30.0), r"final_softcap=-30.0 must be positive"),
    (dict(attn_scale=float("nan")), r"attn_scale=nan must be positive"),
    (dict(local_rope_theta=10000.0), r"local_rope_theta .* sliding_window is None"),
    (dict(sliding_window=4, local_rope_theta=0.0), r"local_rope_theta=0.0 must be positive"),
    (dict(rope_type="linear", rope_factor=0.0), r"rope_factor=0.0 must be positive"),
    (dict(rope_type="dynamic"), r"rope_type='dynamic' is not supported; supported: default, llama3, linear, yarn"),
    (dict(rope_type="yarn", rope_beta_slow=0.0), r"rope_beta_slow=0.0 must be positive for yarn rope"),
    (dict(rope_type="yarn", rope_attention_factor=-1.0), r"rope_attention_factor=-1.0 must be positive"),
])
def test_meaningless_values_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=16, hidden_dim=48, **bad)
