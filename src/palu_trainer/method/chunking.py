"""Losses over (N, V) logits that never hold more than a chunk of them: the output projection runs a chunk
of positions at a time under activation checkpointing (as chunked cross-entropy in Liger and torchtune)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 for half-precision inputs; float64 stays float64."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def logits_of(states: torch.Tensor, project: Callable | None) -> torch.Tensor:
    """`project(states)` in fp32 or wider; None: the states already are logits (a model whose logits PALU
    cannot recompute)."""
    return at_least_fp32(project(states) if project else states)


@dataclass(frozen=True)
class ProjectionCalls:
    """How often each loss of one step calls the output projection (`mean_over_chunks`' num_chunks; None:
    as its rows need) and its recompute (False under ZeRO-3): what ZeRO-3 needs of them, in one object."""

    initiating: int | None = None
    common: int | None = None
    retain: int | None = None
    recompute: bool = True


AS_NEEDED = ProjectionCalls()  # one process: each loss calls the projection as often as its rows need


def chunk_count(rows: int, chunk_rows: int) -> int:
    """Chunks of at most `chunk_rows` that `rows` positions need (0 for none)."""
    return -(-rows // chunk_rows)


def logit_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk of `mean_over_chunks`: 2**22 fp32 logits (16 MiB, 32 positions at |V| = 128256), at
    least one row, so that a step never holds (positions x |V|) logits."""
    return max(1, 2**22 // vocab_size)


def mean_over_chunks(
    states: torch.Tensor,
    project: Callable | None,
    row_loss: Callable,
    chunk_rows: int | None,
    num_chunks: int | None = None,
    recompute: bool = True,
) -> torch.Tensor:
    """`row_loss(project(states), slice(None))`, never holding more than `chunk_rows` rows of logits: each
    chunk's projection and loss run under activation checkpointing, weighted by its share of rows; exactly
    0 when N == 0.

    Args:
        states: (N, d) hidden states of the rows. project: (n, d) -> (n, V); None: `states` are logits.
        row_loss: (logits (n, V), rows: slice) -> the mean loss over those rows; also called on a padding
            chunk's zero rows (with whatever reference projection it makes), where it must return 0.
        chunk_rows: rows per chunk (`logit_chunk_rows`); None: one chunk.
        num_chunks: call `project` exactly this many times, forward and backward alike (at least
            `chunk_count(N, chunk_rows)`; the chunks past the rows add exactly 0): under ZeRO-3 each call
            of the partitioned projection is a collective, so every rank must make as many as the others.
        recompute: False keeps each chunk's activations for the backward: under ZeRO-3 a recompute inside
            the backward gathers and releases the projection's parameters around ZeRO-3's own backward
            gathering of them, which breaks the step.
    """
    total = states.shape[0]
    chunk_rows = chunk_rows or max(total, 1)
    needed = chunk_count(total, chunk_rows)
    num_chunks = needed if num_chunks is None else num_chunks
    if num_chunks < needed:
        raise ValueError(f"num_chunks={num_chunks}: {total} rows need {needed} chunks of {chunk_rows}")
    if num_chunks == 0:
        return states.new_zeros((), dtype=torch.float32)

    def chunk_loss(chunk_states, rows):
        if rows.start < rows.stop:
            return row_loss(logits_of(chunk_states, project), rows)
        # A padding chunk adds exactly 0 through the projection, so that its parameters are gathered and
        # get their (zero) gradient as on every other rank. It projects one zero row, not none: ZeRO-3
        # gathers a module for its backward only when its output has elements and needs a gradient, which
        # a frozen projection's (LoRA) gives only through its input: the row is the sum of no rows, so it
        # stays in the states' graph.
        padding = logits_of(chunk_states.sum(0, keepdim=True), project)
        return row_loss(padding[:0], rows) + 0.0 * padding.sum()

    parts = []
    for chunk in range(num_chunks):
        rows = slice(min(chunk * chunk_rows, total), min((chunk + 1) * chunk_rows, total))
        share = (rows.stop - rows.start) / total if total else 0.0
        if recompute and torch.is_grad_enabled():
            parts.append(share * checkpoint(chunk_loss, states[rows], rows, use_reentrant=False))
        else:
            parts.append(share * chunk_loss(states[rows], rows))
    return torch.stack(parts).sum()
