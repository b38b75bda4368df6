import math

import pytest
import torch

from palu_trainer.method.roles import TokenRole
from palu_trainer.method.tpo_losses import tpo_preference_loss, tpo_preservation_loss

IGN, COM, INI, RED = (int(role) for role in TokenRole)
BETA = 0.32


def naive_tpo(logits, reference_logits, input_ids, roles, beta):
    """Token-by-token float64 loops: (LPL, PL) as TPO's released `tpo_grad_diff` defines them."""
    batch, length, vocab = logits.shape
    logits, reference_logits = logits.double(), reference_logits.double()
    current_means, reference_means = [], []
    preservation = torch.zeros((), dtype=torch.float64)
    for b in range(batch):
        current_sum, reference_sum, count = 0.0, 0.0, 0
        for t in range(1, length):
            token = int(input_ids[b, t])
            if roles[b, t] in (INI, RED):
                current_sum = current_sum + logits[b, t - 1, token]
                reference_sum = reference_sum + float(reference_logits[b, t - 1, token])
                count += 1
            elif roles[b, t] == COM:
                row = logits[b, t - 1]
                log_normalizer = torch.log(sum(torch.exp(row[v]) for v in range(vocab)))
                preservation = preservation + (log_normalizer - row[token])
        if count:
            current_means.append(current_sum / count)
            reference_means.append(reference_sum / count)
    preference = torch.zeros((), dtype=torch.float64)
    if current_means:
        difference = sum(reference_means) / len(reference_means) - sum(current_means) / len(current_means)
        preference = -(2.0 / beta) * torch.log(1.0 / (1.0 + torch.exp(-beta * difference)))
    return preference, preservation / batch


def random_batch(seed, batch=4, length=9, vocab=13):
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(batch, length, vocab, generator=generator)).requires_grad_()
    reference_logits = 3 * torch.randn(batch, length, vocab, generator=generator)
    input_ids = torch.randint(vocab, (batch, length), generator=generator)
    roles = torch.randint(4, (batch, length), generator=generator)
    roles[:, :2] = IGN  # prompt
    roles[1] = torch.tensor([IGN, IGN, COM, COM, COM, IGN, IGN, IGN, IGN])  # no sensitive token
    roles[2, -2:] = IGN  # padding
    return logits, reference_logits, input_ids, roles


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tpo_terms_and_gradients_match_a_naive_loop(seed):
    logits, reference_logits, input_ids, roles = random_batch(seed)
    terms = (
        tpo_preference_loss(logits, reference_logits, input_ids, roles, BETA),
        tpo_preservation_loss(logits, input_ids, roles),
    )
    expected = naive_tpo(logits, reference_logits, input_ids, roles, BETA)
    for term, reference in zip(terms, expected):
        assert term.dtype == torch.float32
        torch.testing.assert_close(term.double(), reference, rtol=1e-6, atol=1e-6)
        (gradient,) = torch.autograd.grad(term, logits)
        (expected_gradient,) = torch.autograd.grad(reference, logits)
        torch.testing.assert_close(gradient.double(), expected_gradient.double(), rtol=1e-6, atol=1e-6)


def test_preference_gradient_lowers_the_target_logit_by_the_closed_form():
    """∂LPL/∂z[b,t-1,y_t] = 2·σ(−β·d)/(S·|sensitive_b|) on sensitive tokens, 0 elsewhere."""
    logits, reference_logits, input_ids, roles = random_batch(5)
    loss = tpo_preference_loss(logits, reference_logits, input_ids, roles, BETA)
    (gradient,) = torch.autograd.grad(loss, logits)
    sensitive = (roles == INI) | (roles == RED)
    counts = sensitive[:, 1:].sum(dim=1)
    sequences = int((counts > 0).sum())
    # invert LPL = (2/β)·log(1 + e^{−β·d})
    difference = -math.log(math.expm1(BETA * loss.item() / 2)) / BETA
    expected = torch.zeros_like(gradient)
    for b, t in torch.nonzero(sensitive[:, 1:]).tolist():
        expected[b, t, input_ids[b, t + 1]] += (
            2 * torch.sigmoid(torch.tensor(-BETA * difference)) / (sequences * counts[b])
        )
    torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-7)
    assert (gradient >= 0).all()  # a descent step only lowers target logits


def test_equal_models_give_log2_and_the_reference_gets_no_gradient():
    logits, _, input_ids, roles = random_batch(3)
    reference_logits = logits.detach().clone().requires_grad_()
    loss = tpo_preference_loss(logits, reference_logits, input_ids, roles, BETA)
    assert loss.item() == pytest.approx(2 / BETA * math.log(2), rel=1e-6)
    loss.backward()
    assert reference_logits.grad is None


def test_empty_masks_give_exactly_zero():
    logits, reference_logits, input_ids, _ = random_batch(4)
    ignored = torch.full(input_ids.shape, IGN)
    common_only = torch.where(torch.arange(input_ids.shape[1]) > 2, COM, IGN).expand_as(ignored)
    assert tpo_preference_loss(logits, reference_logits, input_ids, ignored, BETA).item() == 0.0
    assert tpo_preference_loss(logits, reference_logits, input_ids, common_only, BETA).item() == 0.0
    assert tpo_preservation_loss(logits, input_ids, ignored).item() == 0.0
    assert tpo_preservation_loss(logits, input_ids, common_only).item() > 0
