"""PALU's forget loss as pure functions: local entropy on initiating tokens, KL on common ones.

Shapes: B batch, T sequence length, V vocabulary, M initiating positions, C common positions,
K reference top-K. Every reduction runs in fp32; an empty selection gives exactly 0.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from palu_trainer.method.roles import TokenRole

TARGETS = ("global_mean", "topk_mean", "ref_mean", "uniform")

logger = logging.getLogger(__name__)


@dataclass
class ReferenceTargets:
    """What PALU reads from the frozen reference model for one batch; fixed for the whole run.

    topk_indices: (M, K) int64, the reference's top-K vocabulary entries at each initiating position.
    logit_mean: (M,) fp32, the reference's mean logit there (the `ref_mean` target).
    common_probs: (C, V) the reference's probabilities P_ref at each common position; with
        `common_indices`, (C, m): P_ref of those m entries only (the reference cache's top-m form).
    common_neg_entropy: (C,) fp32, Σ P_ref·log P_ref there: the constant part of the KL (top-m form:
        of the m entries and the tail bucket).
    common_indices: (C, m) int64 or None: the vocabulary entries that `common_probs` holds.
    common_tail_mass: (C,) fp32 or None: P_ref's mass outside `common_indices` (the tail bucket).
    """

    topk_indices: torch.Tensor
    logit_mean: torch.Tensor
    common_probs: torch.Tensor
    common_neg_entropy: torch.Tensor
    common_indices: torch.Tensor | None = None
    common_tail_mass: torch.Tensor | None = None


def predicting_rows(roles: torch.Tensor, role: TokenRole) -> torch.Tensor:
    """Rows of `logits.view(B * T, V)` that predict the tokens with `role`: token t is predicted at t-1.

    Args:
        roles: (B, T) TokenRole of each input token.

    Returns:
        (N,) int64 flat positions, in row-major order of the predicted tokens.
    """
    length = roles.shape[1]
    predicted = torch.nonzero(roles[:, 1:] == role)
    return predicted[:, 0] * length + predicted[:, 1]


def forget_rows(roles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (B·T) positions that predict initiating (M,) and common (C,) tokens: the only rows a forget
    loss reads; prompt, padding and redundant positions are never projected to the vocabulary."""
    return predicting_rows(roles, TokenRole.INITIATING), predicting_rows(roles, TokenRole.COMMON)


def project_at_positions(hidden: torch.Tensor, project: Callable, rows: torch.Tensor) -> torch.Tensor:
    """Logits at some positions only: `project` (the model's output projection) on their hidden states.

    Args:
        hidden: (B, T, d) final hidden states (after the last norm). project: (N, d) -> (N, V).
        rows: (N,) flat positions into `hidden.view(B * T, d)`.

    Returns:
        (N, V) logits in fp32, equal to the full (B, T, V) logits' rows `rows`: one projection of N rows
        instead of B·T, and one (N, V) gradient in the backward pass.
    """
    return project(hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)).float()


def select_predictions(logits: torch.Tensor, roles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits that predict initiating tokens (M, V) and common tokens (C, V).

    One index_select over the flattened logits, so that the backward pass writes one (B·T, V)
    gradient rather than one per slice and per mask.

    Args:
        logits: (B, T, V), unshifted. roles: (B, T) TokenRole of each input token.
    """
    initiating, common = forget_rows(roles)
    selected = logits.reshape(-1, logits.shape[-1]).index_select(0, torch.cat([initiating, common]))
    return selected[: len(initiating)], selected[len(initiating) :]


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"unknown local-loss target c={target!r}; choose one of {', '.join(TARGETS)}")
    return target


def resolve_top_k(top_k: int, vocab_size: int) -> int:
    """K as used: `top_k` capped at |V|, with a warning when capped."""
    if top_k > vocab_size:
        logger.warning("top_k=%d exceeds the vocabulary; using K=|V|=%d", top_k, vocab_size)
    return min(top_k, vocab_size)


def reference_targets(reference_logits: torch.Tensor, roles: torch.Tensor, top_k: int) -> ReferenceTargets:
    """Extract the reference's top-K indices, mean logit and common probabilities.

    Args:
        reference_logits: (B, T, V) reference logits, unshifted.
        roles: (B, T) TokenRole of each input token.
        top_k: K, at most V (see `resolve_top_k`).
    """
    return targets_from_selected(*select_predictions(reference_logits, roles), top_k)


def targets_from_selected(
    initiating: torch.Tensor, common: torch.Tensor, top_k: int, top_m: int | None = None
) -> ReferenceTargets:
    """The reference's targets from its logits at the initiating (M, V) and common (C, V) positions.

    top_m: None keeps P_ref over all V at common positions; m keeps its m most probable entries and
    the rest as one tail bucket (the reference cache's form, see `common_kl_loss_top_m`).
    """
    with torch.no_grad():
        initiating, common = initiating.float(), common.float()
        common_probs = F.softmax(common, dim=-1)
        targets = ReferenceTargets(
            topk_indices=initiating.topk(top_k, dim=-1).indices,
            logit_mean=initiating.mean(dim=-1),
            common_probs=common_probs,
            common_neg_entropy=torch.special.xlogy(common_probs, common_probs).sum(dim=-1),
        )
        if top_m is None:
            return targets
        top = common_probs.topk(min(top_m, common_probs.shape[-1]), dim=-1)
        tail_mass = common_probs.scatter(-1, top.indices, 0.0).sum(dim=-1)  # no 1 − Σ cancellation
        targets.common_probs, targets.common_indices, targets.common_tail_mass = (
            top.values,
            top.indices,
            tail_mass,
        )
        targets.common_neg_entropy = torch.special.xlogy(top.values, top.values).sum(dim=-1) + (
            torch.special.xlogy(tail_mass, tail_mass)
        )
        return targets


def local_entropy_loss(
    logits: torch.Tensor,
    topk_indices: torch.Tensor,
    target: str = "global_mean",
    reference_logit_mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over initiating positions of (1/K)·Σ_{i∈top-K}(z_i − c)².

    Args:
        logits: (M, V) current-model logits at the initiating positions.
        topk_indices: (M, K) the reference top-K at those positions.
        target: c: `global_mean` (mean of the current logits over V), `topk_mean` (their mean over
            the top-K), `ref_mean` (the reference's mean logit), `uniform` (0: all top-K logits
            equal, so the distribution over them is uniform). c is a target: no gradient flows
            through it, so only the K reference entries of each row receive gradient.
        reference_logit_mean: (M,) required for `ref_mean`.

    Returns:
        Scalar fp32; exactly 0 when M == 0.
    """
    check_target(target)
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    logits = logits.float()
    selected = logits.gather(-1, topk_indices)
    if target == "global_mean":
        center = logits.mean(dim=-1)
    elif target == "topk_mean":
        center = selected.mean(dim=-1)
    elif target == "ref_mean":
        if reference_logit_mean is None:
            raise ValueError("target 'ref_mean' needs reference_logit_mean")
        center = reference_logit_mean.float()
    else:
        center = torch.zeros_like(selected[:, 0])
    return (selected - center.detach().unsqueeze(-1)).pow(2).mean(dim=-1).mean()


class _KLFromReference(torch.autograd.Function):
    """Per-row KL(P_ref ‖ softmax(z)) = Σ p·log p − p·z + logsumexp(z).

    One exponential pass over (C, V): the forward keeps softmax(z), and the gradient (softmax(z) − p)
    is formed in place, so no log-softmax or KL-elementwise tensor of size (C, V) is materialised. The
    backward consumes its saved softmax: it runs once per forward, as in training.
    """

    @staticmethod
    def forward(ctx, logits, probs, neg_entropy):
        row_max = logits.amax(dim=-1, keepdim=True)
        softmax = (logits - row_max).exp_()
        normalizer = softmax.sum(dim=-1, keepdim=True)
        softmax.div_(normalizer)
        log_normalizer = (row_max + normalizer.log()).squeeze(-1)
        cross = torch.bmm(probs.unsqueeze(1), logits.unsqueeze(2)).view(-1)
        ctx.save_for_backward(softmax, probs)
        return neg_entropy - cross + log_normalizer

    @staticmethod
    def backward(ctx, grad_rows):
        softmax, probs = ctx.saved_tensors
        return softmax.sub_(probs).mul_(grad_rows.unsqueeze(-1)), None, None


def common_kl_loss(
    logits: torch.Tensor, reference_probs: torch.Tensor, reference_neg_entropy: torch.Tensor
) -> torch.Tensor:
    """Mean over common positions of KL(P_ref ‖ P_θ).

    Args:
        logits: (C, V) current-model logits at the common positions.
        reference_probs: (C, V) P_ref there (any float dtype; used in fp32).
        reference_neg_entropy: (C,) Σ P_ref·log P_ref there.

    Returns:
        Scalar fp32; exactly 0 when C == 0.
    """
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    per_row = _KLFromReference.apply(logits.float(), reference_probs.float(), reference_neg_entropy.float())
    return per_row.mean()


class _KLFromTopM(torch.autograd.Function):
    """Per-row KL(P̃_ref ‖ P̃_θ) over the m cached entries plus one tail bucket (all other entries).

    With p the cached top-m of P_ref, r its tail mass, q = softmax(z) and Q the current tail mass:
    KL = Σ_top p·log p + r·log r − Σ_top p·z_i + logsumexp(z) − r·log(Σ_tail e^z).
    Gradient: q_i − p_i on the m entries (exact), q_j·(1 − r/Q) on the tail, where the exact one is
    q_j − p_j: the tail's reference mass is spread like the current model's. At the first step
    (P_θ = P_ref) both are exact; later the error is bounded by the tail: |ΔKL| = r·KL(tail) and
    ‖Δgrad‖₁ ≤ 2r per position.
    """

    @staticmethod
    def forward(ctx, logits, indices, probs, tail_mass, neg_entropy):
        row_max = logits.amax(dim=-1, keepdim=True)
        softmax = (logits - row_max).exp_()
        normalizer = softmax.sum(dim=-1, keepdim=True)
        softmax.div_(normalizer)
        log_normalizer = (row_max + normalizer.log()).squeeze(-1)
        top_softmax = softmax.gather(-1, indices)
        current_tail = (1 - top_softmax.sum(dim=-1)).clamp_min(torch.finfo(torch.float32).tiny)
        cross = (probs * logits.gather(-1, indices)).sum(dim=-1)
        tail_cross = torch.special.xlogy(tail_mass, current_tail) + tail_mass * log_normalizer
        ctx.save_for_backward(softmax, indices, probs, top_softmax, tail_mass / current_tail)
        return neg_entropy - cross + log_normalizer - tail_cross

    @staticmethod
    def backward(ctx, grad_rows):
        softmax, indices, probs, top_softmax, tail_ratio = ctx.saved_tensors
        gradient = softmax.mul_((1 - tail_ratio).unsqueeze(-1)).scatter_(-1, indices, top_softmax - probs)
        return gradient.mul_(grad_rows.unsqueeze(-1)), None, None, None, None


def common_kl_loss_top_m(
    logits: torch.Tensor,
    indices: torch.Tensor,
    probs: torch.Tensor,
    tail_mass: torch.Tensor,
    neg_entropy: torch.Tensor,
) -> torch.Tensor:
    """Mean over common positions of the KL with P_ref kept as its top-m entries and a tail bucket.

    Args:
        logits: (C, V) current-model logits at the common positions.
        indices: (C, m) int64 the reference's m most probable entries; probs: (C, m) their P_ref.
        tail_mass: (C,) P_ref's mass outside them. neg_entropy: (C,) Σ_top p·log p + r·log r.

    Returns:
        Scalar fp32; exactly 0 when C == 0. Equals `common_kl_loss` when m = V (see `_KLFromTopM`).
    """
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    per_row = _KLFromTopM.apply(
        logits.float(), indices.long(), probs.float(), tail_mass.float(), neg_entropy.float()
    )
    return per_row.mean()


def reference_kl_loss(logits: torch.Tensor, reference: ReferenceTargets) -> torch.Tensor:
    """The KL term on the common positions' logits (C, V), for either form of `reference`."""
    if reference.common_indices is None:
        return common_kl_loss(logits, reference.common_probs, reference.common_neg_entropy)
    return common_kl_loss_top_m(
        logits,
        reference.common_indices,
        reference.common_probs,
        reference.common_tail_mass,
        reference.common_neg_entropy,
    )


def palu_forget_loss_at_positions(
    hidden: torch.Tensor,
    project: Callable,
    roles: torch.Tensor,
    reference: ReferenceTargets,
    target: str = "global_mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`palu_forget_loss` from final hidden states (B, T, d): the output projection `project` runs
    only at the initiating and common positions (see `project_at_positions`). Same values and
    gradients as projecting every position."""
    initiating, common = forget_rows(roles)
    selected = project_at_positions(hidden, project, torch.cat([initiating, common]))
    local = local_entropy_loss(
        selected[: len(initiating)],
        reference.topk_indices,
        target=target,
        reference_logit_mean=reference.logit_mean,
    )
    return local, reference_kl_loss(selected[len(initiating) :], reference)


def palu_forget_loss(
    logits: torch.Tensor,
    roles: torch.Tensor,
    reference: ReferenceTargets,
    target: str = "global_mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local entropy and KL terms of one forget batch; redundant tokens contribute nothing.

    Args:
        logits: (B, T, V) current logits, unshifted: position t-1 predicts token t.
        roles: (B, T) TokenRole of each input token.
        reference: the reference's targets for this batch (see `reference_targets`).
        target: c of the local loss.

    Returns:
        (local_loss, kl_loss), both fp32 scalars.
    """
    initiating, common = select_predictions(logits, roles)
    local = local_entropy_loss(
        initiating, reference.topk_indices, target=target, reference_logit_mean=reference.logit_mean
    )
    return local, reference_kl_loss(common, reference)


def label_nll_at_positions(hidden: torch.Tensor, project: Callable, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over label positions, projecting only the positions that predict a label.

    Args:
        hidden: (B, T, d) final hidden states. project: (N, d) -> (N, V). labels: (B, T), -100 where
            not a label (prompt, padding), unshifted.

    Returns:
        Scalar fp32, the causal-LM loss of `model(labels=...)`; exactly 0 when no label.
    """
    predicted = labels[:, 1:]
    rows = torch.nonzero(predicted != -100)
    if rows.shape[0] == 0:
        return hidden.new_zeros((), dtype=torch.float32)
    logits = project_at_positions(hidden, project, rows[:, 0] * labels.shape[1] + rows[:, 1])
    return F.cross_entropy(logits, predicted[rows[:, 0], rows[:, 1]])
