"""PALU's forget loss as pure functions: local entropy on initiating tokens, KL on common ones.

Shapes: B batch, T sequence length, V vocabulary, M initiating positions, C common positions,
K reference top-K. Every reduction runs in fp32; an empty selection gives exactly 0.
"""

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from palu_trainer.method.roles import TokenRole

TARGETS = ("global_mean", "topk_mean", "ref_mean", "uniform", "zero")
KL_DIRECTIONS = ("ref_to_policy", "policy_to_ref")
# `none`: the paper's local loss; `reference`: each initiating position's loss divided by the reference's own
# (its `topk_spread`), so the term starts near 1 whatever the model's logit scale (issue 30's utility cliff).
LOCAL_LOSS_SCALES = ("none", "reference")
# Logits held at once by the losses that project hidden states themselves (`*_at_positions`): 2**22 fp32
# numbers (16 MiB, 32 positions at |V| = 128256); a step never holds (positions x |V|) logits.
LOGIT_CHUNK_ELEMENTS = 2**22

logger = logging.getLogger(__name__)


@dataclass
class ReferenceTargets:
    """What PALU reads from the frozen reference model for one batch; fixed for the whole run.

    topk_indices: (M, K) int64, the reference's top-K vocabulary entries at each initiating position.
    logit_mean: (M,) fp32, the reference's mean logit there (the `ref_mean` target).
    topk_spread: (M,) fp32, the reference's own local loss there, (1/K)·Σ_{top-K}(z_ref − mean z_ref)²: the
        divisor of `local_loss_scale=reference`.
    common_probs: (C, V) the reference's probabilities P_ref at each common position; for KL(P_ref ‖ P_θ).
    common_neg_entropy: (C,) fp32, Σ P_ref·log P_ref there: the constant part of KL(P_ref ‖ P_θ).
    common_log_probs: (C, V) log P_ref there, exact where P_ref underflows; for KL(P_θ ‖ P_ref).
    Each KL direction needs only its own fields; the others are None.

    Top-m form (the reference cache's; `common_indices` set): P_ref is coarsened to its m most probable
    entries and one tail bucket holding the rest of its mass r, and the KL is taken between the coarsened
    distributions (see `_KLFromTopM`, `_KLToTopM`). Then `common_probs` / `common_log_probs` are (C, m), of
    the entries `common_indices` (C, m) int64; `common_neg_entropy` includes r·log r; `common_tail_mass`
    (C,) is r (ref_to_policy) and `common_log_tail_mass` (C,) log r (policy_to_ref).
    """

    topk_indices: torch.Tensor
    logit_mean: torch.Tensor
    topk_spread: torch.Tensor | None = None
    common_probs: torch.Tensor | None = None
    common_neg_entropy: torch.Tensor | None = None
    common_log_probs: torch.Tensor | None = None
    common_indices: torch.Tensor | None = None
    common_tail_mass: torch.Tensor | None = None
    common_log_tail_mass: torch.Tensor | None = None

    def initiating_rows(self, rows: slice) -> "ReferenceTargets":
        """The same targets with only the initiating positions `rows` (common fields unchanged)."""
        spread = None if self.topk_spread is None else self.topk_spread[rows]
        return dataclasses.replace(
            self, topk_indices=self.topk_indices[rows], logit_mean=self.logit_mean[rows], topk_spread=spread
        )

    def common_rows(self, rows: slice) -> "ReferenceTargets":
        """The same targets with only the common positions `rows` (initiating fields unchanged)."""
        sliced = {
            field.name: getattr(self, field.name)[rows]
            for field in dataclasses.fields(self)
            if field.name.startswith("common_") and getattr(self, field.name) is not None
        }
        return dataclasses.replace(self, **sliced)


@dataclass
class ReferenceFromModel:
    """The reference's targets computed from its final hidden states, a chunk of positions at a time, so
    that no (C, V) P_ref is ever held: the reference-model path's counterpart of `ReferenceTargets`, with
    the same `initiating_rows` / `common_rows` (each projects only those rows, without gradient).

    initiating_hidden: (M, d) and common_hidden: (C, d) the reference's final hidden states at the
    positions that predict initiating and common tokens. project: (n, d) -> (n, V), the reference's output
    projection. top_k: K. kl_direction: what the common rows keep (see `ReferenceTargets`).
    """

    initiating_hidden: torch.Tensor
    common_hidden: torch.Tensor
    project: Callable
    top_k: int
    kl_direction: str = "ref_to_policy"

    def initiating_rows(self, rows: slice) -> ReferenceTargets:
        with torch.no_grad():
            logits = at_least_fp32(self.project(self.initiating_hidden[rows]))
            return ReferenceTargets(**initiating_targets(logits, self.top_k))

    def common_rows(self, rows: slice) -> ReferenceTargets:
        with torch.no_grad():
            logits = at_least_fp32(self.project(self.common_hidden[rows]))
            empty = logits.new_zeros((0,), dtype=torch.long)
            return ReferenceTargets(empty, empty, **common_targets(logits, self.kl_direction))


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


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 for half-precision inputs; float64 stays float64."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def check_choice(name: str, value, choices: tuple):
    """`value` of option `name`, one of `choices` (true/false written as YAML booleans)."""
    if not any(type(value) is type(choice) and value == choice for choice in choices):  # 1 is not true
        written = ", ".join(
            str(choice).lower() if isinstance(choice, bool) else str(choice) for choice in choices
        )
        raise ValueError(f"{name}={value!r}; choose one of {written}")
    return value


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"unknown local-loss target c={target!r}; choose one of {', '.join(TARGETS)}")
    return target


def check_local_loss_scale(local_loss_scale: str) -> str:
    return check_choice("local_loss_scale", local_loss_scale, LOCAL_LOSS_SCALES)


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


def check_number(name: str, value, meaning: str, minimum: float = 0.0, exclusive: bool = False):
    """`value` of option `name` as a number >= `minimum` (> with `exclusive`); text, bools and nan refused.

    The message names the option, what it weighs (`meaning`) and the allowed range: a negative loss
    weight turns descent into ascent (gamma=-1 ascends the forget terms, alpha=-1 the retain loss), and a
    string ("abc") would otherwise fail only at the first step, after the reference cache is built.
    """
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not (value > minimum if exclusive else value >= minimum):
        bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
        raise ValueError(f"{name}={value!r}: must be a number {bound} ({meaning})")
    return value


# The loss weights every trainer of this plugin reads (GradDiff's gamma and alpha): option -> meaning.
LOSS_WEIGHTS = {
    "gamma": "the weight of the forget terms; a negative one ascends them",
    "alpha": "the weight of the retain loss; a negative one is gradient ascent on the retain set",
}


def check_loss_weights(options: dict) -> None:
    """Check the `LOSS_WEIGHTS` present in `options` (a trainer's method_args) before anything is built."""
    for name, meaning in LOSS_WEIGHTS.items():
        if name in options:
            check_number(name, options[name], meaning)


def check_top_k(top_k):
    """`top_k` as written: a positive integer, `all`, or a float share of |V| in (0, 1]."""
    integer = isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1
    share = isinstance(top_k, float) and 0 < top_k <= 1
    if not (top_k == "all" or integer or share):
        raise ValueError(
            f"top_k={top_k!r}: give a positive integer K, `all`, or a share of the vocabulary in (0, 1] "
            f"(e.g. 0.15625, the paper's K=5000 of Llama-2's 32000)"
        )
    return top_k


def resolve_top_k(top_k, vocab_size: int) -> int:
    """K as used, from `top_k`: a positive integer (capped at |V|), `all` (|V|) or a float share of |V|.

    A share p in (0, 1] gives K = round(p·|V|) (at least 1): 0.15625 is the paper's K=5000 on Llama-2's
    32000 tokens. The resolved K is logged; K = |V| warns that the local loss then flattens the whole
    vocabulary (a PDU-like objective), not a top-K.
    """
    check_top_k(top_k)
    if top_k == "all":
        k = vocab_size
    elif isinstance(top_k, int):
        k = min(top_k, vocab_size)
    else:
        k = max(1, round(top_k * vocab_size))
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
    reference_logits: torch.Tensor,
    roles: torch.Tensor,
    top_k: int,
    kl_direction: str = "ref_to_policy",
    top_m: int | None = None,
) -> ReferenceTargets:
    """Extract the reference's top-K indices, mean logit and what the KL direction needs on common tokens.

    Args:
        reference_logits: (B, T, V) reference logits, unshifted.
        roles: (B, T) TokenRole of each input token.
        top_k: K, at most V (see `resolve_top_k`).
        kl_direction: `ref_to_policy` keeps P_ref and its negative entropy, `policy_to_ref` log P_ref.
        top_m: None keeps all V entries at common positions; m (at most V) the top-m form.
    """
    return targets_from_selected(*select_predictions(reference_logits, roles), top_k, kl_direction, top_m)


def targets_from_selected(
    initiating: torch.Tensor,
    common: torch.Tensor,
    top_k: int,
    kl_direction: str = "ref_to_policy",
    top_m: int | None = None,
) -> ReferenceTargets:
    """`reference_targets` from the reference's logits at the initiating (M, V) and common (C, V) positions.

    top_m: None keeps P_ref (or log P_ref) over all V; m keeps its m most probable entries and their tail
    mass (see `ReferenceTargets`).
    """
    check_kl_direction(kl_direction)
    return ReferenceTargets(
        **initiating_targets(initiating, top_k), **common_targets(common, kl_direction, top_m)
    )


def initiating_targets(logits: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """`ReferenceTargets`' initiating fields from the reference's logits there (M, V)."""
    with torch.no_grad():
        logits = at_least_fp32(logits)
        top, mean = logits.topk(top_k, dim=-1), logits.mean(dim=-1)
        spread = (top.values - mean.unsqueeze(-1)).pow(2).mean(dim=-1)
        return {"topk_indices": top.indices, "logit_mean": mean, "topk_spread": spread}


def common_targets(
    logits: torch.Tensor, kl_direction: str = "ref_to_policy", top_m: int | None = None
) -> dict[str, torch.Tensor]:
    """`ReferenceTargets`' common fields for `kl_direction` from the reference's logits there (C, V)."""
    with torch.no_grad():
        logits = at_least_fp32(logits)
        if top_m is not None:
            log_probs = F.log_softmax(logits, dim=-1)
            top = log_probs.topk(top_m, dim=-1)
            # log r from the tail's own entries: 1 − Σ top would cancel to 0 for a small tail
            log_tail = log_probs.scatter(-1, top.indices, -math.inf).logsumexp(dim=-1)
            if kl_direction == "policy_to_ref":
                return {
                    "common_indices": top.indices,
                    "common_log_probs": top.values,
                    "common_log_tail_mass": log_tail,
                }
            probs, tail = top.values.exp(), log_tail.exp()
            neg_entropy = torch.special.xlogy(probs, probs).sum(-1) + torch.special.xlogy(tail, tail)
            return {
                "common_indices": top.indices,
                "common_probs": probs,
                "common_tail_mass": tail,
                "common_neg_entropy": neg_entropy,
            }
        if kl_direction == "policy_to_ref":
            return {"common_log_probs": F.log_softmax(logits, dim=-1)}
        probs = F.softmax(logits, dim=-1)
        return {"common_probs": probs, "common_neg_entropy": torch.special.xlogy(probs, probs).sum(-1)}


def local_entropy_loss(
    logits: torch.Tensor,
    topk_indices: torch.Tensor,
    target: str = "global_mean",
    reference_logit_mean: torch.Tensor | None = None,
    target_gradient: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over initiating positions of (1/K)·Σ_{i∈top-K}(z_i − c)² (divided by `scale` per position).

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
        scale: None (the paper) or (M,) positive divisors of each position's loss (the reference's
            `topk_spread`: a scale-free form, 1 at the first step for `global_mean`).

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
    per_position = (selected - center.unsqueeze(-1)).pow(2).mean(dim=-1)
    if scale is not None:
        per_position = per_position / scale.to(per_position.dtype).clamp_min(torch.finfo(torch.float32).tiny)
    return per_position.mean()


class _KLFromReference(torch.autograd.Function):
    """Per-row KL(P_ref ‖ softmax(z)) = Σ p·log p − Σ p·(z − logsumexp(z)).

    One exponential pass over (C, V): the forward keeps softmax(z), and the gradient (softmax(z) − p)
    is formed in place, so no log-softmax tensor of size (C, V) is kept for the backward. The backward
    consumes its saved softmax: it runs once per forward, as in training.
    The cross term is Σ p·(z − max z), pairwise-summed, weighted by Σ p rather than 1: in fp32 Σ p is 1
    only to ~1e-6 on a 49k vocabulary, and `p·z + logsumexp(z)` as one dot product on raw logits near 20
    logged a KL of -1e-3 for a model against itself (the product is a transient (C, V) tensor).
    """

    @staticmethod
    def forward(ctx, logits, probs, neg_entropy):
        row_max = logits.amax(dim=-1, keepdim=True)
        shifted = logits - row_max
        cross_shifted = (probs * shifted).sum(dim=-1)
        softmax = shifted.exp_()
        normalizer = softmax.sum(dim=-1, keepdim=True)
        softmax.div_(normalizer)
        cross = cross_shifted - normalizer.log().squeeze(-1) * probs.sum(dim=-1)
        ctx.save_for_backward(softmax, probs)
        return neg_entropy - cross

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


def _softmax_and_tail(logits: torch.Tensor, indices: torch.Tensor):
    """softmax(z) (C, V), log Σ_j e^{z_j} (C,), and the current model's mass outside `indices` (C,) summed
    from the tail's own entries (1 − Σ top cancels to 0 for a small tail)."""
    row_max = logits.amax(dim=-1, keepdim=True)
    softmax = (logits - row_max).exp_()
    normalizer = softmax.sum(dim=-1, keepdim=True)
    softmax.div_(normalizer)
    log_normalizer = (row_max + normalizer.log()).squeeze(-1)
    tail = softmax.scatter(-1, indices, 0.0).sum(dim=-1)
    return softmax, log_normalizer, tail


class _KLFromTopM(torch.autograd.Function):
    """Per-row KL(P̃_ref ‖ P̃_θ) over the m cached entries plus one tail bucket (all other entries).

    With p the cached top-m of P_ref, r its tail mass, q = softmax(z) and Q = Σ_tail q:
    KL = Σ_top p·log p + r·log r − Σ_top p·z_i + logsumexp(z) − r·log Q.
    Gradient: q_i − p_i on the m entries (exact), q_j·(1 − r/Q) on the tail, where the exact one is
    q_j − p_j: the tail's reference mass is spread like the current model's. At the first step
    (P_θ = P_ref) both are exact; later the KL misses r·KL(P_ref,tail/r ‖ P_θ,tail/Q) ≥ 0 and each
    row's gradient is off by at most 2r in L1.
    """

    @staticmethod
    def forward(ctx, logits, indices, probs, tail_mass, neg_entropy):
        softmax, log_normalizer, current_tail = _softmax_and_tail(logits, indices)
        # log q_i on the m entries, not z_i with logsumexp(z) weighted by 1 − r: see `_KLFromReference`
        cross = (probs * (logits.gather(-1, indices) - log_normalizer.unsqueeze(-1))).sum(dim=-1)
        current_tail = current_tail.clamp_min(torch.finfo(logits.dtype).tiny)
        tail_cross = torch.special.xlogy(tail_mass, current_tail)
        ctx.save_for_backward(softmax, indices, probs, tail_mass / current_tail)
        return neg_entropy - cross - tail_cross

    @staticmethod
    def backward(ctx, grad_rows):
        softmax, indices, probs, tail_ratio = ctx.saved_tensors
        top_softmax = softmax.gather(-1, indices)
        gradient = softmax.mul_((1 - tail_ratio).unsqueeze(-1)).scatter_(-1, indices, top_softmax - probs)
        return gradient.mul_(grad_rows.unsqueeze(-1)), None, None, None, None


def common_kl_loss_top_m(
    logits: torch.Tensor,
    indices: torch.Tensor,
    probs: torch.Tensor,
    tail_mass: torch.Tensor,
    neg_entropy: torch.Tensor,
) -> torch.Tensor:
    """Mean over common positions of KL(P̃_ref ‖ P̃_θ), P_ref kept as its top-m entries and a tail bucket.

    Args:
        logits: (C, V) current-model logits at the common positions.
        indices: (C, m) int64 the reference's m most probable entries; probs: (C, m) their P_ref.
        tail_mass: (C,) r, P_ref's mass outside them. neg_entropy: (C,) Σ_top p·log p + r·log r.

    Returns:
        Scalar fp32; exactly 0 when C == 0. Equals `common_kl_loss` when m = V (see `_KLFromTopM`).
    """
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    logits = at_least_fp32(logits)
    cast = [t.to(logits.dtype) for t in (probs, tail_mass, neg_entropy)]
    return _KLFromTopM.apply(logits, indices.long(), *cast).mean()


class _KLToTopM(torch.autograd.Function):
    """Per-row KL(P̃_θ ‖ P̃_ref) over the m cached entries plus one tail bucket (all other entries).

    With q = softmax(z), Q = Σ_tail q, log p the cached top-m of log P_ref and log r its tail's:
    KL = Σ_top q_i·(log q_i − log p_i) + Q·(log Q − log r), the tail's term 0 when Q = 0.
    Each entry's gradient is q_j·(a_j − KL), a_j its bucket's log-ratio (log q_j − log p_j on the top,
    log Q − log r on the tail), as the full KL's is with a_j = log q_j − log P_ref,j. Exact at P_θ = P_ref
    and when m = V; otherwise the KL misses Q·KL(q̂ ‖ p̂) ≥ 0 (q̂, p̂ the tails normalised) and each row's
    gradient is off by at most Q·(KL(q̂ ‖ p̂) + E_q̂|log q̂/p̂|) in L1.
    """

    @staticmethod
    def forward(ctx, logits, indices, log_probs, log_tail_mass):
        # log q first and q = exp(log q), as `_KLToReference`, so that m = V gives its rounding too
        log_softmax = logits - logits.logsumexp(dim=-1, keepdim=True)
        softmax = log_softmax.exp()
        current_tail = softmax.scatter(-1, indices, 0.0).sum(dim=-1)
        tail_ratio = current_tail.log() - log_tail_mass  # NaN when m = V (no tail): overwritten below
        top_ratio = log_softmax.gather(-1, indices) - log_probs
        # every entry starts as a tail entry; the top-m get their own log-ratio
        log_ratio = tail_ratio.unsqueeze(-1).repeat(1, logits.shape[-1]).scatter_(-1, indices, top_ratio)
        top = (softmax.gather(-1, indices) * top_ratio).sum(dim=-1)
        per_row = top + torch.where(current_tail > 0, current_tail * tail_ratio, 0.0)
        ctx.save_for_backward(softmax, log_ratio, per_row)
        return per_row

    @staticmethod
    def backward(ctx, grad_rows):
        softmax, log_ratio, per_row = ctx.saved_tensors
        # an entry whose q underflowed to 0 in a tail of mass 0 has log-ratio -inf: its gradient is 0
        gradient = log_ratio.sub_(per_row.unsqueeze(-1)).mul_(softmax).nan_to_num_(0.0)
        return gradient.mul_(grad_rows.unsqueeze(-1)), None, None, None


def common_kl_to_reference_top_m(
    logits: torch.Tensor, indices: torch.Tensor, log_probs: torch.Tensor, log_tail_mass: torch.Tensor
) -> torch.Tensor:
    """Mean over common positions of KL(P̃_θ ‖ P̃_ref), P_ref kept as its top-m entries and a tail bucket.

    Args:
        logits: (C, V) current-model logits at the common positions.
        indices: (C, m) int64 the reference's m most probable entries; log_probs: (C, m) their log P_ref.
        log_tail_mass: (C,) log r, r P_ref's mass outside them (-inf when m = V).

    Returns:
        Scalar fp32 (float64 for float64 logits); exactly 0 when C == 0. Equals
        `common_kl_to_reference_loss` when m = V (see `_KLToTopM`).
    """
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    logits = at_least_fp32(logits)
    cast = [t.to(logits.dtype) for t in (log_probs, log_tail_mass)]
    return _KLToTopM.apply(logits, indices.long(), *cast).mean()


def reference_kl_loss(
    logits: torch.Tensor, reference: ReferenceTargets, kl_direction: str = "ref_to_policy"
) -> torch.Tensor:
    """The KL term on the common positions' logits (C, V), for either form of `reference`."""
    top_m = reference.common_indices is not None
    if check_kl_direction(kl_direction) == "policy_to_ref":
        if top_m:
            return common_kl_to_reference_top_m(
                logits, reference.common_indices, reference.common_log_probs, reference.common_log_tail_mass
            )
        return common_kl_to_reference_loss(logits, reference.common_log_probs)
    if top_m:
        return common_kl_loss_top_m(
            logits,
            reference.common_indices,
            reference.common_probs,
            reference.common_tail_mass,
            reference.common_neg_entropy,
        )
    return common_kl_loss(logits, reference.common_probs, reference.common_neg_entropy)


def mean_over_chunks(
    hidden: torch.Tensor,
    project: Callable,
    row_loss: Callable,
    chunk_rows: int | None,
    num_chunks: int | None = None,
    recompute: bool = True,
) -> torch.Tensor:
    """A mean-over-rows loss of the logits `project(hidden)` (N, V), never holding more than `chunk_rows`
    rows of logits: each chunk's projection and loss run under activation checkpointing (recomputed in
    the backward pass, as chunked cross-entropy in Liger and torchtune), weighted by its share of rows.

    Args:
        hidden: (N, d) hidden states of the rows. project: (n, d) -> (n, V).
        row_loss: (logits (n, V), rows: slice) -> the mean of the loss over those rows (scalar); also
            called on a padding chunk's zero rows (with whatever reference projection it makes), where it
            must return 0.
        chunk_rows: rows per chunk (see `logit_chunk_rows`); None: one chunk.
        num_chunks: call `project` exactly this many times, forward and backward alike (at least
            `chunk_count(N, chunk_rows)`): the chunks past the rows project zero rows and add exactly 0.
            Under ZeRO-3 each call of the partitioned projection is a collective, so every rank must make
            as many as the others (see `chunk_count`); None: as many as the rows need.
        recompute: False keeps each chunk's activations for the backward instead of recomputing them:
            under ZeRO-3, where a recompute inside the backward gathers and releases the projection's
            parameters around ZeRO-3's own backward gathering of them, which breaks the step.

    Returns:
        Scalar, equal to `row_loss(project(hidden), slice(None))`; exactly 0 when N == 0.
    """
    total = hidden.shape[0]
    chunk_rows = chunk_rows or max(total, 1)
    needed = chunk_count(total, chunk_rows)
    num_chunks = needed if num_chunks is None else num_chunks
    if num_chunks < needed:
        raise ValueError(f"num_chunks={num_chunks}: {total} rows need {needed} chunks of {chunk_rows}")
    if num_chunks == 0:
        return hidden.new_zeros((), dtype=torch.float32)

    def chunk_loss(chunk_hidden, rows):
        if rows.start < rows.stop:
            return row_loss(at_least_fp32(project(chunk_hidden)), rows)
        # A padding chunk adds exactly 0 through the projection, so that its parameters are gathered and
        # get their (zero) gradient as on every other rank. It projects one zero row, not none: ZeRO-3
        # gathers a module for its backward only when its output has elements.
        padding = at_least_fp32(project(chunk_hidden.new_zeros((1, chunk_hidden.shape[-1]))))
        return row_loss(padding[:0], rows) + 0.0 * padding.sum()

    parts = []
    for chunk in range(num_chunks):
        rows = slice(min(chunk * chunk_rows, total), min((chunk + 1) * chunk_rows, total))
        share = (rows.stop - rows.start) / total if total else 0.0
        if recompute and torch.is_grad_enabled():
            parts.append(share * checkpoint(chunk_loss, hidden[rows], rows, use_reentrant=False))
        else:
            parts.append(share * chunk_loss(hidden[rows], rows))
    return torch.stack(parts).sum()


def chunk_count(rows: int, chunk_rows: int) -> int:
    """Chunks of at most `chunk_rows` that `rows` positions need (0 for none)."""
    return -(-rows // chunk_rows)


def logit_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk of `mean_over_chunks`: LOGIT_CHUNK_ELEMENTS logits, at least one row."""
    return max(1, LOGIT_CHUNK_ELEMENTS // vocab_size)


def flat_hidden_rows(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(N, d) hidden states at flat positions `rows` (N,) of `hidden` (B, T, d)."""
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)


def forget_hidden(hidden: torch.Tensor, roles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states (B, T, d) at the positions that predict initiating (M, d) and common (C, d)
    tokens (see `forget_rows`)."""
    return tuple(flat_hidden_rows(hidden, rows) for rows in forget_rows(roles))


def reference_targets_at_positions(
    hidden: torch.Tensor,
    project: Callable,
    roles: torch.Tensor,
    top_k: int,
    kl_direction: str,
    top_m: int | None,
    chunk_rows: int | None = None,
) -> ReferenceTargets:
    """`reference_targets` from the reference's final hidden states (B, T, d), its output projection
    `project` run `chunk_rows` positions at a time (at least once per kind, also for none): with top_m
    set, never more than `chunk_rows` × V logits are held."""

    def in_chunks(rows_hidden, fields):
        step = chunk_rows or max(len(rows_hidden), 1)
        starts = range(0, max(len(rows_hidden), 1), step)
        parts = [fields(at_least_fp32(project(rows_hidden[start : start + step]))) for start in starts]
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    initiating_hidden, common_hidden = forget_hidden(hidden, roles)
    with torch.no_grad():
        return ReferenceTargets(
            **in_chunks(initiating_hidden, lambda logits: initiating_targets(logits, top_k)),
            **in_chunks(common_hidden, lambda logits: common_targets(logits, kl_direction, top_m)),
        )


def local_scale(reference: ReferenceTargets, local_loss_scale: str) -> torch.Tensor | None:
    """The per-position divisors of the local loss that `local_loss_scale` asks for (None: the paper's)."""
    if check_local_loss_scale(local_loss_scale) == "none":
        return None
    if reference.topk_spread is None:
        raise ValueError("local_loss_scale=reference needs the reference's topk_spread (initiating_targets)")
    return reference.topk_spread


def palu_forget_loss_at_positions(
    hidden: torch.Tensor,
    project: Callable,
    roles: torch.Tensor,
    reference: "ReferenceTargets | ReferenceFromModel",
    target: str = "global_mean",
    target_gradient: bool = False,
    kl_direction: str = "ref_to_policy",
    chunk_rows: int | None = None,
    num_chunks: tuple[int, int] | None = None,
    recompute: bool = True,
    local_loss_scale: str = "none",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`palu_forget_loss` from the final hidden states (B, T, d): the output projection `project`
    ((n, d) -> (n, V)) runs only at the initiating and common positions, `chunk_rows` positions at a
    time (None: all at once; see `mean_over_chunks` and `logit_chunk_rows`). Same values and gradients
    as projecting every position.

    reference: `ReferenceTargets` (cached), or `ReferenceFromModel`, whose targets are projected chunk by
    chunk inside the same checkpointed chunks. num_chunks: (initiating, common) projection calls, for
    ZeRO-3 (see `mean_over_chunks`); None: as many as the rows need. recompute: see `mean_over_chunks`.
    local_loss_scale: see `palu_forget_loss`.
    """
    initiating_chunks, common_chunks = num_chunks or (None, None)

    def local_rows(logits, rows):
        chunk_reference = reference.initiating_rows(rows)
        return local_entropy_loss(
            logits,
            chunk_reference.topk_indices,
            target=target,
            reference_logit_mean=chunk_reference.logit_mean,
            target_gradient=target_gradient,
            scale=local_scale(chunk_reference, local_loss_scale),
        )

    def kl_rows(logits, rows):
        return reference_kl_loss(logits, reference.common_rows(rows), kl_direction)

    initiating_hidden, common_hidden = forget_hidden(hidden, roles)
    local = mean_over_chunks(initiating_hidden, project, local_rows, chunk_rows, initiating_chunks, recompute)
    return local, mean_over_chunks(common_hidden, project, kl_rows, chunk_rows, common_chunks, recompute)


def palu_forget_loss(
    logits: torch.Tensor,
    roles: torch.Tensor,
    reference: ReferenceTargets,
    target: str = "global_mean",
    target_gradient: bool = False,
    kl_direction: str = "ref_to_policy",
    local_loss_scale: str = "none",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local entropy and KL terms of one forget batch; redundant tokens contribute nothing.

    Args:
        logits: (B, T, V) current logits, unshifted: position t-1 predicts token t.
        roles: (B, T) TokenRole of each input token.
        reference: the reference's targets for this batch (see `reference_targets`, same `kl_direction`).
        target, target_gradient: c of the local loss and whether gradient flows through it.
        kl_direction: `ref_to_policy` KL(P_ref ‖ P_θ) (the paper) or `policy_to_ref` KL(P_θ ‖ P_ref)
            (the released code).
        local_loss_scale: `none` (the paper) or `reference`: each initiating position's local loss divided
            by the reference's own there (`ReferenceTargets.topk_spread`), an option, not the paper's loss.

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
        scale=local_scale(reference, local_loss_scale),
    )
    return local, reference_kl_loss(common, reference, kl_direction)


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """(N, 2) (row, t) of the positions t that predict a label (labels (B, T), -100 where none)."""
    return torch.nonzero(labels[:, 1:] != -100)


def label_nll_at_positions(
    hidden: torch.Tensor,
    project: Callable,
    labels: torch.Tensor,
    chunk_rows: int | None = None,
    num_chunks: int | None = None,
    recompute: bool = True,
) -> torch.Tensor:
    """Mean next-token NLL over label positions, projecting only the positions that predict a label,
    `chunk_rows` at a time, in `num_chunks` calls (see `palu_forget_loss_at_positions`).

    Args:
        hidden: (B, T, d) final hidden states. project: (n, d) -> (n, V). labels: (B, T), -100 where
            not a label (prompt, padding), unshifted.

    Returns:
        Scalar fp32, the causal-LM loss of `model(labels=...)`; exactly 0 when no label.
    """
    rows = label_positions(labels)
    targets = labels[:, 1:][rows[:, 0], rows[:, 1]]
    flat = flat_hidden_rows(hidden, rows[:, 0] * labels.shape[1] + rows[:, 1])

    def mean_nll(logits, rows):
        return F.cross_entropy(logits, targets[rows]) if len(logits) else logits.new_zeros(())

    return mean_over_chunks(flat, project, mean_nll, chunk_rows, num_chunks, recompute)


def palu_terms(
    local_loss: torch.Tensor,
    kl_loss: torch.Tensor,
    retain_loss: torch.Tensor,
    gamma: float = 1.0,
    alpha: float = 1.0,
    kl_weight: float | str = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PALU's three scalar terms with their weights, (local, KL, retain): the training loss is their sum.

    kl_weight λ a number: gamma·local, gamma·λ·KL, alpha·retain (the paper).
    kl_weight `alpha`: gamma·local, alpha·KL, alpha·retain (the released code: one alpha for both).
    """
    kl_factor = alpha if check_kl_weight(kl_weight) == "alpha" else gamma * kl_weight
    return gamma * local_loss, kl_factor * kl_loss, alpha * retain_loss


def term_gradient_norms(terms: dict[str, torch.Tensor], parameters: list[torch.Tensor]) -> dict[str, float]:
    """The L2 norm of each term's gradient over `parameters` (all of them together), one backward pass per
    term through the same graph (kept for the training step's own backward). A term that does not depend
    on the parameters (a zero retain loss, a batch without initiating tokens) has norm 0."""
    norms = {}
    for name, term in terms.items():
        if not term.requires_grad:
            norms[name] = 0.0
            continue
        gradients = torch.autograd.grad(term, parameters, retain_graph=True, allow_unused=True)
        squares = [gradient.float().pow(2).sum() for gradient in gradients if gradient is not None]
        norms[name] = float(torch.stack(squares).sum().sqrt()) if squares else 0.0
    return norms
