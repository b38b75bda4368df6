import logging
import math

import pytest
import torch
import torch.nn.functional as F

from palu_trainer.method.chunking import ProjectionCalls, mean_over_chunks
from palu_trainer.method.kl import common_kl_loss, common_kl_to_reference_loss
from palu_trainer.method.local_loss import TARGETS, local_entropy_loss, resolve_top_k
from palu_trainer.method.objective import term_gradient_norms
from palu_trainer.method.reference import (
    DenseReference,
    ModelReference,
    TopMReference,
    common_fields,
    initiating_targets,
    reference_targets,
)
from palu_trainer.method.roles import TokenRole, at_forget_positions, predicting_rows
from palu_trainer.options import PALUOptions

IGN, COM, INI, RED = (int(role) for role in TokenRole)


def forget_terms(logits, roles, reference, **options):
    """PALU's (local, KL) of full logits (B, T, V): the objective's forget terms with no projection (K comes
    from the reference)."""
    return PALUOptions(**options).objective(1).forget_terms(logits, None, roles, reference)


def weighted_terms(local, kl, retain, gamma=1.0, alpha=1.0, kl_weight=1.0):
    return PALUOptions(gamma=gamma, alpha=alpha, kl_weight=kl_weight).objective(1).weigh(local, kl, retain)


def detached_local_loss(logits, topk, target, reference_mean=None) -> float:
    """The local loss with c detached (the default), as a number."""
    return local_entropy_loss(logits, topk, target, reference_mean, target_gradient=False).item()


def test_local_loss_known_values_for_each_target():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    topk = torch.tensor([[3, 2]])
    assert detached_local_loss(logits, topk, "global_mean") == pytest.approx(1.25)  # c = 2.5
    assert detached_local_loss(logits, topk, "topk_mean") == pytest.approx(0.25)  # c = 3.5
    assert detached_local_loss(logits, topk, "zero") == pytest.approx(12.5)  # c = 0
    assert detached_local_loss(logits, topk, "ref_mean", torch.tensor([1.0])) == pytest.approx(6.5)
    uniform_level = math.log(sum(math.exp(z) for z in (1, 2, 3, 4)) / 4)  # logit of probability 1/4
    expected = ((4 - uniform_level) ** 2 + (3 - uniform_level) ** 2) / 2
    assert detached_local_loss(logits, topk, "uniform") == pytest.approx(expected)


def test_uniform_target_is_zero_exactly_when_the_top_k_have_probability_one_over_v():
    probs = torch.tensor([[0.2, 0.2, 0.1, 0.5, 0.0]]) + torch.tensor([[0.0, 0.0, 0.0, -0.02, 0.02]])
    topk = torch.tensor([[0, 1]])  # p = 1/|V| = 0.2 on both
    assert detached_local_loss(probs.log() + 3.0, topk, "uniform") == pytest.approx(0.0, abs=1e-10)
    assert detached_local_loss(probs.log(), torch.tensor([[0, 2]]), "uniform") > 0.1
    # Like the other readings it ignores a shift of all logits; c = 0 does not.
    logits = torch.randn(3, 20)
    topk = logits.topk(5, dim=-1).indices
    for target, invariant in (("uniform", True), ("global_mean", True), ("zero", False)):
        shifted = detached_local_loss(logits + 4.0, topk, target)
        assert (shifted == pytest.approx(detached_local_loss(logits, topk, target))) == invariant, target


def test_local_loss_averages_over_positions():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 8.0]])
    topk = torch.tensor([[3, 2], [3, 0]])
    # row 2: c = 2 -> ((8-2)^2 + (0-2)^2) / 2 = 20
    assert detached_local_loss(logits, topk, "global_mean") == pytest.approx((1.25 + 20.0) / 2)


def test_local_gradient_only_on_reference_topk_and_target_has_none():
    logits = torch.randn(3, 50, requires_grad=True)
    topk = torch.stack([torch.randperm(50)[:7] for _ in range(3)])
    for target in ("global_mean", "topk_mean", "uniform", "zero"):
        logits.grad = None
        local_entropy_loss(logits, topk, target, target_gradient=False).backward()
        outside = torch.ones_like(logits, dtype=torch.bool).scatter(1, topk, False)
        assert torch.all(logits.grad[outside] == 0)
        assert torch.all(logits.grad.gather(1, topk) != 0)
    # With c detached, d/dz_i = 2 (z_i - c) / (K * M).
    logits.grad = None
    local_entropy_loss(logits, topk, "global_mean", target_gradient=False).backward()
    center = logits.detach().mean(-1, keepdim=True)
    expected = 2 * (logits.detach().gather(1, topk) - center) / (7 * 3)
    torch.testing.assert_close(logits.grad.gather(1, topk), expected)


def test_gradient_through_the_target_is_the_released_codes():
    logits = torch.randn(3, 50, dtype=torch.float64, requires_grad=True)
    topk = torch.stack([torch.randperm(50)[:7] for _ in range(3)])
    with_gradient = local_entropy_loss(logits, topk, "global_mean", target_gradient=True)
    (gradient,) = torch.autograd.grad(with_gradient, logits)
    assert with_gradient.item() == pytest.approx(
        local_entropy_loss(logits, topk, "global_mean", target_gradient=False).item(), rel=1e-12
    )
    # d/dz_v = (2 / (K M)) [(z_v - c) 1{v in top-K} - (1/V) sum_{i in top-K} (z_i - c)]
    z = logits.detach()
    deviation = z.gather(1, topk) - z.mean(-1, keepdim=True)
    expected = torch.zeros_like(z).scatter(1, topk, deviation) - deviation.sum(-1, keepdim=True) / 50
    torch.testing.assert_close(gradient, 2 * expected / (7 * 3))
    assert torch.all(gradient != 0)  # every logit, not only the top-K


# Which (target c, gradient through c) pairs follow the gradient of a shift-invariant loss: adding one
# constant to every logit leaves the softmax unchanged, so a step along the all-ones direction of the logits
# forgets nothing (issue 59). docs/method.md's table states the same.
SHIFT_INVARIANT = {
    ("global_mean", True): True,
    ("topk_mean", True): True,
    ("uniform", True): True,
    ("global_mean", False): False,
    # the top-K's deviations from their own mean sum to zero, so ∂ℓ/∂c = 0: detaching c changes nothing
    ("topk_mean", False): True,
    ("uniform", False): False,
    ("ref_mean", True): False,  # the reference's mean is a constant: no gradient to carry
    ("ref_mean", False): False,
    ("zero", True): False,
    ("zero", False): False,
}


@pytest.mark.parametrize(("target", "target_gradient"), list(SHIFT_INVARIANT))
def test_each_position_logit_gradient_sums_to_zero_exactly_for_the_shift_invariant_forms(
    target, target_gradient
):
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 64, dtype=torch.float64) + 5).requires_grad_(True)
    topk = logits.detach().topk(10, dim=-1).indices  # above the mean: deviations do not cancel
    reference_mean = torch.full((4,), 4.0, dtype=torch.float64)
    loss = local_entropy_loss(logits, topk, target, reference_mean, target_gradient=target_gradient)
    (gradient,) = torch.autograd.grad(loss, logits)
    per_position_sum = gradient.sum(-1)
    if SHIFT_INVARIANT[(target, target_gradient)]:
        torch.testing.assert_close(per_position_sum, torch.zeros(4, dtype=torch.float64), atol=1e-12, rtol=0)
        shifted = local_entropy_loss(
            logits + 7.5, topk, target, reference_mean, target_gradient=target_gradient
        )
        assert shifted.item() == pytest.approx(loss.item(), rel=1e-12)
    else:
        assert per_position_sum.abs().min() > 1e-3 * gradient.abs().max()


def test_full_vocabulary_k_is_the_variance_around_the_mean():
    logits = torch.randn(4, 32)
    topk = logits.topk(32, dim=-1).indices
    variance = logits.var(dim=-1, unbiased=False).mean()
    torch.testing.assert_close(
        local_entropy_loss(logits, topk, "global_mean", target_gradient=False), variance
    )


def test_unknown_target_lists_the_choices():
    with pytest.raises(
        ValueError, match="^target='median'; choose one of global_mean, topk_mean, ref_mean, uni"
    ):
        PALUOptions.parse({"target": "median"})
    assert TARGETS == ("global_mean", "topk_mean", "ref_mean", "uniform", "zero")


@pytest.mark.parametrize(
    ("top_k", "vocab_size", "k"),
    [
        (5000, 32000, 5000),
        (10**6, 4096, 4096),
        ("all", 4096, 4096),
        (0.15625, 32000, 5000),
        (0.15625, 4096, 640),
        (0.15625, 1024, 160),
        (0.15625, 128256, 20040),
        (1, 4096, 1),
        (1.0, 4096, 4096),
        (1e-9, 4096, 1),
    ],
)
def test_top_k_forms_resolve_against_the_vocabulary(top_k, vocab_size, k, caplog):
    with caplog.at_level(logging.INFO, logger="palu_trainer.method.local_loss"):
        assert resolve_top_k(top_k, vocab_size) == k
    assert f"K={k} of |V|={vocab_size}" in caplog.text
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warned) == (k == vocab_size)
    if warned:
        assert "flattens the whole vocabulary (a PDU-like objective)" in warned[0].getMessage()


@pytest.mark.parametrize("top_k", [0, -5, "abc", 0.0, 1.5, -0.2, True, None, "0.5"])
def test_bad_top_k_names_the_option_and_the_forms(top_k):
    with pytest.raises(
        ValueError, match=r"^top_k=.*: give a positive integer K, `all`, or a share of the vocab"
    ):
        PALUOptions.parse({"top_k": top_k})


@pytest.mark.parametrize("kl_weight", [-1, -0.5, "beta", True, None, float("nan")])
def test_bad_kl_weight_names_the_option(kl_weight):
    with pytest.raises(ValueError, match=r"kl_weight=.*must be a number >= 0 .* or `alpha`"):
        PALUOptions.parse({"kl_weight": kl_weight})


def test_loss_weights_the_kl_by_lambda_or_by_alpha():
    local, kl, retain = torch.tensor(2.0), torch.tensor(3.0), torch.tensor(5.0)
    assert (
        weighted_terms(local, kl, retain, gamma=0.5, alpha=2.0, kl_weight=4.0).loss.item()
        == 0.5 * (2 + 4 * 3) + 2 * 5
    )
    assert (
        weighted_terms(local, kl, retain, gamma=0.5, alpha=2.0, kl_weight="alpha").loss.item()
        == 0.5 * 2 + 2 * 3 + 2 * 5
    )


def test_reference_scaled_local_loss_is_one_at_the_reference_and_free_of_the_logit_scale():
    """local_loss_scale=reference: each position's loss over the reference's own (1/K)·Σ(z − mean z)²
    there; 1 when the model is the reference (c = global mean), and unchanged when every logit doubles,
    where the paper's loss quadruples."""
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 50) * 3
    roles = torch.tensor([[IGN, INI, INI, COM, INI, COM]])
    reference = reference_targets(logits, roles, top_k=7)
    initiating = logits[0, :-1][roles[0, 1:] == INI]
    top = initiating.topk(7, dim=-1).values
    expected_spread = (top - initiating.mean(-1, keepdim=True)).pow(2).mean(-1)
    torch.testing.assert_close(reference.initiating_targets.topk_spread, expected_spread)
    paper, _ = forget_terms(logits, roles, reference)
    scaled, _ = forget_terms(logits, roles, reference, local_loss_scale="reference")
    assert scaled.item() == pytest.approx(1.0)
    assert paper.item() == pytest.approx(expected_spread.mean().item())
    moved = logits.clone()
    moved[0, 0, reference.initiating_targets.topk_indices[0, :3]] -= (
        2.0  # one position's top entries pulled down
    )
    per_position = local_entropy_loss(
        moved[0, :-1][roles[0, 1:] == INI],
        reference.initiating_targets.topk_indices,
        "global_mean",
        target_gradient=False,
    )
    paper_doubled, _ = forget_terms(2 * moved, roles, reference)
    scaled_moved, _ = forget_terms(moved, roles, reference, local_loss_scale="reference")
    scaled_doubled, _ = forget_terms(2 * moved, roles, reference, local_loss_scale="reference")
    assert paper_doubled.item() == pytest.approx(4 * per_position.item())
    assert scaled_moved.item() != pytest.approx(1.0)
    doubled_reference = reference_targets(2 * logits, roles, top_k=7)
    rescaled, _ = forget_terms(2 * moved, roles, doubled_reference, local_loss_scale="reference")
    assert rescaled.item() == pytest.approx(scaled_moved.item())
    assert scaled_doubled.item() == pytest.approx(4 * scaled_moved.item())


def test_unknown_local_loss_scale_lists_the_choices():
    with pytest.raises(ValueError, match="^local_loss_scale='initial'; choose one of none, reference$"):
        PALUOptions.parse({"local_loss_scale": "initial"})


def test_term_gradient_norms_are_each_weighted_terms_own_gradient():
    """Each norm is that term's gradient alone (weights included), over all parameters together; the
    graph survives for the step's own backward; a constant term has norm 0."""
    torch.manual_seed(0)
    weight, bias = torch.randn(4, 3, requires_grad=True), torch.randn(4, requires_grad=True)
    x = torch.randn(5, 3)
    out = x @ weight.T + bias
    local_loss, kl_loss, retain_loss = out.pow(2).mean(), out.sum(), torch.zeros(())
    terms = weighted_terms(local_loss, kl_loss, retain_loss, 0.5, 2.0, 3.0).weighted
    norms = term_gradient_norms(terms, [weight, bias])
    for name, term in terms.items():
        if name == "retain":
            continue
        grads = torch.autograd.grad(term, [weight, bias], retain_graph=True)
        expected = torch.cat([g.flatten() for g in grads]).norm().item()
        assert norms[name] == pytest.approx(expected, rel=1e-6)
    assert norms["retain"] == 0.0
    kl_alone = torch.autograd.grad(kl_loss, [weight, bias], retain_graph=True)
    assert norms["kl"] == pytest.approx(1.5 * torch.cat([g.flatten() for g in kl_alone]).norm().item())
    weighted_terms(
        local_loss, kl_loss, retain_loss, 0.5, 2.0, 3.0
    ).loss.backward()  # the graph is still there
    assert weight.grad is not None


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


def test_kl_to_reference_matches_the_definition_in_both_value_and_gradient():
    logits, reference = torch.randn(5, 11, dtype=torch.float64, requires_grad=True), torch.randn(5, 11)
    ref_log_probs = F.log_softmax(reference.double(), -1)
    log_probs = F.log_softmax(logits, -1)
    expected = (log_probs.exp() * (log_probs - ref_log_probs)).sum(-1).mean()  # KL(P_theta || P_ref)
    kl = common_kl_to_reference_loss(logits, ref_log_probs)
    torch.testing.assert_close(kl, expected)
    (gradient,) = torch.autograd.grad(kl, logits)
    (expected_gradient,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(gradient, expected_gradient)
    assert common_kl_to_reference_loss(reference, F.log_softmax(reference, -1)).item() == pytest.approx(
        0, abs=1e-6
    )
    assert not torch.isclose(kl, common_kl_loss(logits, *reference_of(reference.double())))  # not symmetric


def test_kl_to_reference_is_exact_where_the_reference_probability_underflows():
    reference = torch.tensor([[0.0, -200.0, 1.0]])  # exp(-200) is 0 in fp32: log P_ref stays finite
    targets = reference_targets(
        reference[None].repeat(1, 2, 1), torch.tensor([[IGN, COM]]), 1, "policy_to_ref"
    )
    assert targets.neg_entropy is None and torch.isfinite(targets.common).all()
    logits = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    kl = common_kl_to_reference_loss(logits, targets.common)
    expected = sum(
        (1 / 3) * (math.log(1 / 3) - lr) for lr in F.log_softmax(reference.double(), -1)[0].tolist()
    )
    assert kl.item() == pytest.approx(expected, rel=1e-6) and math.isfinite(expected)
    kl.backward()
    assert torch.isfinite(logits.grad).all()


def test_empty_selections_give_exact_zero_in_fp32():
    empty = torch.zeros(0, 9, dtype=torch.bfloat16)
    local = local_entropy_loss(
        empty, torch.zeros(0, 3, dtype=torch.long), "global_mean", target_gradient=False
    )
    kl = common_kl_loss(empty, torch.zeros(0, 9), torch.zeros(0))
    kl_to_reference = common_kl_to_reference_loss(empty, torch.zeros(0, 9))
    assert local.item() == 0.0 and kl.item() == 0.0 and kl_to_reference.item() == 0.0
    assert local.dtype == kl.dtype == kl_to_reference.dtype == torch.float32


def test_bf16_logits_accumulate_in_fp32():
    logits = torch.randn(2, 16).to(torch.bfloat16)
    topk = torch.arange(16).repeat(2, 1)
    loss = local_entropy_loss(logits, topk, "global_mean", target_gradient=False)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, logits.float().var(-1, unbiased=False).mean())
    reference = F.log_softmax(torch.randn(2, 16), -1)
    kl = common_kl_to_reference_loss(logits, reference)
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl, common_kl_to_reference_loss(logits.float(), reference))


def test_logits_at_t_minus_1_predict_the_token_at_t():
    logits = torch.arange(2 * 3 * 4, dtype=torch.float).reshape(2, 3, 4)
    roles = torch.tensor([[IGN, INI, COM], [INI, COM, INI]])
    # tokens (0, 1) and (1, 2) are initiating, predicted at (0, 0) and (1, 1); token 0 has no predictor
    assert predicting_rows(roles, TokenRole.INITIATING).tolist() == [0, 4]
    assert predicting_rows(roles, TokenRole.COMMON).tolist() == [1, 3]
    initiating, common = at_forget_positions(logits, roles)
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
    local, kl = forget_terms(logits, roles, reference)
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
    local, kl = forget_terms(logits, roles, reference)
    (local + kl).backward()
    per_position = logits.grad[0].abs().sum(-1)
    # logits at t predict token t+1: positions 2, 3 predict redundant tokens; 6, 7 predict ignored/nothing
    assert per_position[[2, 3, 6, 7]].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert torch.all(per_position[[0, 1, 4, 5]] > 0)


def test_sample_without_span_gets_only_its_finite_kl():
    logits, reference_logits, roles = _batch([IGN, COM, COM, COM])
    reference = reference_targets(reference_logits, roles, top_k=3)
    local, kl = forget_terms(logits, roles, reference)
    total = local + 2.0 * kl
    assert local.item() == 0.0 and torch.isfinite(total)
    torch.testing.assert_close(total, 2.0 * kl)
    total.backward()
    assert torch.isfinite(logits.grad).all()


def test_reference_targets_take_the_reference_top_k():
    reference_logits = torch.tensor([[[0.0, 5.0, 1.0, 3.0], [9.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]])
    roles = torch.tensor([[IGN, INI, COM]])
    reference = reference_targets(reference_logits, roles, top_k=2)
    assert reference.initiating_targets.topk_indices.tolist() == [[1, 3]]
    assert reference.initiating_targets.logit_mean.tolist() == [2.25]
    probs, neg_entropy = reference_of(reference_logits[0, 1:2])
    torch.testing.assert_close(reference.common, probs)
    torch.testing.assert_close(reference.neg_entropy, neg_entropy)


def kl_and_gradient(loss_fn, logits):
    logits = logits.clone().requires_grad_(True)
    loss = loss_fn(logits)
    loss.backward()
    return loss.detach(), logits.grad


def kl_from(reference_logits, kl_direction, top_m=None):
    """The KL of logits (C, V) to the reference's targets in `kl_direction`, full or in the top-m form."""
    form = DenseReference if top_m is None else TopMReference
    initiating = initiating_targets(reference_logits[:0], 1)
    targets = form(initiating, kl_direction, **common_fields(reference_logits, kl_direction, top_m))
    return lambda logits: targets.kl(logits, slice(None))


@pytest.mark.parametrize("kl_direction", ["ref_to_policy", "policy_to_ref"])
def test_top_m_kl_with_every_entry_is_the_full_kl(kl_direction):
    torch.manual_seed(0)
    reference_logits, logits = 3 * torch.randn(6, 50), 3 * torch.randn(6, 50)
    exact = kl_and_gradient(kl_from(reference_logits, kl_direction), logits)
    top_m = kl_and_gradient(kl_from(reference_logits, kl_direction, top_m=50), logits)
    assert exact[0] > 1
    torch.testing.assert_close(top_m, exact, rtol=1e-5, atol=1e-7)


def tails(reference_logits, logits, top_m):
    """P_ref's and P_θ's entries outside the reference's top m (zero elsewhere) and their masses r, Q."""
    p, q = F.softmax(reference_logits, -1), F.softmax(logits, -1)
    tail = torch.ones_like(p, dtype=torch.bool).scatter(-1, p.topk(top_m, -1).indices, False)
    p_tail, q_tail = p.where(tail, 0), q.where(tail, 0)
    return p_tail, q_tail, p_tail.sum(-1, keepdim=True), q_tail.sum(-1, keepdim=True)


@pytest.mark.parametrize("kl_direction", ["ref_to_policy", "policy_to_ref"])
def test_top_m_kl_is_exact_at_the_reference(kl_direction):
    torch.manual_seed(0)
    reference_logits = 4 * torch.randn(8, 1000)  # peaked like a trained LM's
    kl, gradient = kl_and_gradient(kl_from(reference_logits, kl_direction, top_m=32), reference_logits)
    assert abs(float(kl)) < 1e-5 and gradient.abs().max() < 1e-7  # 0 up to fp32 rounding


@pytest.mark.parametrize("top_m", [None, 512])
@pytest.mark.parametrize("kl_direction", ["ref_to_policy", "policy_to_ref"])
def test_kl_at_the_reference_is_zero_on_a_real_vocabulary_with_large_logits(kl_direction, top_m):
    """|V| = 49152 and logits around 20, as SmolLM2's: Σ p is 1 only to ~1e-5 in fp32, and a KL that
    multiplied that error by logsumexp(z) (≈ 25) logged -1e-4 for the model against itself. The bound is
    a tenth of that: fp32 rounding alone measured 2.3e-6 on one CPU and below 2e-6 on another."""
    torch.manual_seed(0)
    reference_logits = 20 + 3 * torch.randn(16, 49152)
    kl, _ = kl_and_gradient(kl_from(reference_logits, kl_direction, top_m), reference_logits)
    assert abs(float(kl)) < 1e-5


def test_top_m_kl_from_the_reference_is_bounded_by_the_tail_after_a_move():
    """KL(P̃_ref ‖ P̃_θ) misses exactly r·KL(tail), ≥ 0, and each row's gradient differs by at most 2r in
    L1 (the tail's mass spread like the current model's)."""
    torch.manual_seed(0)
    reference_logits = 4 * torch.randn(8, 1000)
    moved = reference_logits + 0.5 * torch.randn(8, 1000)
    exact_kl, exact_gradient = kl_and_gradient(kl_from(reference_logits, "ref_to_policy"), moved)
    kl, gradient = kl_and_gradient(kl_from(reference_logits, "ref_to_policy", top_m=32), moved)
    p_tail, q_tail, r, current_tail = tails(reference_logits, moved, 32)
    missed = (  # r·KL(p_tail/r ‖ q_tail/Q) = Σ_tail p·log((p/r) / (q/Q))
        torch.special.xlogy(p_tail, p_tail / r) - torch.special.xlogy(p_tail, q_tail / current_tail)
    ).sum(-1)
    assert 0 < float(exact_kl - kl)
    # atol: fp32 rounding of the logsumexp-sized terms (~15 here) that cancel in each KL
    torch.testing.assert_close(exact_kl - kl, missed.mean(), rtol=1e-3, atol=3e-5)
    rows = len(moved)  # the loss is a mean over rows: each row's gradient carries 1/rows
    assert ((gradient - exact_gradient).abs().sum(-1) * rows <= 2 * r.squeeze(-1) + 1e-6).all()
    assert 0.01 < float(r.max()) < 0.2


def test_top_m_kl_to_the_reference_is_bounded_by_the_tail_after_a_move():
    """KL(P̃_θ ‖ P̃_ref) misses exactly Q·KL(q̂ ‖ p̂), q̂ and p̂ the tails normalised, ≥ 0; each row's
    gradient differs by at most Q·(KL(q̂ ‖ p̂) + E_q̂|log q̂/p̂|) in L1."""
    torch.manual_seed(0)
    reference_logits = 4 * torch.randn(8, 1000, dtype=torch.float64)
    moved = reference_logits + 0.5 * torch.randn(8, 1000, dtype=torch.float64)
    exact_kl, exact_gradient = kl_and_gradient(kl_from(reference_logits, "policy_to_ref"), moved)
    kl, gradient = kl_and_gradient(kl_from(reference_logits, "policy_to_ref", top_m=32), moved)
    p_tail, q_tail, r, current_tail = tails(reference_logits, moved, 32)
    log_ratio = (q_tail / current_tail).log() - (p_tail / r).log()  # inf/nan only off the tail
    tail_kl = torch.where(q_tail > 0, q_tail / current_tail * log_ratio, 0).sum(-1)
    tail_abs = torch.where(q_tail > 0, q_tail / current_tail * log_ratio.abs(), 0).sum(-1)
    missed = current_tail.squeeze(-1) * tail_kl
    assert float(missed.min()) > 0
    torch.testing.assert_close(exact_kl - kl, missed.mean(), rtol=1e-9, atol=1e-12)
    rows = len(moved)
    bound = current_tail.squeeze(-1) * (tail_kl + tail_abs)
    assert ((gradient - exact_gradient).abs().sum(-1) * rows <= bound + 1e-12).all()
    assert float(((gradient - exact_gradient).abs().sum(-1) * rows).max()) > 0.1 * float(bound.max())


@pytest.mark.parametrize(
    ("kl_direction", "top_m", "target_gradient", "chunk_rows"),
    [
        ("ref_to_policy", None, False, None),
        ("ref_to_policy", 8, False, 2),
        ("policy_to_ref", None, True, 1),
        ("policy_to_ref", 8, True, 3),
    ],
)
def test_projection_at_positions_gives_the_full_logits_losses_and_gradients(
    kl_direction, top_m, target_gradient, chunk_rows
):
    """Logits only where a loss reads them, `chunk_rows` at a time under checkpointing, against the
    full (B, T, V) logits: same terms and gradients."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16)
    project = torch.nn.Linear(16, 40)
    roles = torch.tensor([[IGN, IGN, COM, INI, INI, RED, COM], [IGN, INI, RED, COM, COM, IGN, IGN]])
    labels = torch.tensor([[-100, -100, 5, 6, 7, 8, 9], [-100, 1, 2, 3, 4, -100, -100]])
    reference = reference_targets(torch.randn(2, 7, 40), roles, 5, kl_direction, top_m)
    options = {"target_gradient": target_gradient, "kl_direction": kl_direction}
    objective = PALUOptions(**options).objective(5, chunk_rows)

    def losses_and_gradients(at_positions):
        project.zero_grad()
        leaf = hidden.clone().requires_grad_(True)
        if at_positions:
            terms = [*objective.forget_terms(leaf, project, roles, reference)]
            terms.append(objective.retain_nll(leaf, project, labels))
        else:
            logits = project(leaf)
            terms = [*forget_terms(logits, roles, reference, **options)]
            terms.append(F.cross_entropy(logits[:, :-1].reshape(-1, 40), labels[:, 1:].reshape(-1)))
        torch.stack(terms).sum().backward()
        return torch.stack(terms).detach(), leaf.grad, project.weight.grad.clone(), project.bias.grad.clone()

    at_positions, full = losses_and_gradients(True), losses_and_gradients(False)
    assert (at_positions[0] > 0.1).all()
    torch.testing.assert_close(at_positions, full, rtol=1e-5, atol=1e-7)
    hidden_gradient = at_positions[1]
    assert (
        hidden_gradient[1, 5:].abs().sum() == 0 == hidden_gradient[0, 6].abs().sum()
    )  # predict nothing read
    no_labels = torch.full_like(labels, -100)
    assert objective.retain_nll(hidden, project, no_labels).item() == 0.0


class CountingProjection(torch.nn.Linear):
    """A Linear that counts its calls, as ZeRO-3 counts the collectives of a partitioned module."""

    calls = 0

    def forward(self, hidden):
        self.calls += 1
        return super().forward(hidden)


ROLES = torch.tensor([[IGN, IGN, COM, INI, INI, RED, COM], [IGN, INI, RED, COM, COM, IGN, IGN]])
LABELS = torch.tensor([[-100, -100, 5, 6, 7, 8, 9], [-100, 1, 2, 3, 4, -100, -100]])


@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed", "kept"])
@pytest.mark.parametrize(
    "roles", [ROLES, torch.where(ROLES == INI, RED, ROLES)], ids=["spans", "no-initiating"]
)
def test_padding_chunks_make_exactly_the_projection_calls_asked_and_add_nothing(recompute, roles):
    """Under ZeRO-3 every rank must call the output projection as often as the others: the calls asked
    for, forward and backward alike, also with no initiating position, with the same terms and gradients."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16)
    project = CountingProjection(16, 40)
    reference = reference_targets(torch.randn(2, 7, 40), roles, 5, "ref_to_policy", 8)

    def run(initiating_calls, common_calls, retain_calls):
        project.zero_grad()
        project.calls = 0
        leaf = hidden.clone().requires_grad_(True)
        objective = PALUOptions().objective(5, 2)
        calls = ProjectionCalls(initiating_calls, common_calls, retain_calls, recompute)
        terms = [*objective.forget_terms(leaf, project, roles, reference, calls)]
        terms.append(objective.retain_nll(leaf, project, LABELS, calls))
        forward_calls = project.calls
        torch.stack(terms).sum().backward()
        return (
            torch.stack(terms).detach(),
            leaf.grad,
            project.weight.grad.clone(),
            forward_calls,
            project.calls,
        )

    needed = run(None, None, None)
    padded = run(5, 6, 7)
    assert padded[3] == 5 + 6 + 7
    assert padded[4] == 2 * padded[3] if recompute else padded[4] == padded[3]
    assert needed[3] < padded[3]
    torch.testing.assert_close(padded[:3], needed[:3], rtol=1e-6, atol=1e-8)
    assert (needed[0][1:] > 0.1).all()
    if not (roles == INI).any():
        assert needed[0][0] == 0.0
    with pytest.raises(ValueError, match="num_chunks=1: 4 rows need 2 chunks of 2"):
        mean_over_chunks(hidden[0, :4], project, lambda logits, rows: logits.sum(), 2, 1)


@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed", "kept"])
def test_a_frozen_projection_runs_backward_through_every_padding_chunk(recompute):
    """LoRA freezes the output projection: ZeRO-3 then gathers it for a chunk's backward only if the chunk's
    input needs a gradient, so a padding chunk's row must stay in the states' graph, or a rank with fewer
    real chunks skips collectives the others make (a collective mismatch at the next step)."""
    project = CountingProjection(16, 40).requires_grad_(False)
    backward_calls = []
    project.register_full_backward_hook(lambda *_: backward_calls.append(1))
    states = torch.randn(3, 16, requires_grad=True)
    loss = mean_over_chunks(states, project, lambda logits, rows: logits.square().mean(), 2, 4, recompute)
    loss.backward()
    assert len(backward_calls) == 4  # 2 chunks of rows, 2 padding chunks
    assert states.grad.abs().sum() > 0


@pytest.mark.parametrize("kl_direction", ["ref_to_policy", "policy_to_ref"])
def test_reference_model_chunk_by_chunk_gives_the_full_reference_losses_and_gradients(kl_direction):
    """The reference model's targets projected inside each chunk (no (C, V) P_ref held) against the
    targets from its full logits."""
    torch.manual_seed(0)
    hidden, reference_hidden = torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    project, reference_project = torch.nn.Linear(16, 40), CountingProjection(16, 40)
    with torch.no_grad():
        full_reference = reference_targets(reference_project(reference_hidden), ROLES, 5, kl_direction)
    from_model = ModelReference(
        *at_forget_positions(reference_hidden, ROLES), reference_project, 5, kl_direction
    )
    objective = PALUOptions(kl_direction=kl_direction).objective(5, 2)

    def losses_and_gradients(reference):
        project.zero_grad()
        leaf = hidden.clone().requires_grad_(True)
        terms = torch.stack(objective.forget_terms(leaf, project, ROLES, reference))
        terms.sum().backward()
        return terms.detach(), leaf.grad, project.weight.grad.clone()

    reference_project.calls = 0
    chunked = losses_and_gradients(from_model)
    assert reference_project.calls == 2 * (2 + 2)  # 3 initiating, 4 common rows in chunks of 2, recomputed
    assert reference_project.weight.grad is None
    full = losses_and_gradients(full_reference)
    assert (full[0] > 0).all()
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kl_direction", ["ref_to_policy", "policy_to_ref"])
def test_reference_targets_in_chunks_equal_the_full_logits_targets(kl_direction):
    torch.manual_seed(0)
    hidden, project = torch.randn(2, 7, 16), torch.nn.Linear(16, 40)
    chunked = reference_targets(hidden, ROLES, 5, kl_direction, 8, project, chunk_rows=1)
    with torch.no_grad():
        full = reference_targets(project(hidden), ROLES, 5, kl_direction, 8)
    fields = {**vars(full.initiating_targets), **vars(full)}
    chunked_fields = {**vars(chunked.initiating_targets), **vars(chunked)}
    for name, value in fields.items():
        if value is None or isinstance(value, str):
            assert chunked_fields[name] == value, name
        elif torch.is_tensor(value):
            torch.testing.assert_close(chunked_fields[name], value, msg=name)
    none = reference_targets(hidden, torch.full_like(ROLES, IGN), 5, kl_direction, 8, project, 2)
    assert none.initiating_targets.topk_indices.shape == (0, 5) and none.indices.shape == (0, 8)
