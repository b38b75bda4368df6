"""KL between the reference's and the current model's next-token distributions at common positions, both
directions, with P_ref over all of V (dense) or as its m most probable entries and one tail bucket (top-m).

Four autograd kernels, each keeping the fewest (C, V) tensors its backward needs. Shapes: C common
positions, V vocabulary, m kept entries. Each loss is a scalar in fp32 or wider (the logits' dtype, at least
fp32; the reference's tensors cast alike), exactly 0 for no position.
"""

import torch

from palu_trainer.method.chunking import at_least_fp32

KL_DIRECTIONS = ("ref_to_policy", "policy_to_ref")


def _mean_over_rows(kernel, logits: torch.Tensor, *reference: torch.Tensor, indices=None) -> torch.Tensor:
    """`kernel`'s per-row KL averaged over the C rows of `logits` (C, V)."""
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    logits = at_least_fp32(logits)
    top = () if indices is None else (indices.long(),)
    return kernel.apply(logits, *top, *(tensor.to(logits.dtype) for tensor in reference)).mean()


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
    """Mean over common positions of KL(P_ref ‖ P_θ): logits (C, V) the current model's there,
    reference_probs (C, V) P_ref (any float dtype), reference_neg_entropy (C,) Σ P_ref·log P_ref."""
    return _mean_over_rows(_KLFromReference, logits, reference_probs, reference_neg_entropy)


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
    """Mean over common positions of KL(P_θ ‖ P_ref), the released code's direction: logits (C, V) the
    current model's there, reference_log_probs (C, V) log P_ref (any float dtype)."""
    return _mean_over_rows(_KLToReference, logits, reference_log_probs)


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
        row_max = logits.amax(dim=-1, keepdim=True)
        softmax = (logits - row_max).exp_()
        normalizer = softmax.sum(dim=-1, keepdim=True)
        softmax.div_(normalizer)
        log_normalizer = (row_max + normalizer.log()).squeeze(-1)
        # Q from the tail's own entries: 1 − Σ top would cancel to 0 for a small tail
        current_tail = softmax.scatter(-1, indices, 0.0).sum(dim=-1)
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


def top_m_kl(
    logits: torch.Tensor,
    kl_direction: str,
    indices: torch.Tensor,
    common: torch.Tensor,
    tail: torch.Tensor,
    neg_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over common positions of the KL in `kl_direction` between P_θ and P_ref kept as its top-m entries
    and a tail bucket (`reference.TopMReference`'s fields; the dense KL when m = V): logits (C, V)."""
    if kl_direction == "policy_to_ref":
        return _mean_over_rows(_KLToTopM, logits, common, tail, indices=indices)
    return _mean_over_rows(_KLFromTopM, logits, common, tail, neg_entropy, indices=indices)
