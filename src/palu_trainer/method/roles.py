"""Token roles: which answer tokens get the local entropy loss, the KL term, or nothing; from character
offsets, no model. And which (B·T) rows each loss reads: position t-1 predicts token t. Shapes: B batch, T
sequence length, d the width of the per-position states (hidden size, or |V| for logits)."""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from palu_trainer.method.initiating import InitiatingPolicy


class TokenRole(IntEnum):
    """Role of one label token. IGNORED marks prompt and padding positions (labels == -100)."""

    IGNORED = 0
    COMMON = 1
    INITIATING = 2
    REDUNDANT = 3


@dataclass(frozen=True)
class RoleAssignment:
    """Roles of one tokenised sample, (T,) int64 TokenRole per input token, and its spans that truncation
    to `max_length` cut (some, not all, of their tokens lost) or dropped (no token left)."""

    roles: torch.Tensor
    spans_cut: int
    spans_dropped: int


def assign_token_roles(
    token_offsets: Sequence[tuple[int, int]],
    is_label: Sequence[bool],
    spans: Sequence[tuple[int, int]],
    policy: InitiatingPolicy,
    row: int = 0,
) -> RoleAssignment:
    """Every token's role from character spans of the answer.

    Args:
        token_offsets: (T,) each token's `(start, end)` in answer characters (prompt tokens have negative or
            empty ranges; special tokens empty ones).
        is_label: (T,) True where the token is a training label (the response).
        spans: sorted, non-overlapping sensitive spans `[start, end)` in answer characters.
        policy: which of a span's tokens are INITIATING; its others are REDUNDANT.
        row: the sample's dataset index, which seeds `random_n`.

    A label token belongs to the first span it overlaps; label tokens in no span (the EOS included) are
    COMMON.
    """
    roles = torch.full((len(token_offsets),), int(TokenRole.IGNORED), dtype=torch.long)
    span_tokens: list[list[int]] = [[] for _ in spans]
    span_cursor = 0
    label_text_end = 0
    for position, ((start, end), label) in enumerate(zip(token_offsets, is_label)):
        if not label:
            continue
        label_text_end = max(label_text_end, end)
        while span_cursor < len(spans) and spans[span_cursor][1] <= start:
            span_cursor += 1
        in_span = span_cursor < len(spans) and start < spans[span_cursor][1] and end > spans[span_cursor][0]
        if end > start and in_span:
            span_tokens[span_cursor].append(position)
        else:
            roles[position] = TokenRole.COMMON
    for positions in span_tokens:
        roles[positions] = TokenRole.REDUNDANT
    roles[policy.initiating_positions(span_tokens, row)] = TokenRole.INITIATING
    dropped = sum(1 for positions in span_tokens if not positions)
    cut = sum(1 for positions, (_, end) in zip(span_tokens, spans) if positions and end > label_text_end)
    return RoleAssignment(roles=roles, spans_cut=cut, spans_dropped=dropped)


def count_roles(roles: torch.Tensor) -> dict[str, int]:
    """Number of initiating, common and redundant tokens in a role tensor of any shape."""
    return {
        f"n_{role.name.lower()}": int((roles == role).sum())
        for role in (TokenRole.INITIATING, TokenRole.COMMON, TokenRole.REDUNDANT)
    }


def predicting_rows(roles: torch.Tensor, role: TokenRole) -> torch.Tensor:
    """(N,) int64 rows of `states.view(B * T, d)` that predict the tokens with `role` in roles (B, T), in
    row-major order of the predicted tokens."""
    predicted = torch.nonzero(roles[:, 1:] == role)
    return predicted[:, 0] * roles.shape[1] + predicted[:, 1]


def forget_rows(roles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (B·T) positions that predict initiating (M,) and common (C,) tokens: the only rows a forget
    loss reads; prompt, padding and redundant positions are never projected to the vocabulary."""
    return predicting_rows(roles, TokenRole.INITIATING), predicting_rows(roles, TokenRole.COMMON)


def flat_rows(states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(N, d) states at flat positions `rows` (N,) of `states` (B, T, d), in one index_select, so that the
    backward pass writes one (B·T, d) gradient rather than one per slice."""
    return states.reshape(-1, states.shape[-1]).index_select(0, rows)


def at_forget_positions(states: torch.Tensor, roles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """States (B, T, d) at the positions that predict initiating (M, d) and common (C, d) tokens (one
    `flat_rows`)."""
    initiating, common = forget_rows(roles)
    selected = flat_rows(states, torch.cat([initiating, common]))
    return selected[: len(initiating)], selected[len(initiating) :]


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """(N, 2) (row, t) of the positions t that predict a label (labels (B, T), -100 where none)."""
    return torch.nonzero(labels[:, 1:] != -100)
