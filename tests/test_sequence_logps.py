"""Each sequence's loss sum through the fused output projection (``linear_cross_entropy_rows``): the plain path's
values and gradients under a per-row upstream gradient, without keeping anything [tokens, vocab]-sized for backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from waypoint.models.fused_loss import IGNORE_INDEX, linear_cross_entropy_rows, next_token_loss_rows, next_token_loss_sum
from waypoint.models.lora import apply_lora
from waypoint.models.transformer import ModelArgs, Transformer
from waypoint.training.loss import model_loss_sum, sequence_loss_sums


def plain_rows(h, w, y, softcap=None, **_):
    logits = h @ w.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return next_token_loss_rows(logits, y)


def fused_rows(chunk):
    return lambda h, w, y, softcap=None: linear_cross_entropy_rows(h, w, y, chunk=chunk, softcap=softcap)


def batch(rows=4, seq=23, dim=16, vocab=101, dtype=torch.float32, seed=0):
    """hidden, weight, labels with ignored positions scattered anywhere and row 1 entirely ignored."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, seq, dim, generator=g).to(dtype)
    w = (torch.randn(vocab, dim, generator=g) * 0.5).to(dtype)
    y = torch.randint(0, vocab, (rows, seq), generator=g)
    y[torch.rand(rows, seq, generator=g) < 0.4] = IGNORE_INDEX
    y[0, 3:9] = IGNORE_INDEX  # a prompt
    y[1] = IGNORE_INDEX  # a row with no supervised position
    return h, w, y


def dpo_like(v, c):
    """Nonlinear in the row sums, with a different upstream gradient for every row."""
    half = len(v) // 2
    return (torch.nn.functional.logsigmoid(v[:half] - v[half:]) * c).sum()


def gradients(fn, h, w, y, softcap, c, need_weight=True):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_(need_weight)
    v = fn(h, w, y, softcap=softcap)
    dpo_like(v, c).backward()
    return v.detach(), h.grad, w.grad


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_the_row_sums_are_the_plain_paths(chunk, softcap):
    h, w, y = batch()
    ref = plain_rows(h, w, y, softcap)
    mine = linear_cross_entropy_rows(h, w, y, chunk=chunk, softcap=softcap)
    assert mine.shape == (4,) and mine.dtype == torch.float32
    assert mine[1] == 0 and ref[0] > 0
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # evaluation: the same sums, nothing to differentiate
        evaluated = linear_cross_entropy_rows(h.requires_grad_(), w, y, chunk=chunk, softcap=softcap)
    assert not evaluated.requires_grad
    torch.testing.assert_close(evaluated, mine.detach(), rtol=0, atol=0)
    # and their sum is the scalar path's loss sum
    torch.testing.assert_close(mine.sum(), next_token_loss_sum(h @ w.T if softcap is None else
                                                               torch.tanh(h @ w.T / softcap) * softcap, y).detach(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_the_gradients_are_the_plain_paths_under_a_per_row_upstream_gradient(chunk, softcap):
    h, w, y = batch()
    c = torch.randn(2, generator=torch.Generator().manual_seed(1))
    ref = gradients(plain_rows, h, w, y, softcap, c)
    mine = gradients(fused_rows(chunk), h, w, y, softcap, c)
    for a, b in zip(mine, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert torch.equal(mine[1][1], torch.zeros_like(h[1]))  # the row with nothing supervised
    assert torch.equal(mine[1][0, 2:8], torch.zeros(6, 16))  # the prompt's positions (labels 3:9 shifted)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_bf16_gives_bf16_gradients_close_to_fp32(softcap):
    h, w, y = batch(dtype=torch.bfloat16)
    c = torch.randn(2, generator=torch.Generator().manual_seed(1))
    reference = gradients(plain_rows, h.float(), w.float(), y, softcap, c)
    mine = gradients(fused_rows(5), h, w, y, softcap, c)
    assert mine[0].dtype == torch.float32
    torch.testing.assert_close(mine[0], reference[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(mine[1:], reference[1:]):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b).abs().max() <= 2e-2 * b.abs().max()


def test_a_frozen_weight_gets_no_gradient_and_the_hidden_one_is_unchanged():
    h, w, y = batch()
    c = torch.tensor([0.7, -1.3])
    ref = gradients(plain_rows, h, w, y, None, c)
    with Products() as seen:
        mine = gradients(fused_rows(4), h, w, y, None, c, need_weight=False)
    assert mine[2] is None
    assert (mine[1] - ref[1]).abs().max() <= 1e-5 * ref[1].abs().max()
    chunks = -(-int((y[:, 1:] != IGNORE_INDEX).sum()) // 4)
    assert seen.count == 3 * chunks  # forward's logits; backward's logits again and the hidden gradient: no weight's


class Products(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
        return func(*args, **(kwargs or {}))


def tiny(softcap=None, tied=False):
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=512, hidden_dim=64, max_seq_len=64,
                     tie_embeddings=tied, final_softcap=softcap)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def model_run(model, tokens, labels, c, chunk):
    model.zero_grad(set_to_none=True)
    v = sequence_loss_sums(model, tokens, labels, loss_chunk=chunk)
    dpo_like(v, c).backward()
    return v.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("setup", ["plain", "tied", "softcap", "lora"])
def test_the_model_per_sequence_is_its_plain_path(setup):
    model = tiny(softcap=30.0 if setup == "softcap" else None, tied=setup == "tied")
    if setup == "lora":
        apply_lora(model, ["output", "q_proj"], 4, 8.0, 0.0)
        for name, p in model.named_parameters():  # B starts at zero: give it values, for gradients through A too
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 512, (4, 40), generator=g)
    labels = tokens.clone()
    labels[:, :12] = IGNORE_INDEX
    labels[2, 20:30] = IGNORE_INDEX
    c = torch.randn(2, generator=g)
    ref_values, ref_grads = model_run(model, tokens, labels, c, 0)
    values, grads = model_run(model, tokens, labels, c, 16)
    assert values.shape == (4,)
    torch.testing.assert_close(values, ref_values, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and grads
    if setup == "lora":
        assert "output.weight" not in grads and any("output.lora" in n for n in grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # the row sums add up to the scalar path's loss sum
        torch.testing.assert_close(values.sum(), model_loss_sum(model, tokens, labels, loss_chunk=16), rtol=1e-5, atol=0)


def test_a_model_of_your_own_takes_the_loss_from_its_logits():
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 50)

        def forward(self, tokens):
            return self.embed(tokens)

    model, tokens = Logits(), torch.randint(0, 50, (3, 9))
    labels = tokens.clone()
    labels[0, :4] = IGNORE_INDEX
    torch.testing.assert_close(sequence_loss_sums(model, tokens, labels), next_token_loss_rows(model(tokens), labels))
    with pytest.raises(ValueError, match="per_sequence"):
        tiny()(tokens, per_sequence=True)


def largest_saved(fn, *args):
    """The element count of the largest tensor autograd keeps for backward while ``fn(*args)`` runs."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, max(sizes)


def test_nothing_vocab_sized_is_kept_for_backward():
    h, w, y = batch(rows=4, seq=64, dim=16, vocab=4096)
    y[:, :5] = 7  # most positions supervised
    h, w = h.requires_grad_(), w.requires_grad_()
    logits_numel = int((y[:, 1:] != IGNORE_INDEX).sum()) * w.shape[0]
    _, plain = largest_saved(plain_rows, h, w, y)
    assert plain >= logits_numel  # the full path keeps the (log-softmax of the) logits
    for softcap in (None, 30.0):
        out, fused = largest_saved(lambda *a: linear_cross_entropy_rows(*a, chunk=32, softcap=softcap), h, w, y)
        assert fused < logits_numel // 4 and fused <= w.numel()  # hidden rows and the weight: nothing [tokens, vocab]
        out.sum().backward()  # and backward still runs from what was kept


FSDP_WORKER = r'''
import copy, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from waypoint.models.transformer import ModelArgs, Transformer
from waypoint.training.fsdp import shard_model
from waypoint.training.loss import sequence_loss_sums

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, hidden_dim=64, max_seq_len=64,
                 final_softcap=30.0)
torch.manual_seed(0)
model = Transformer(args)
model.init_weights()
reference = copy.deepcopy(model)
g = torch.Generator().manual_seed(2)
pairs = 2 * world
tokens = torch.randint(0, 512, (2 * pairs, 24), generator=g)  # chosen rows, then the rejected ones
labels = tokens.clone()
labels[:, :8] = -100
c = torch.randn(pairs, generator=g)

def dpo_like(v, c):
    half = len(v) // 2
    return (torch.nn.functional.logsigmoid(v[:half] - v[half:]) * c).sum()

ref = sequence_loss_sums(reference, tokens, labels, loss_chunk=0)  # the whole batch, unsharded, full logits
dpo_like(ref, c).backward()
shard_model(model, init_device_mesh("cpu", (world,)))
mine = [2 * rank, 2 * rank + 1]  # this rank's pairs
rows = torch.tensor(mine + [pairs + i for i in mine])
v = sequence_loss_sums(model, tokens[rows], labels[rows], loss_chunk=5)
assert type(v.grad_fn).__name__ == "_LinearCrossEntropyRowsBackward", v.grad_fn  # the fused path, not full logits
(dpo_like(v, c[mine]) * world).backward()  # FSDP averages the gradients over ranks
torch.testing.assert_close(v.detach(), ref.detach()[rows], rtol=1e-5, atol=1e-5)
expected = dict(reference.named_parameters())
for name, p in model.named_parameters():
    torch.testing.assert_close(p.grad.full_tensor(), expected[name].grad, rtol=1e-4, atol=1e-6, msg=name)
open(f"{sys.argv[1]}/ok-{rank}", "w").close()  # a file per rank: the ranks' stdout lines may interleave
dist.barrier()  # every rank past its last collective
os._exit(0)  # no teardown: 1 in ~15 runs Gloo aborted in it ("terminate called without an active exception")
'''


def test_fsdp2_two_processes_get_the_unsharded_gradients(tmp_path):
    """The output weight kept for backward's recompute is the root unit's, whole until backward under FSDP2."""
    from tests.recipe_runs import run_recipe

    script = tmp_path / "worker.py"
    script.write_text(FSDP_WORKER)
    result = run_recipe(str(script), [str(tmp_path)], processes=2, env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1"]
