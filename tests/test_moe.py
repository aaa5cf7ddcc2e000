"""The native mixture-of-experts block (waypoint.models.moe) against transformers' Mixtral and Qwen3-MoE blocks,
its implementations against each other, and the load-balancing loss against transformers'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import waypoint.models.moe as moe
import waypoint.models.grouped_mm as grouped
from waypoint.models.balance_loss import load_balancing_loss
from waypoint.models.moe import MoE, grouped_mm_supported

D, I = 32, 48  # hidden size, expert intermediate size
IMPLS = ("grouped", "padded", "loop", "auto")


def hf_block(family: str, n_experts: int, top_k: int, norm_topk_prob: bool = True, experts_implementation: str = "eager",
             seed: int = 0):
    """transformers' sparse MoE block of ``family`` with Normal(0, 0.1) weights."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=D, intermediate_size=I, num_local_experts=n_experts,
                                                    num_experts_per_tok=top_k, experts_implementation=experts_implementation))
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=n_experts,
                                                      num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                                                      experts_implementation=experts_implementation))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return block.eval()


def native_from_hf(hf, normalize_topk: bool, fp32_routing_weights: bool = False) -> MoE:
    """Our block with ``hf``'s weights: the router's, and the packed gate_up_proj [E, 2I, H] split into w1 / w3."""
    n_experts, two_i, dim = hf.experts.gate_up_proj.shape
    block = MoE(dim, two_i // 2, n_experts, hf.gate.top_k, normalize_topk=normalize_topk,
                fp32_routing_weights=fp32_routing_weights).to(hf.gate.weight.dtype)
    with torch.no_grad():
        block.router.weight.copy_(hf.gate.weight)
        block.w1.copy_(hf.experts.gate_up_proj[:, : two_i // 2])
        block.w3.copy_(hf.experts.gate_up_proj[:, two_i // 2:])
        block.w2.copy_(hf.experts.down_proj)
    return block


def skip_if_no_grouped(impl: str, dtype=torch.float32) -> None:
    if impl == "grouped" and not grouped_mm_supported("cpu", dtype):
        pytest.skip(f"this torch has no grouped_mm for CPU {dtype}")


FAMILIES = [("mixtral", True, 2), ("qwen3_moe", True, 3), ("qwen3_moe", False, 3)]  # family, normalize_topk, top_k


@pytest.mark.parametrize("family,normalize,top_k", FAMILIES)
def test_matches_transformers_fp32(family, normalize, top_k):
    hf = hf_block(family, 8, top_k, norm_topk_prob=normalize)
    hf_grouped = hf_block(family, 8, top_k, norm_topk_prob=normalize, experts_implementation="grouped_mm")
    ours = native_from_hf(hf, normalize)
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ref_grouped = hf(x), hf_grouped(x)  # transformers' eager and grouped_mm experts, the same (seeded) weights
        hf_logits, hf_weights, hf_experts = hf.gate(x.reshape(-1, D))
        logits, weights, experts = ours.route(x.reshape(-1, D))
        assert torch.equal(logits, hf_logits) and torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights)
        for impl in IMPLS:
            skip_if_no_grouped(impl)
            ours.impl = impl
            out, router_logits = ours(x)
            assert out.shape == x.shape and router_logits.shape == (21, 8)
            assert torch.equal(router_logits, hf_logits)
            assert (out - ref).abs().max() <= 1e-6, (impl, (out - ref).abs().max())
            assert (out - ref_grouped).abs().max() <= 1e-6, (impl, (out - ref_grouped).abs().max())
    assert ref.abs().max() > 0.1  # a comparison of something


@pytest.mark.parametrize("family,normalize,top_k", FAMILIES + [("qwen3_moe", True, 2)])
def test_matches_transformers_bf16(family, normalize, top_k):
    """Close in bf16. With the family's handling of the routing weights (Mixtral applies them in fp32, Qwen3-MoE in
    the input's dtype) fewer elements differ from transformers' than with the other handling, none to speak of at
    top-2; above top-2 the k weighted outputs are summed in fp32 (transformers adds them in bf16), which is no
    further from the fp32 result than transformers is."""
    hf = hf_block(family, 8, top_k, norm_topk_prob=normalize)
    x = torch.randn(4, 16, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        hf.to(torch.bfloat16)
        exact = hf.float()(x.float())  # fp32 from the same bf16-rounded weights and input
        hf.to(torch.bfloat16)
        ref = hf(x).float()
        mismatches, errors = {}, {}
        for fp32_weights in (False, True):
            ours = native_from_hf(hf, normalize, fp32_routing_weights=fp32_weights)
            for impl in IMPLS:
                skip_if_no_grouped(impl, torch.bfloat16)
                ours.impl = impl
                out, router_logits = ours(x)
                assert out.dtype == router_logits.dtype == torch.bfloat16
                torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=1e-2)
                mismatches[fp32_weights, impl] = int((out.float() != ref).sum())
                errors[fp32_weights, impl] = float((out.float() - exact).abs().mean())
    flag = family == "mixtral"
    for impl in IMPLS:
        assert mismatches[not flag, impl] > mismatches[flag, impl], mismatches
        if top_k == 2:
            assert mismatches[flag, impl] <= 0.01 * ref.numel(), mismatches
        assert errors[flag, impl] <= 1.1 * float((ref - exact).abs().mean()), errors


def dense_reference(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token in float64, then the top-k of the softmax picked and (optionally) renormalised:
    an implementation independent of both ours and transformers'."""
    x, w1, w2, w3, router = (t.detach().double() for t in (x, block.w1, block.w2, block.w3, block.router.weight))
    h = F.silu(torch.einsum("eid,td->eti", w1, x)) * torch.einsum("eid,td->eti", w3, x)  # [E, tokens, hidden]
    ys = torch.einsum("edi,eti->ted", w2, h)
    probs = torch.softmax(x @ router.T, dim=-1)
    top = probs.topk(block.top_k, dim=-1)
    weights = torch.zeros_like(probs).scatter(1, top.indices, top.values)
    if block.normalize_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return (weights[:, :, None] * ys).sum(1)


@pytest.mark.parametrize("normalize", [True, False])
def test_top_k_and_renormalisation_matter(normalize):
    torch.manual_seed(3)
    block = MoE(D, I, 8, 2, normalize_topk=normalize)
    block.init_weights(std=0.2)
    x = torch.randn(20, D)
    with torch.no_grad():
        out, logits = block(x)
        assert (out.double() - dense_reference(block, x)).abs().max() <= 1e-5
        # the other normalize_topk: each token's output scales by the sum of its top-k probabilities
        block.normalize_topk = not normalize
        other, _ = block(x)
        topk_mass = torch.softmax(logits.float(), -1).topk(2, dim=-1).values.sum(-1, keepdim=True)
        assert topk_mass.max() < 0.99  # so renormalising changes something
        torch.testing.assert_close(out if not normalize else other, (other if not normalize else out) * topk_mass,
                                   rtol=1e-5, atol=1e-6)
        assert (out - other).abs().max() > 1e-2
        # a larger k: other experts join
        block.normalize_topk, block.top_k = normalize, 4
        wider, _ = block(x)
        assert (wider - out).abs().max() > 1e-2
        assert (wider.double() - dense_reference(block, x)).abs().max() <= 1e-5


CASES = [  # n_experts, top_k, normalize_topk, tokens
    (8, 2, True, 40),
    (16, 4, False, 5),  # at most 20 of 16 x 5 assignments: experts with no tokens
    (4, 1, True, 9),
]


@pytest.mark.parametrize("n_experts,top_k,normalize,tokens", CASES)
def test_impls_agree_with_loop_outputs_and_gradients(n_experts, top_k, normalize, tokens):
    torch.manual_seed(4)
    block = MoE(D, I, n_experts, top_k, normalize_topk=normalize)
    block.init_weights(std=0.1)
    x0 = torch.randn(tokens, D)
    g = torch.randn(tokens, D)
    results = {}
    for impl in ("loop", "grouped", "padded", "auto"):
        if impl == "grouped" and not grouped_mm_supported("cpu", torch.float32):
            continue
        block.impl = impl
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out, logits = block(x)
        ((out * g).sum() + load_balancing_loss([logits], n_experts, top_k)).backward()
        results[impl] = (out.detach(), x.grad, block.router.weight.grad, block.w1.grad, block.w2.grad, block.w3.grad)
    assert len(results) >= 3
    ref = results.pop("loop")
    for name, r in zip(("out", "x", "router", "w1", "w2", "w3"), ref):
        assert r.abs().max() > 0, name  # gradients reach everything
    used = torch.zeros(n_experts, dtype=torch.bool)
    used[block.route(x0)[2].unique()] = True
    assert torch.equal(ref[3].flatten(1).abs().amax(1) > 0, used)  # and only the experts that were used
    for impl, got in results.items():
        for name, a, b in zip(("out", "x", "router", "w1", "w2", "w3"), got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{impl} {name}: {m}")


def test_float64_falls_back_to_padded_and_agrees():
    torch.manual_seed(5)
    block = MoE(D, I, 8, 2).double()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    if not grouped_mm_supported("cpu", torch.float64):  # torch 2.13: grouped_mm takes fp32 / bf16 / fp16 only
        assert block.resolved_impl(x) == "padded"
    out, _ = block(x)
    block.impl = "loop"
    ref, _ = block(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    # and float64 throughout (no fp32 accumulation on the way)
    torch.testing.assert_close(out.reshape(-1, D), dense_reference(block, x.reshape(-1, D)), rtol=1e-12, atol=1e-14)


def test_grouped_mm_probe(monkeypatch):
    from packaging.version import Version

    if Version(torch.__version__.split("+")[0]) >= Version("2.10"):  # grouped_mm has CPU kernels (2.13: fp32/bf16/fp16)
        assert grouped_mm_supported("cpu", torch.float32) and grouped_mm_supported("cpu", torch.bfloat16)
    assert not grouped_mm_supported("meta", torch.float32)
    # a grouped_mm that computes the wrong thing is not used
    monkeypatch.setattr(grouped, "grouped_mm_fn", lambda: lambda a, b, offs: a @ b[0])
    assert not grouped._probe_grouped_mm(torch.device("cpu"), torch.float32)
    # the cached answer decides "auto"
    monkeypatch.setitem(grouped._GROUPED_MM_SUPPORT, ("cpu", None, torch.float32), False)
    block = MoE(D, I, 4, 2)
    assert block.resolved_impl(torch.zeros(1, D)) == "padded"
    monkeypatch.setitem(grouped._GROUPED_MM_SUPPORT, ("cpu", None, torch.float32), True)
    assert block.resolved_impl(torch.zeros(1, D)) == "grouped"
    block.impl = "grouped_mm"
    with pytest.raises(ValueError, match="impl"):
        block(torch.zeros(1, D))


def test_layout_and_meta_build():
    with torch.device("meta"):
        block = MoE(D, I, 8, 2)
    assert all(p.is_meta for p in block.parameters())
    shapes = {k: tuple(v.shape) for k, v in block.state_dict().items()}
    assert shapes == {"router.weight": (8, D), "w1": (8, I, D), "w3": (8, I, D), "w2": (8, D, I)}
    # each expert is the dense FeedForward with w1[e] / w2[e] / w3[e] as its nn.Linear weights
    from waypoint.models.transformer import FeedForward

    torch.manual_seed(6)
    block = MoE(D, I, 4, 4, normalize_topk=True)  # every expert on every token
    x = torch.randn(6, D)
    dense = []
    for e in range(4):
        ff = FeedForward(D, I)
        with torch.no_grad():
            ff.w1.weight.copy_(block.w1[e]), ff.w2.weight.copy_(block.w2[e]), ff.w3.weight.copy_(block.w3[e])
        dense.append(ff(x))
    with torch.no_grad():
        out, logits = block(x)
        torch.testing.assert_close(out, torch.einsum("te,etd->td", torch.softmax(logits, -1), torch.stack(dense)),
                                   rtol=1e-5, atol=1e-6)
    assert abs(float(block.w1.detach().std()) - 0.02) < 0.002  # the default initialisation
    with pytest.raises(ValueError, match="top_k"):
        MoE(D, I, 4, 5)


def test_load_balancing_loss_equals_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    gen = torch.Generator().manual_seed(7)
    logits = tuple(torch.randn(24, 8, generator=gen) * 2 for _ in range(3))
    ours = load_balancing_loss(logits, 8, 2)
    assert torch.equal(ours, load_balancing_loss_func(logits, 8, 2))
    assert torch.equal(load_balancing_loss(list(logits), 8, 2), ours)
    bf16 = tuple(t.to(torch.bfloat16) for t in logits)
    assert torch.equal(load_balancing_loss(bf16, 8, 2), load_balancing_loss_func(bf16, 8, 2))
    assert torch.equal(load_balancing_loss(logits[0], 8, 3), load_balancing_loss_func(logits[:1], 8, 3))
    # the definition, over the layers' logits concatenated
    cat = torch.cat(logits)
    probs = torch.softmax(cat, -1)
    f = F.one_hot(probs.topk(2, -1).indices, 8).sum((0, 1)).float() / cat.shape[0]
    assert abs(float(8 * (f * probs.mean(0)).sum()) - float(ours)) <= 1e-6
    assert float(ours) > 2.0  # above the balanced optimum (top_k), so the test means something
    # differentiable with respect to the logits
    leaf = cat.clone().requires_grad_()
    load_balancing_loss(leaf.split(24), 8, 2).backward()
    assert leaf.grad.abs().max() > 0


def test_aux_loss_of_a_tiny_mixtral_from_our_blocks():
    """MixtralForCausalLM(output_router_logits=True)'s aux_loss equals our loss on the router logits our blocks
    compute from each layer's MoE input, with the layers' weights; the blocks' outputs match transformers'
    (whose default experts implementation in a model is grouped_mm) too."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=D, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                           output_router_logits=True)
    torch.manual_seed(8)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    captured = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out, i=i: captured.__setitem__(i, (args[0], out)))
             for i, layer in enumerate(model.model.layers)]
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        result = model(tokens)
    for h in hooks:
        h.remove()
    ours = []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            block = native_from_hf(layer.mlp, normalize_topk=True, fp32_routing_weights=True)
            mlp_in, mlp_out = captured[i]
            out, logits = block(mlp_in)
            assert torch.equal(logits, result.router_logits[i])
            assert (out - mlp_out).abs().max() <= 1e-6
            ours.append(logits)
    aux = load_balancing_loss(ours, 4, 2)
    assert (aux - result.aux_loss).abs() <= 1e-7, (aux, result.aux_loss)
    assert float(aux) > 0


def test_masked_balance_stats_equal_transformers_with_an_attention_mask():
    """Padding is left out of the load-balancing loss as transformers leaves it out with the attention mask; the
    sums over two halves of a batch give the whole batch's loss (how ranks combine)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from waypoint.models.balance_loss import balance_loss, load_balancing_stats

    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(2 * 5, 6, generator=g) for _ in range(3)]  # 3 layers, batch 2 x 5 tokens, 6 experts
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    theirs = load_balancing_loss_func(tuple(logits), 6, 2, attention_mask=mask)
    counts, prob_sum, rows = load_balancing_stats(logits, 6, 2, mask.bool())
    assert abs(balance_loss(counts, prob_sum, rows, 6).item() - theirs.item()) <= 1e-6
    halves = [load_balancing_stats([l.view(2, 5, 6)[i].reshape(5, 6) for l in logits], 6, 2, mask[i].bool()) for i in (0, 1)]
    whole = balance_loss(halves[0][0] + halves[1][0], halves[0][1] + halves[1][1], halves[0][2] + halves[1][2], 6)
    assert abs(whole.item() - theirs.item()) <= 1e-6
    unmasked = load_balancing_stats(logits, 6, 2)
    assert abs(balance_loss(*unmasked, 6).item() - theirs.item()) > 1e-4, "the mask must matter for this batch"


def test_the_grouped_mm_probe_inside_an_activation_checkpointed_layer_leaves_its_recomputation_alone(monkeypatch):
    """The first forward probes grouped_mm (a small autograd run of its own). Run inside a checkpointed layer, the
    probe's saved tensors would count as the layer's, and the recomputation (probe cached) would save fewer."""
    from waypoint.models.args import ModelArgs
    from waypoint.models.transformer import Transformer

    monkeypatch.setattr(grouped, "_GROUPED_MM_SUPPORT", {})  # not yet probed
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=32, max_seq_len=32,
                                  n_experts=4, experts_per_token=2))
    model.activation_checkpointing = True
    model.train()(torch.randint(0, 64, (2, 8))).square().mean().backward()  # raised torch's CheckpointError before
    assert grouped._GROUPED_MM_SUPPORT and all(p.grad is not None for p in model.parameters())


def test_same_routing_replays_the_recorded_experts():
    """An export check's reloaded model takes the experts the written one chose: with its router changed by a
    rounding (here: a lot), the replayed forward still computes with the recorded experts and its own weights."""
    torch.manual_seed(0)
    layer = MoE(16, 8, n_experts=6, top_k=2)
    x = torch.randn(10, 16)
    with moe.same_routing(layer) as routes:
        out, _ = layer(x)
    assert len(routes[""]) == 1 and routes[""][0].shape == (10, 2)
    with moe.same_routing(layer, routes):
        assert torch.equal(layer(x)[0], out)
    with torch.no_grad():
        layer.router.weight.add_(torch.randn_like(layer.router.weight))
    changed, _ = layer(x)
    with moe.same_routing(layer, routes):
        replayed, _ = layer(x)
    experts = routes[""][0]
    assert not torch.equal(changed, out) and not torch.equal(replayed, changed)
    probs = torch.softmax(layer.router(x), dim=-1)
    weights = probs.gather(-1, experts)
    weights = weights / weights.sum(-1, keepdim=True)
    expected = torch.zeros_like(x)
    for t in range(10):
        for slot in range(2):
            e = experts[t, slot]
            expected[t] += weights[t, slot] * (layer.w2[e] @ (F.silu(layer.w1[e] @ x[t]) * (layer.w3[e] @ x[t])))
    assert (replayed - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("impl", ["padded", "grouped"])
def test_a_rerun_gives_the_same_gradients_to_the_bit(impl):
    """Each token's k rows are summed back in a fixed order: indexing x[tokens] accumulated them in whatever order the
    CPU's threads reached them, and a resumed run drifted from one that never stopped (DeepSeek's top-3 showed it)."""
    torch.manual_seed(0)
    block = MoE(64, 32, n_experts=8, top_k=3, impl=impl, expert_bias=True)
    with torch.no_grad():
        for b in (block.b1, block.b2, block.b3):
            b.normal_()
    x = torch.randn(512, 64)
    grads = []
    for _ in range(3):
        xi = x.clone().requires_grad_()
        block.zero_grad()
        block(xi)[0].square().sum().backward()
        grads.append([xi.grad] + [p.grad.clone() for p in block.parameters()])
    assert all(torch.equal(a, b) for other in grads[1:] for a, b in zip(grads[0], other))
