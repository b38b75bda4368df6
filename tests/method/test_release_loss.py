"""trainer=PALU_release's loss against a naive per-token loop written from reading the released code.

The released loss (github nxZhai/PALU, src/trainer/unlearn/palu.py), with position t-1 scoring token t:
    local  = mean over initiating tokens of (1/K) sum_{i in top-K of the reference} (z_i - c)^2,
             c = mean over V of the current logits, with gradient
    kl     = mean over common tokens of sum_v p_v (log p_v - log r_v),  p = softmax(z), r = softmax(ref)
    loss   = gamma * local + alpha * retain + alpha * kl
"""

import math

import pytest
import torch

from palu_trainer.method.reference import reference_targets
from palu_trainer.method.roles import TokenRole
from palu_trainer.options import PALUOptions

IGN, COM, INI, RED = (int(role) for role in TokenRole)


def naive_released_loss(current, reference, roles, retain, top_k, gamma, alpha):
    """One Python loop over batch, positions and vocabulary, on scalars (autograd gives its gradient)."""
    batch, length, vocab = current.shape
    local_sum, initiating, kl_sum, common = 0.0, 0, 0.0, 0
    for b in range(batch):
        for t in range(1, length):
            z, q = current[b, t - 1], reference[b, t - 1]
            if roles[b][t] == INI:
                ranked = sorted(range(vocab), key=lambda v: float(q[v]), reverse=True)[:top_k]
                center = sum(z[v] for v in range(vocab)) / vocab
                local_sum = local_sum + sum((z[i] - center) ** 2 for i in ranked) / top_k
                initiating += 1
            elif roles[b][t] == COM:
                z_norm = torch.logsumexp(torch.stack([z[v] for v in range(vocab)]), 0)
                q_norm = math.log(sum(math.exp(float(q[v])) for v in range(vocab)))
                for v in range(vocab):
                    log_p = z[v] - z_norm
                    kl_sum = kl_sum + torch.exp(log_p) * (log_p - (float(q[v]) - q_norm))
                common += 1
    local = local_sum / max(initiating, 1)
    kl = kl_sum / common if common else 0.0
    return gamma * local + alpha * retain + alpha * kl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_release_form_matches_the_naive_loop_in_value_and_gradient(seed):
    generator = torch.Generator().manual_seed(seed)
    batch, length, vocab, top_k, gamma, alpha = 2, 7, 9, 4, 0.7, 1.8
    current = torch.randn(batch, length, vocab, generator=generator, dtype=torch.float64) * 2
    current.requires_grad_(True)
    reference = torch.randn(batch, length, vocab, generator=generator, dtype=torch.float64) * 2
    roles = torch.randint(0, 4, (batch, length), generator=generator)
    roles[:, 1:3] = torch.tensor([INI, COM])  # every batch has both kinds
    retain = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)

    targets = reference_targets(reference, roles, top_k, kl_direction="policy_to_ref")
    released = PALUOptions(
        target_gradient=True, kl_direction="policy_to_ref", kl_weight="alpha", gamma=gamma, alpha=alpha
    ).objective(top_k)
    ours = released.weigh(*released.forget_terms(current, None, roles, targets), retain).loss
    naive = naive_released_loss(current, reference, roles.tolist(), retain, top_k, gamma, alpha)

    assert ours.item() == pytest.approx(naive.item(), abs=1e-6, rel=1e-6)
    ours_grads = torch.autograd.grad(ours, (current, retain))
    naive_grads = torch.autograd.grad(naive, (current, retain))
    for mine, expected in zip(ours_grads, naive_grads):
        torch.testing.assert_close(mine, expected, atol=1e-6, rtol=1e-6)


def test_paper_form_differs_from_the_release():
    generator = torch.Generator().manual_seed(0)
    current = torch.randn(1, 6, 9, generator=generator, dtype=torch.float64, requires_grad=True)
    reference = torch.randn(1, 6, 9, generator=generator, dtype=torch.float64)
    roles = torch.tensor([[IGN, INI, COM, COM, INI, COM]])
    retain = torch.tensor(1.0, dtype=torch.float64)
    naive = naive_released_loss(current, reference, roles.tolist(), retain, 4, 1.0, 2.0)
    paper_objective = PALUOptions(gamma=1.0, alpha=2.0, kl_weight=1.0).objective(4)
    forget = paper_objective.forget_terms(current, None, roles, reference_targets(reference, roles, 4))
    paper = paper_objective.weigh(*forget, retain).loss
    assert abs(paper.item() - naive.item()) > 1e-3
