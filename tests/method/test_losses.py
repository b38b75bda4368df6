import pytest
import torch
import torch.nn.functional as F

from palu_trainer.method.losses import (
    TARGETS,
    common_kl_loss,
    common_kl_loss_top_m,
    label_nll_at_positions,
    local_entropy_loss,
    palu_forget_loss,
    palu_forget_loss_at_positions,
    predicting_rows,
    reference_targets,
    select_predictions,
    targets_from_selected,
)
from palu_trainer.method.roles import TokenRole

IGN, COM, INI, RED = (int(role) for role in TokenRole)


def test_local_loss_known_values_for_each_target():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    topk = torch.tensor([[3, 2]])
    assert local_entropy_loss(logits, topk, "global_mean").item() == pytest.approx(1.25)  # c = 2.5
    assert local_entropy_loss(logits, topk, "topk_mean").item() == pytest.approx(0.25)  # c = 3.5
    assert local_entropy_loss(logits, topk, "uniform").item() == pytest.approx(12.5)  # c = 0
    ref_mean = torch.tensor([1.0])
    assert local_entropy_loss(logits, topk, "ref_mean", ref_mean).item() == pytest.approx(6.5)


def test_local_loss_averages_over_positions():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 8.0]])
    topk = torch.tensor([[3, 2], [3, 0]])
    # row 2: c = 2 -> ((8-2)^2 + (0-2)^2) / 2 = 20
    assert local_entropy_loss(logits, topk).item() == pytest.approx((1.25 + 20.0) / 2)


def test_local_gradient_only_on_reference_topk_and_target_has_none():
    logits = torch.randn(3, 50, requires_grad=True)
    topk = torch.stack([torch.randperm(50)[:7] for _ in range(3)])
    for target in ("global_mean", "topk_mean", "uniform"):
        logits.grad = None
        local_entropy_loss(logits, topk, target).backward()
        outside = torch.ones_like(logits, dtype=torch.bool).scatter(1, topk, False)
        assert torch.all(logits.grad[outside] == 0)
        assert torch.all(logits.grad.gather(1, topk) != 0)
    # With c detached, d/dz_i = 2 (z_i - c) / (K * M).
    logits.grad = None
    local_entropy_loss(logits, topk, "global_mean").backward()
    center = logits.detach().mean(-1, keepdim=True)
    expected = 2 * (logits.detach().gather(1, topk) - center) / (7 * 3)
    torch.testing.assert_close(logits.grad.gather(1, topk), expected)


def test_full_vocabulary_k_is_the_variance_around_the_mean():
    logits = torch.randn(4, 32)
    topk = logits.topk(32, dim=-1).indices
    variance = logits.var(dim=-1, unbiased=False).mean()
    torch.testing.assert_close(local_entropy_loss(logits, topk, "global_mean"), variance)


def test_unknown_target_lists_the_choices():
    with pytest.raises(ValueError, match="global_mean, topk_mean, ref_mean, uniform"):
        local_entropy_loss(torch.zeros(1, 4), torch.zeros(1, 2, dtype=torch.long), "median")
    assert TARGETS == ("global_mean", "topk_mean", "ref_mean", "uniform")


def reference_of(reference_logits):
    probs = F.softmax(reference_logits, -1)
    return probs, (probs * probs.log()).sum(-1)


def test_kl_matches_the_definition_and_is_zero_for_equal_distributions():
    logits, reference = torch.randn(5, 11, requires_grad=True), torch.randn(5, 11)
    ref_log_probs = F.log_softmax(reference, -1)
    expected = F.kl_div(F.log_softmax(logits, -1), ref_log_probs, log_target=True, reduction="batchmean")
    kl = common_kl_loss(logits, *reference_of(reference))
    torch.testing.assert_close(kl, expected)
    assert common_kl_loss(reference, *reference_of(reference)).item() == pytest.approx(0.0, abs=1e-6)
    (gradient,) = torch.autograd.grad(kl, logits)
    (expected_gradient,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(gradient, expected_gradient)
    torch.testing.assert_close(gradient, (F.softmax(logits, -1) - ref_log_probs.exp()).detach() / 5)


def test_empty_selections_give_exact_zero_in_fp32():
    empty = torch.zeros(0, 9, dtype=torch.bfloat16)
    local = local_entropy_loss(empty, torch.zeros(0, 3, dtype=torch.long))
    kl = common_kl_loss(empty, torch.zeros(0, 9), torch.zeros(0))
    assert local.item() == 0.0 and kl.item() == 0.0
    assert local.dtype == kl.dtype == torch.float32


def test_bf16_logits_accumulate_in_fp32():
    logits = torch.randn(2, 16).to(torch.bfloat16)
    topk = torch.arange(16).repeat(2, 1)
    loss = local_entropy_loss(logits, topk)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, logits.float().var(-1, unbiased=False).mean())


def test_logits_at_t_minus_1_predict_the_token_at_t():
    logits = torch.arange(2 * 3 * 4, dtype=torch.float).reshape(2, 3, 4)
    roles = torch.tensor([[IGN, INI, COM], [INI, COM, INI]])
    # tokens (0, 1) and (1, 2) are initiating, predicted at (0, 0) and (1, 1); token 0 has no predictor
    assert predicting_rows(roles, TokenRole.INITIATING).tolist() == [0, 4]
    assert predicting_rows(roles, TokenRole.COMMON).tolist() == [1, 3]
    initiating, common = select_predictions(logits, roles)
    torch.testing.assert_close(initiating, torch.stack([logits[0, 0], logits[1, 1]]))
    torch.testing.assert_close(common, torch.stack([logits[0, 1], logits[1, 0]]))


def _batch(roles, vocab=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    roles = torch.tensor([roles])
    logits = torch.randn(1, roles.shape[1], vocab, generator=generator, requires_grad=True)
    reference_logits = torch.randn(1, roles.shape[1], vocab, generator=generator)
    return logits, reference_logits, roles


def test_forget_loss_uses_the_shifted_positions():
    logits, reference_logits, roles = _batch([IGN, INI, RED, COM])
    reference = reference_targets(reference_logits, roles, top_k=3)
    local, kl = palu_forget_loss(logits, roles, reference)
    # token 1 is initiating -> logits at position 0; token 3 is common -> logits at position 2
    ref_top = reference_logits[0, 0].topk(3).indices
    row = logits[0, 0].detach()
    expected_local = (row[ref_top] - row.mean()).pow(2).mean()
    expected_kl = common_kl_loss(logits[0, 2:3].detach(), *reference_of(reference_logits[0, 2:3]))
    torch.testing.assert_close(local.detach(), expected_local)
    torch.testing.assert_close(kl.detach(), expected_kl)


def test_redundant_and_ignored_positions_get_exactly_zero_gradient():
    logits, reference_logits, roles = _batch([IGN, INI, INI, RED, RED, COM, COM, IGN])
    reference = reference_targets(reference_logits, roles, top_k=4)
    local, kl = palu_forget_loss(logits, roles, reference)
    (local + kl).backward()
    per_position = logits.grad[0].abs().sum(-1)
    # logits at t predict token t+1: positions 2, 3 predict redundant tokens; 6, 7 predict ignored/nothing
    assert per_position[[2, 3, 6, 7]].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert torch.all(per_position[[0, 1, 4, 5]] > 0)


def test_sample_without_span_gets_only_its_finite_kl():
    logits, reference_logits, roles = _batch([IGN, COM, COM, COM])
    reference = reference_targets(reference_logits, roles, top_k=3)
    local, kl = palu_forget_loss(logits, roles, reference)
    total = local + 2.0 * kl
    assert local.item() == 0.0 and torch.isfinite(total)
    torch.testing.assert_close(total, 2.0 * kl)
    total.backward()
    assert torch.isfinite(logits.grad).all()


def test_reference_targets_take_the_reference_top_k():
    reference_logits = torch.tensor([[[0.0, 5.0, 1.0, 3.0], [9.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]])
    roles = torch.tensor([[IGN, INI, COM]])
    reference = reference_targets(reference_logits, roles, top_k=2)
    assert reference.topk_indices.tolist() == [[1, 3]]
    assert reference.logit_mean.tolist() == [2.25]
    probs, neg_entropy = reference_of(reference_logits[0, 1:2])
    torch.testing.assert_close(reference.common_probs, probs)
    torch.testing.assert_close(reference.common_neg_entropy, neg_entropy)


def kl_and_gradient(loss_fn, logits):
    logits = logits.clone().requires_grad_(True)
    loss = loss_fn(logits)
    loss.backward()
    return loss.detach(), logits.grad


def top_m_reference(reference_logits, top_m):
    targets = targets_from_selected(reference_logits[:0], reference_logits, top_k=1, top_m=top_m)
    return lambda logits: common_kl_loss_top_m(
        logits,
        targets.common_indices,
        targets.common_probs,
        targets.common_tail_mass,
        targets.common_neg_entropy,
    )


def full_reference(reference_logits):
    probs, neg_entropy = reference_of(reference_logits)
    return lambda logits: common_kl_loss(logits, probs, neg_entropy)


def test_top_m_kl_with_every_entry_is_the_full_kl():
    torch.manual_seed(0)
    reference_logits, logits = 3 * torch.randn(6, 50), 3 * torch.randn(6, 50)
    exact = kl_and_gradient(full_reference(reference_logits), logits)
    top_m = kl_and_gradient(top_m_reference(reference_logits, 50), logits)
    torch.testing.assert_close(top_m, exact, rtol=1e-5, atol=1e-7)


def test_top_m_kl_is_exact_at_the_reference_and_bounded_by_the_tail_after():
    """At P_θ = P_ref: KL 0 and the exact gradient. Moved: the KL misses exactly r·KL(tail), ≥ 0, and
    each row's gradient differs by at most 2r in L1 (the tail's mass spread like the current model's)."""
    torch.manual_seed(0)
    reference_logits = 4 * torch.randn(8, 1000)  # peaked like a trained LM's
    top_m = 32
    cached = top_m_reference(reference_logits, top_m)
    kl, gradient = kl_and_gradient(cached, reference_logits)
    assert abs(float(kl)) < 1e-5 and gradient.abs().max() < 1e-7  # 0 up to fp32 rounding
    moved = reference_logits + 0.5 * torch.randn(8, 1000)
    exact_kl, exact_gradient = kl_and_gradient(full_reference(reference_logits), moved)
    kl, gradient = kl_and_gradient(cached, moved)
    p, q = F.softmax(reference_logits, -1), F.softmax(moved, -1)
    tail = torch.ones_like(p, dtype=torch.bool).scatter(-1, p.topk(top_m, -1).indices, False)
    p_tail, q_tail = p.where(tail, 0), q.where(tail, 0)
    r, current_tail = p_tail.sum(-1, keepdim=True), q_tail.sum(-1, keepdim=True)
    missed = (  # r·KL(p_tail/r ‖ q_tail/Q) = Σ_tail p·log((p/r) / (q/Q))
        torch.special.xlogy(p_tail, p_tail / r) - torch.special.xlogy(p_tail, q_tail / current_tail)
    ).sum(-1)
    assert 0 < float(exact_kl - kl)
    # atol: fp32 rounding of the logsumexp-sized terms (~15 here) that cancel in each KL
    torch.testing.assert_close(exact_kl - kl, missed.mean(), rtol=1e-3, atol=3e-5)
    rows = len(moved)  # the loss is a mean over rows: each row's gradient carries 1/rows
    assert ((gradient - exact_gradient).abs().sum(-1) * rows <= 2 * r.squeeze(-1) + 1e-6).all()
    assert float(r.max()) < 0.2


def test_projection_at_positions_gives_the_full_logits_losses_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16)
    project = torch.nn.Linear(16, 40)
    roles = torch.tensor([[IGN, IGN, COM, INI, INI, RED, COM], [IGN, INI, RED, COM, COM, IGN, IGN]])
    labels = torch.tensor([[-100, -100, 5, 6, 7, 8, 9], [-100, 1, 2, 3, 4, -100, -100]])
    reference = reference_targets(torch.randn(2, 7, 40), roles, top_k=5)

    def losses_and_gradients(at_positions):
        project.zero_grad()
        leaf = hidden.clone().requires_grad_(True)
        if at_positions:
            terms = [*palu_forget_loss_at_positions(leaf, project, roles, reference)]
            terms.append(label_nll_at_positions(leaf, project, labels))
        else:
            logits = project(leaf)
            terms = [*palu_forget_loss(logits, roles, reference)]
            terms.append(F.cross_entropy(logits[:, :-1].reshape(-1, 40), labels[:, 1:].reshape(-1)))
        torch.stack(terms).sum().backward()
        return torch.stack(terms).detach(), leaf.grad, project.weight.grad.clone(), project.bias.grad.clone()

    at_positions, full = losses_and_gradients(True), losses_and_gradients(False)
    assert (at_positions[0] > 0).all()
    torch.testing.assert_close(at_positions, full, rtol=1e-5, atol=1e-7)
    hidden_gradient = at_positions[1]
    assert (
        hidden_gradient[1, 5:].abs().sum() == 0 == hidden_gradient[0, 6].abs().sum()
    )  # predict nothing read
    no_labels = torch.full_like(labels, -100)
    assert label_nll_at_positions(hidden, project, no_labels).item() == 0.0
