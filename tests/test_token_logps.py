"""Each completion token's log-prob and entropy through the fused output projection (``models.token_logps``): the
plain path's values and gradients, with a temperature and Gemma's logit cap; and the native model's against
transformers' logits of the same checkpoint, divided by the temperature as TRL's GRPOTrainer divides them."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ROOT
from waypoint.models.fused_loss import IGNORE_INDEX
from waypoint.models.token_logps import linear_token_logps, token_logps_from_logits


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_matches_the_plain_path_values_and_gradients(softcap, temperature):
    torch.manual_seed(0)
    h = torch.randn(3, 9, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 9))
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[2, 6:] = IGNORE_INDEX  # padding
    logps, entropies = linear_token_logps(h, w, labels, chunk=4, softcap=softcap, temperature=temperature)
    logits = h @ w.T
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    plain, plain_entropies = token_logps_from_logits(logits, labels, temperature)
    assert torch.equal(logps, plain) and torch.equal(entropies, plain_entropies)
    assert (logps[labels[:, 1:] == IGNORE_INDEX] == 0).all() and (logps[labels[:, 1:] != IGNORE_INDEX] < 0).all()
    assert not entropies.requires_grad
    weights = torch.randn_like(logps)
    fused = torch.autograd.grad((logps * weights).sum(), (h, w))
    reference = torch.autograd.grad((plain * weights).sum(), (h, w))
    for a, b in zip(fused, reference):  # the softmax is fp32 in both; its rounding differs between the two orders
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_under_no_grad_nothing_is_kept():
    h, w = torch.randn(2, 5, 8), torch.randn(20, 8)
    labels = torch.randint(0, 20, (2, 5))
    with torch.no_grad():
        logps, entropies = linear_token_logps(h, w, labels)
    assert logps.grad_fn is None and logps.shape == entropies.shape == (2, 4)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_native_model_matches_transformers_tempered_logps(temperature):
    """TRL: ``selective_log_softmax(logits / temperature, ids)`` and ``entropy_from_logits`` of the HF model's logits."""
    from transformers import AutoModelForCausalLM

    from waypoint.checkpointers.load_model import load_model

    source = ROOT / "assets/tiny_llama"
    hf = AutoModelForCausalLM.from_pretrained(source).eval()
    ours = load_model(source).eval()
    torch.manual_seed(1)
    tokens = torch.randint(4, 512, (2, 12))
    labels = tokens.clone()
    labels[:, :5] = IGNORE_INDEX  # the prompt
    with torch.no_grad():
        logps, entropies = ours(tokens, labels=labels, per_token=True, temperature=temperature)
        logits = hf(tokens).logits[:, :-1].float() / temperature
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    expected_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    kept = labels[:, 1:] != IGNORE_INDEX
    assert torch.allclose(logps[kept], expected[kept], atol=1e-5)
    assert torch.allclose(entropies[kept], expected_entropy[kept], atol=1e-5)
