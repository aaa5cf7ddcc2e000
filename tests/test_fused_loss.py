"""The output projection fused with a chunked cross-entropy: the plain path's losses and gradients, without ever
holding the logits of more than one chunk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from waypoint.models.fused_loss import ChunkBuffer, linear_cross_entropy_sum, next_token_loss_sum
from waypoint.models.transformer import ModelArgs, Transformer


def plain(h, w, y, softcap=None):
    logits = h @ w.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return next_token_loss_sum(logits, y)


def gradients(loss_fn, h, w, y, softcap):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = loss_fn(h, w, y, softcap=softcap)
    (loss * 0.37).backward()  # a scaled loss, as the recipes divide by the step's tokens
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_loss_and_its_gradients_are_the_plain_paths(dtype, tolerance, softcap):
    torch.manual_seed(0)
    h, w = torch.randn(3, 37, 16, dtype=dtype), (torch.randn(101, 16) * 0.5).to(dtype)
    y = torch.randint(0, 101, (3, 37))
    y[0, 5:9] = -100  # unsupervised positions
    ref = gradients(plain, h, w, y, softcap)
    fused = gradients(lambda *a, **k: linear_cross_entropy_sum(*a, chunk=10, **k), h, w, y, softcap)
    assert fused[0].dtype == torch.float32
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=0)
    for mine, theirs in zip(fused[1:], ref[1:]):  # relative to the largest gradient (bf16: one rounding step)
        assert mine.dtype == theirs.dtype
        assert (mine.float() - theirs.float()).abs().max() <= tolerance * theirs.float().abs().max()


def test_each_tokens_loss_is_the_plain_one():
    torch.manual_seed(0)
    h, w, y = torch.randn(2, 100, 32), torch.randn(3000, 32) * 0.1, torch.randint(0, 3000, (2, 100))
    per_token = F.cross_entropy((h @ w.T)[:, :-1].flatten(0, 1), y[:, 1:].flatten(), reduction="none")
    for t in range(0, per_token.numel(), 11):
        alone = torch.full_like(y, -100)  # only token t supervised: its row alone goes through the projection
        b, s = divmod(t, y.shape[1] - 1)
        alone[b, s + 1] = y[b, s + 1]
        mine = linear_cross_entropy_sum(h, w, alone, chunk=16)
        torch.testing.assert_close(mine, per_token[t], rtol=1e-6, atol=0)


def test_only_the_supervised_rows_go_through_the_projection():
    torch.manual_seed(0)
    h, w = torch.randn(2, 40, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    y = torch.randint(0, 50, (2, 40))
    y[:, :25] = -100  # prompts: 2 x 15 of the 78 next-token positions stay supervised
    seen = MatmulRows()
    with seen:
        loss = linear_cross_entropy_sum(h, w, y, chunk=1000)
        loss.backward()
    assert seen.rows == [30, 30, 50]  # logits, hidden gradient, weight gradient (its rows: the vocabulary)
    ref = gradients(plain, h, w, y, None)
    torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-6, atol=0)
    assert torch.equal(h.grad[:, :24], torch.zeros(2, 24, 8)) and h.grad[:, 24:39].abs().sum() > 0
    torch.testing.assert_close(h.grad, ref[1] / 0.37, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad, ref[2] / 0.37, rtol=1e-5, atol=1e-7)
    none = torch.full_like(y, -100)  # no supervised position at all: a zero loss and zero gradients
    h.grad = w.grad = None
    linear_cross_entropy_sum(h, w, none).backward()
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))


class MatmulRows(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.rows.append(args[-2].shape[0])
        return func(*args, **(kwargs or {}))


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel, self.products = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.products += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_never_holds_the_full_logits_and_trains_as_before(tied):
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=4096, hidden_dim=64, max_seq_len=128,
                     tie_embeddings=tied, final_softcap=30.0)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, 4096, (2, 64))
    labels = tokens.clone()
    labels[1, :10] = -100
    results = {}
    for chunk in (0, 16):
        model.zero_grad(set_to_none=True)
        with LargestTensor() as seen:
            loss = model(tokens, labels=labels, loss_chunk=chunk)
            loss.backward()
        results[chunk] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, seen.numel
    logits_numel = tokens.numel() * args.vocab_size
    assert results[0][2] >= logits_numel  # the plain path: the full logits exist
    assert results[16][2] < logits_numel // 2  # fused: 16 rows of logits at a time (the weight, 4096 x 32, is larger)
    torch.testing.assert_close(results[16][0], results[0][0], rtol=1e-6, atol=0)
    assert torch.equal(results[0][0], next_token_loss_sum(model(tokens), labels).detach())
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[16][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_without_gradients_only_the_losses_are_computed():
    torch.manual_seed(0)
    h, w, y = torch.randn(2, 20, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True), torch.randint(0, 50, (2, 20))
    with torch.no_grad(), LargestTensor() as seen:
        loss = linear_cross_entropy_sum(h, w, y, chunk=5)
    assert not loss.requires_grad and seen.products == 8  # one product per chunk of 5 of the 38 rows: the logits only
    torch.testing.assert_close(loss, plain(h, w, y).detach(), rtol=1e-6, atol=0)


class FreshTensors(TorchDispatchMode):
    """The element counts of the tensors each op allocates: outputs that are neither views of its inputs nor
    written into them (``out=``, in place)."""

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.numels += [t.numel() for t in pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_a_training_step_writes_its_chunks_into_the_buffer_the_model_keeps(dtype, softcap):
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=4096, hidden_dim=64, max_seq_len=128,
                     final_softcap=softcap)
    torch.manual_seed(0)
    model = Transformer(args).to(dtype)
    model.reset_rope()
    tokens = torch.randint(0, 4096, (2, 64))
    labels = tokens.clone()
    labels[1, :10] = -100  # 116 supervised rows: chunks of 64 and 52
    allocated = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with FreshTensors() as seen:
            model(tokens, labels=labels, loss_chunk=64).backward()
        allocated.append(max(seen.numels))
    chunk_logits = 52 * args.vocab_size  # the smallest chunk's; the largest other tensor is a [vocab, dim] gradient
    assert allocated[0] >= chunk_logits  # the first step allocates the buffer
    assert allocated[1] <= args.vocab_size * args.dim  # the next one fills it in place: no chunk-sized allocation


def test_a_kept_buffer_gives_the_bits_of_a_fresh_one():
    kept = ChunkBuffer()
    for dtype, rows, chunk, softcap in [(torch.float32, 20, 7, None), (torch.float32, 60, 50, 30.0),
                                        (torch.bfloat16, 60, 50, 30.0), (torch.float32, 30, 11, None)]:
        torch.manual_seed(rows)
        h, w = torch.randn(2, rows, 16, dtype=dtype), (torch.randn(300, 16) * 0.5).to(dtype)
        y = torch.randint(0, 300, (2, rows))
        fresh = gradients(lambda *a, **k: linear_cross_entropy_sum(*a, chunk=chunk, **k), h, w, y, softcap)
        reused = gradients(lambda *a, **k: linear_cross_entropy_sum(*a, chunk=chunk, buffer=kept, **k), h, w, y, softcap)
        for mine, theirs in zip(reused, fresh):
            assert torch.equal(mine, theirs)
