"""TPO's forget loss as pure functions, on this project's token roles.

TPO (Targeted Preference Optimization; code: github xzhou98/Unlearning-TPO, loss type `tpo_grad_diff`)
splits a forget answer into sensitive tokens (here: every span token, INITIATING or REDUNDANT) and common
tokens (COMMON, the EOS included) and adds two terms to the retain loss:

- logit preference (LPL): −(2/β)·log σ(β·d), where d is the batch mean, over sequences, of the per-sequence
  mean raw logit of the ground-truth sensitive token under the frozen reference minus the same under the
  current model. One sigmoid on the batch-level difference, as released (not one per sequence).
- preservation (PL): the ground-truth NLL of the common tokens, summed within each sequence and averaged
  over the batch (the released `get_batch_loss(...).mean()`), not a KL to the reference.

Arguments: logits (B, T, V), unshifted (position t-1 predicts token t); input_ids (B, T); roles (B, T),
the TokenRole of each input token. Every reduction runs in fp32; an empty selection gives exactly 0.
"""

import torch
import torch.nn.functional as F

from palu_trainer.method.roles import TokenRole


def per_sequence_target_logit(
    logits: torch.Tensor, input_ids: torch.Tensor, predicted: torch.Tensor
) -> torch.Tensor:
    """(S,) fp32 mean raw logit of the ground-truth next token over the positions that predict the
    `predicted` (B, T) bool tokens, for each of the S sequences (in batch order) with at least one."""
    mask = predicted[:, 1:]
    target = logits[:, :-1].gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1).float()
    counts = mask.sum(dim=1)
    has_tokens = counts > 0
    return (target * mask).sum(dim=1)[has_tokens] / counts[has_tokens]


def tpo_preference_loss(
    logits: torch.Tensor,
    reference_logits: torch.Tensor,
    input_ids: torch.Tensor,
    roles: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """LPL = −(2/β)·log σ(β·(mean_b r_b − mean_b c_b)) over the sensitive tokens.

    r_b, c_b: the reference's and the current model's mean target logit over sequence b's sensitive
    tokens. Sequences without a sensitive token are left out of both means (released: 0/0 = NaN).
    reference_logits: (B, T, V) the frozen reference's. beta: β > 0.
    """
    sensitive = (roles == TokenRole.INITIATING) | (roles == TokenRole.REDUNDANT)
    current = per_sequence_target_logit(logits, input_ids, sensitive)
    if current.numel() == 0:
        return logits.new_zeros((), dtype=torch.float32)
    with torch.no_grad():
        reference = per_sequence_target_logit(reference_logits, input_ids, sensitive)
    difference = reference.mean() - current.mean()
    return -(2.0 / beta) * F.logsigmoid(beta * difference)


def tpo_preservation_loss(logits: torch.Tensor, input_ids: torch.Tensor, roles: torch.Tensor) -> torch.Tensor:
    """PL = (1/B)·Σ_b Σ_{t common} −log P_θ(x_t | x_<t): per-sequence sum, batch mean."""
    predicted = torch.nonzero(roles[:, 1:] == TokenRole.COMMON)
    if predicted.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    rows, columns = predicted[:, 0], predicted[:, 1]
    selected = logits[rows, columns].float()
    return F.cross_entropy(selected, input_ids[rows, columns + 1], reduction="sum") / roles.shape[0]
