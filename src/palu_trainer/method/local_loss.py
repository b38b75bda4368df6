"""PALU's local entropy loss at initiating positions, and K (the reference's top-K it flattens) resolved
against a vocabulary. Shapes: M initiating positions, V vocabulary, K reference top-K."""

import logging
import math

import torch

from palu_trainer.method.chunking import at_least_fp32

TARGETS = ("global_mean", "topk_mean", "ref_mean", "uniform", "zero")
# `none`: the paper's local loss; `reference`: each initiating position's loss divided by the reference's own
# (its `topk_spread`), so the term starts near 1 whatever the model's logit scale (docs/real-model.md: the
# utility cliff).
LOCAL_LOSS_SCALES = ("none", "reference")

logger = logging.getLogger(__name__)


def check_top_k(top_k):
    """`top_k` as written: a positive integer, `all`, or a float share of |V| in (0, 1]."""
    integer = isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1
    share = isinstance(top_k, float) and 0 < top_k <= 1
    if not (top_k == "all" or integer or share):
        raise ValueError(
            "give a positive integer K, `all`, or a share of the vocabulary in (0, 1] (e.g. 0.15625, the "
            "paper's K=5000 of Llama-2's 32000)"
        )
    return top_k


def resolve_top_k(top_k, vocab_size: int) -> int:
    """K as used, logged: `top_k` capped at |V|, |V| for `all`, round(p·|V|) (at least 1) for a share p;
    K = |V| warns."""
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


def local_entropy_loss(
    logits: torch.Tensor,
    topk_indices: torch.Tensor,
    target: str,
    reference_logit_mean: torch.Tensor | None = None,
    *,
    target_gradient: bool,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over initiating positions of (1/K)·Σ_{i∈top-K}(z_i − c)² (divided by `scale` per position);
    a scalar in fp32 or wider, exactly 0 when M == 0.

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
    """
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    logits = at_least_fp32(logits)
    selected = logits.gather(-1, topk_indices)
    if target == "ref_mean" and reference_logit_mean is None:
        raise ValueError("target 'ref_mean' needs reference_logit_mean")
    center = {
        "global_mean": lambda: logits.mean(dim=-1),
        "topk_mean": lambda: selected.mean(dim=-1),
        "ref_mean": lambda: reference_logit_mean.to(logits.dtype),
        "uniform": lambda: logits.logsumexp(dim=-1) - math.log(logits.shape[-1]),
        "zero": lambda: torch.zeros_like(selected[:, 0]),
    }[target]()
    if not target_gradient:
        center = center.detach()
    per_position = (selected - center.unsqueeze(-1)).pow(2).mean(dim=-1)
    if scale is not None:
        per_position = per_position / scale.to(per_position.dtype).clamp_min(torch.finfo(torch.float32).tiny)
    return per_position.mean()
