"""Which rows of a batch's (B·T) positions each loss reads: position t-1 predicts token t.

Shapes: B batch, T sequence length, d the width of the per-position states (hidden size, or |V| for logits).
"""

import torch

from palu_trainer.method.roles import TokenRole


def predicting_rows(roles: torch.Tensor, role: TokenRole) -> torch.Tensor:
    """Rows of `states.view(B * T, d)` that predict the tokens with `role`: token t is predicted at t-1.

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


def flat_rows(states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(N, d) states at flat positions `rows` (N,) of `states` (B, T, d), in one index_select, so that the
    backward pass writes one (B·T, d) gradient rather than one per slice."""
    return states.reshape(-1, states.shape[-1]).index_select(0, rows)


def at_forget_positions(states: torch.Tensor, roles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """States (B, T, d) (final hidden states, or logits) at the positions that predict initiating (M, d) and
    common (C, d) tokens (see `forget_rows`); one selection for both, so that full logits get one
    (B·T, V) gradient."""
    initiating, common = forget_rows(roles)
    selected = flat_rows(states, torch.cat([initiating, common]))
    return selected[: len(initiating)], selected[len(initiating) :]


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """(N, 2) (row, t) of the positions t that predict a label (labels (B, T), -100 where none)."""
    return torch.nonzero(labels[:, 1:] != -100)
