"""PALU's forget loss as pure functions: local entropy on initiating tokens, KL on common ones.

Shapes: B batch, T sequence length, V vocabulary, M initiating positions, C common positions,
K reference top-K. Every reduction runs in fp32; an empty selection gives exactly 0.
"""

import logging
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
    common_probs: (C, V) the reference's probabilities P_ref at each common position.
    common_neg_entropy: (C,) fp32, Σ P_ref·log P_ref there: the constant part of the KL.
    """

    topk_indices: torch.Tensor
    logit_mean: torch.Tensor
    common_probs: torch.Tensor
    common_neg_entropy: torch.Tensor


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


def select_predictions(logits: torch.Tensor, roles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits that predict initiating tokens (M, V) and common tokens (C, V).

    One index_select over the flattened logits, so that the backward pass writes one (B·T, V)
    gradient rather than one per slice and per mask.

    Args:
        logits: (B, T, V), unshifted. roles: (B, T) TokenRole of each input token.
    """
    initiating = predicting_rows(roles, TokenRole.INITIATING)
    common = predicting_rows(roles, TokenRole.COMMON)
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
    with torch.no_grad():
        initiating, common = (selected.float() for selected in select_predictions(reference_logits, roles))
        common_probs = F.softmax(common, dim=-1)
        return ReferenceTargets(
            topk_indices=initiating.topk(top_k, dim=-1).indices,
            logit_mean=initiating.mean(dim=-1),
            common_probs=common_probs,
            common_neg_entropy=torch.special.xlogy(common_probs, common_probs).sum(dim=-1),
        )


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
    return local, common_kl_loss(common, reference.common_probs, reference.common_neg_entropy)
