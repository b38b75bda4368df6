"""Token roles: which answer tokens get the local entropy loss, the KL term, or nothing.

Pure functions over character offsets, so they can be tested without a model or the framework.
"""

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
    """Roles of one tokenised sample plus what truncation did to its spans.

    roles: (T,) int64 TokenRole per token of the sample's input_ids.
    spans_cut: spans that lost some, but not all, of their tokens to `max_length`.
    spans_dropped: spans with no token left after truncation.
    """

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
    """Give every token its PALU role from character spans of the answer.

    Args:
        token_offsets: (T,) pairs `(start, end)`: each token's character range in answer
            coordinates (prompt tokens have negative or empty ranges; special tokens empty ones).
        is_label: (T,) True where the token is a training label (the response).
        spans: sorted, non-overlapping sensitive spans `[start, end)` in answer characters.
        policy: which of a span's tokens are INITIATING; the span's other tokens are REDUNDANT.
        row: the sample's dataset index, which seeds the `random_n` policy.

    A label token belongs to the first span it overlaps; label tokens in no span (the EOS
    included) are COMMON.
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
        overlaps = (
            end > start
            and span_cursor < len(spans)
            and start < spans[span_cursor][1]
            and end > spans[span_cursor][0]
        )
        if overlaps:
            span_tokens[span_cursor].append(position)
        else:
            roles[position] = TokenRole.COMMON
    for positions in span_tokens:
        roles[positions] = TokenRole.REDUNDANT
    roles[policy.initiating_positions(span_tokens, row)] = TokenRole.INITIATING
    spans_dropped = sum(1 for positions in span_tokens if not positions)
    spans_cut = sum(
        1 for positions, (_, span_end) in zip(span_tokens, spans) if positions and span_end > label_text_end
    )
    return RoleAssignment(roles=roles, spans_cut=spans_cut, spans_dropped=spans_dropped)


def count_roles(roles: torch.Tensor) -> dict[str, int]:
    """Number of initiating, common and redundant tokens in a role tensor of any shape."""
    return {
        f"n_{role.name.lower()}": int((roles == role).sum())
        for role in (TokenRole.INITIATING, TokenRole.COMMON, TokenRole.REDUNDANT)
    }
