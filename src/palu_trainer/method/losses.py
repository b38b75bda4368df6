"""PALU's forget loss as pure functions: local entropy on initiating tokens, KL on common ones.

Shapes: B batch, T sequence length, V vocabulary, M initiating positions, C common positions,
K reference top-K. Every reduction runs in fp32; an empty selection gives exactly 0.
"""

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from palu_trainer.method.roles import TokenRole

TARGETS = ("global_mean", "topk_mean", "ref_mean", "uniform", "zero")
KL_DIRECTIONS = ("ref_to_policy", "policy_to_ref")

logger = logging.getLogger(__name__)


@dataclass
class ReferenceTargets:
    """What PALU reads from the frozen reference model for one batch; fixed for the whole run.

    topk_indices: (M, K) int64, the reference's top-K vocabulary entries at each initiating position.
    logit_mean: (M,) fp32, the reference's mean logit there (the `ref_mean` target).
    common_probs: (C, V) the reference's probabilities P_ref at each common position; for KL(P_ref ‖ P_θ).
    common_neg_entropy: (C,) fp32, Σ P_ref·log P_ref there: the constant part of KL(P_ref ‖ P_θ).
    common_log_probs: (C, V) log P_ref there, exact where P_ref underflows; for KL(P_θ ‖ P_ref).
    Each KL direction needs only its own fields; the others are None.
    """

    topk_indices: torch.Tensor
    logit_mean: torch.Tensor
    common_probs: torch.Tensor | None = None
    common_neg_entropy: torch.Tensor | None = None
    common_log_probs: torch.Tensor | None = None


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


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 for half-precision inputs; float64 stays float64."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"unknown local-loss target c={target!r}; choose one of {', '.join(TARGETS)}")
    return target


def check_kl_direction(kl_direction: str) -> str:
    if kl_direction not in KL_DIRECTIONS:
        raise ValueError(f"kl_direction={kl_direction!r}; choose one of {', '.join(KL_DIRECTIONS)}")
    return kl_direction


def check_kl_weight(kl_weight):
    """λ: a number >= 0, or `alpha` (the released code: the KL is weighted by alpha, outside gamma)."""
    if kl_weight == "alpha":
        return kl_weight
    if isinstance(kl_weight, bool) or not isinstance(kl_weight, int | float) or not kl_weight >= 0:
        raise ValueError(
            f"kl_weight={kl_weight!r}: must be a number >= 0 (λ, the weight of the KL on common tokens) "
            "or `alpha` (the released code's tie of the KL weight to the retain weight)"
        )
    return kl_weight


def resolve_top_k(top_k, vocab_size: int) -> int:
    """K as used, from `top_k`: a positive integer (capped at |V|), `all` (|V|) or a float share of |V|.

    A share p in (0, 1] gives K = round(p·|V|) (at least 1): 0.15625 is the paper's K=5000 on Llama-2's
    32000 tokens. The resolved K is logged; K = |V| warns that the local loss then flattens the whole
    vocabulary (a PDU-like objective), not a top-K.
    """
    if top_k == "all":
        k = vocab_size
    elif isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1:
        k = min(top_k, vocab_size)
    elif isinstance(top_k, float) and 0 < top_k <= 1:
        k = max(1, round(top_k * vocab_size))
    else:
        raise ValueError(
            f"top_k={top_k!r}: give a positive integer K, `all`, or a share of the vocabulary in (0, 1] "
            f"(e.g. 0.15625, the paper's K=5000 of Llama-2's 32000)"
        )
    logger.info(
        "top_k=%s: K=%d of |V|=%d (%.2f%% of the vocabulary)", top_k, k, vocab_size, 100 * k / vocab_size
    )
    if k == vocab_size:
        capped = "exceeds the vocabulary: capped at" if isinstance(top_k, int) and top_k > k else "gives"
        logger.warning(
            "top_k=%s %s K=|V|=%d: the local loss flattens the whole vocabulary (a PDU-like objective), "
            "not the paper's top-K; for the paper's share of Llama-2's vocabulary use top_k=0.15625",
            top_k,
            capped,
            vocab_size,
        )
    return k


def reference_targets(
    reference_logits: torch.Tensor, roles: torch.Tensor, top_k: int, kl_direction: str = "ref_to_policy"
) -> ReferenceTargets:
    """Extract the reference's top-K indices, mean logit and what the KL direction needs on common tokens.

    Args:
        reference_logits: (B, T, V) reference logits, unshifted.
        roles: (B, T) TokenRole of each input token.
        top_k: K, at most V (see `resolve_top_k`).
        kl_direction: `ref_to_policy` keeps P_ref and its negative entropy, `policy_to_ref` log P_ref.
    """
    check_kl_direction(kl_direction)
    with torch.no_grad():
        initiating, common = (at_least_fp32(s) for s in select_predictions(reference_logits, roles))
        targets = ReferenceTargets(
            topk_indices=initiating.topk(top_k, dim=-1).indices, logit_mean=initiating.mean(dim=-1)
        )
        if kl_direction == "policy_to_ref":
            targets.common_log_probs = F.log_softmax(common, dim=-1)
        else:
            targets.common_probs = F.softmax(common, dim=-1)
            targets.common_neg_entropy = torch.special.xlogy(targets.common_probs, targets.common_probs).sum(
                -1
            )
        return targets


def local_entropy_loss(
    logits: torch.Tensor,
    topk_indices: torch.Tensor,
    target: str = "global_mean",
    reference_logit_mean: torch.Tensor | None = None,
    target_gradient: bool = False,
) -> torch.Tensor:
    """Mean over initiating positions of (1/K)·Σ_{i∈top-K}(z_i − c)².

    Args:
        logits: (M, V) current-model logits at the initiating positions.
        topk_indices: (M, K) the reference top-K at those positions.
        target: c: `global_mean` (mean of the current logits over V, the paper's), `topk_mean` (their
            mean over the top-K), `ref_mean` (the reference's mean logit), `uniform` (logsumexp(z) −
            log|V|: the logit at which a token has probability 1/|V|, so the top-K are pulled to the
            uniform distribution's probability, the paper's maximum-entropy target), `zero` (c = 0, an
            arbitrary level since logits are shift-invariant).
        reference_logit_mean: (M,) required for `ref_mean`.
        target_gradient: False (the paper): c is a fixed target, so only the K reference entries of each
            row receive gradient. True (the released code): the gradient also flows through c into every
            logit it is computed from.

    Returns:
        Scalar fp32 (float64 for float64 logits); exactly 0 when M == 0.
    """
    check_target(target)
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    logits = at_least_fp32(logits)
    selected = logits.gather(-1, topk_indices)
    if target == "global_mean":
        center = logits.mean(dim=-1)
    elif target == "topk_mean":
        center = selected.mean(dim=-1)
    elif target == "ref_mean":
        if reference_logit_mean is None:
            raise ValueError("target 'ref_mean' needs reference_logit_mean")
        center = reference_logit_mean.to(logits.dtype)
    elif target == "uniform":
        center = logits.logsumexp(dim=-1) - math.log(logits.shape[-1])
    else:
        center = torch.zeros_like(selected[:, 0])
    if not target_gradient:
        center = center.detach()
    return (selected - center.unsqueeze(-1)).pow(2).mean(dim=-1).mean()


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
    logits = at_least_fp32(logits)
    per_row = _KLFromReference.apply(
        logits, reference_probs.to(logits.dtype), reference_neg_entropy.to(logits.dtype)
    )
    return per_row.mean()


class _KLToReference(torch.autograd.Function):
    """Per-row KL(softmax(z) ‖ P_ref) = Σ p·(log p − log P_ref), p = softmax(z).

    The forward keeps two (C, V) tensors, p and log p − log P_ref; the backward forms the gradient
    p·((log p − log P_ref) − KL) in place in the second.
    """

    @staticmethod
    def forward(ctx, logits, reference_log_probs):
        log_ratio = logits - logits.logsumexp(dim=-1, keepdim=True)
        softmax = log_ratio.exp()
        log_ratio.sub_(reference_log_probs)
        per_row = torch.bmm(softmax.unsqueeze(1), log_ratio.unsqueeze(2)).view(-1)
        ctx.save_for_backward(softmax, log_ratio, per_row)
        return per_row

    @staticmethod
    def backward(ctx, grad_rows):
        softmax, log_ratio, per_row = ctx.saved_tensors
        return log_ratio.sub_(per_row.unsqueeze(-1)).mul_(softmax).mul_(grad_rows.unsqueeze(-1)), None


def common_kl_to_reference_loss(logits: torch.Tensor, reference_log_probs: torch.Tensor) -> torch.Tensor:
    """Mean over common positions of KL(P_θ ‖ P_ref), the released code's direction.

    Args:
        logits: (C, V) current-model logits at the common positions.
        reference_log_probs: (C, V) log P_ref there (any float dtype; used in fp32 or wider).

    Returns:
        Scalar fp32 (float64 for float64 logits); exactly 0 when C == 0.
    """
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    logits = at_least_fp32(logits)
    return _KLToReference.apply(logits, reference_log_probs.to(logits.dtype)).mean()


def palu_forget_loss(
    logits: torch.Tensor,
    roles: torch.Tensor,
    reference: ReferenceTargets,
    target: str = "global_mean",
    target_gradient: bool = False,
    kl_direction: str = "ref_to_policy",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local entropy and KL terms of one forget batch; redundant tokens contribute nothing.

    Args:
        logits: (B, T, V) current logits, unshifted: position t-1 predicts token t.
        roles: (B, T) TokenRole of each input token.
        reference: the reference's targets for this batch (see `reference_targets`, same `kl_direction`).
        target, target_gradient: c of the local loss and whether gradient flows through it.
        kl_direction: `ref_to_policy` KL(P_ref ‖ P_θ) (the paper) or `policy_to_ref` KL(P_θ ‖ P_ref)
            (the released code).

    Returns:
        (local_loss, kl_loss), both fp32 scalars (float64 for float64 logits).
    """
    initiating, common = select_predictions(logits, roles)
    local = local_entropy_loss(
        initiating,
        reference.topk_indices,
        target=target,
        reference_logit_mean=reference.logit_mean,
        target_gradient=target_gradient,
    )
    if check_kl_direction(kl_direction) == "policy_to_ref":
        return local, common_kl_to_reference_loss(common, reference.common_log_probs)
    return local, common_kl_loss(common, reference.common_probs, reference.common_neg_entropy)


def palu_loss(
    local_loss: torch.Tensor,
    kl_loss: torch.Tensor,
    retain_loss: torch.Tensor,
    gamma: float = 1.0,
    alpha: float = 1.0,
    kl_weight: float | str = 1.0,
) -> torch.Tensor:
    """The training loss from PALU's three scalar terms.

    kl_weight λ a number: gamma·(local + λ·KL) + alpha·retain (the paper).
    kl_weight `alpha`: gamma·local + alpha·KL + alpha·retain (the released code: one alpha for both).
    """
    if check_kl_weight(kl_weight) == "alpha":
        return gamma * local_loss + alpha * kl_loss + alpha * retain_loss
    return gamma * (local_loss + kl_weight * kl_loss) + alpha * retain_loss
