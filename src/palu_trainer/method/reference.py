"""What PALU reads from the frozen reference for one forget batch: the `Reference` protocol and its three
forms, each knowing its KL. Shapes: M initiating and C common positions, V vocabulary, K reference top-K, m
kept entries per common position, d hidden size."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from palu_trainer.method.chunking import at_least_fp32, logits_of
from palu_trainer.method.kl import common_kl_loss, common_kl_to_reference_loss, top_m_kl
from palu_trainer.method.roles import at_forget_positions


@dataclass
class InitiatingTargets:
    """The reference at the M initiating positions; fixed for the whole run.

    topk_indices: (M, K) int64, its top-K vocabulary entries (the entries the local loss flattens).
    logit_mean: (M,) fp32, its mean logit (the `ref_mean` target).
    topk_spread: (M,) fp32, its own local loss (`global_mean`): the divisor of `local_loss_scale=reference`.
    """

    topk_indices: torch.Tensor
    logit_mean: torch.Tensor
    topk_spread: torch.Tensor

    def rows(self, rows: slice) -> "InitiatingTargets":
        return InitiatingTargets(self.topk_indices[rows], self.logit_mean[rows], self.topk_spread[rows])


class Reference(Protocol):
    """The reference's side of PALU's loss for one forget batch."""

    kl_direction: str

    def initiating(self, rows: slice) -> InitiatingTargets:
        """Its targets at the initiating positions `rows`."""

    def kl(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        """Mean over the common positions `rows` of the KL between P_ref and softmax(`logits`) (n, V), in
        `kl_direction`: a scalar in fp32 or wider, exactly 0 for no rows."""


def initiating_targets(logits: torch.Tensor, top_k: int) -> InitiatingTargets:
    """The reference's `InitiatingTargets` from its logits at the initiating positions (M, V)."""
    with torch.no_grad():
        logits = at_least_fp32(logits)
        top, mean = logits.topk(top_k, dim=-1), logits.mean(dim=-1)
        spread = (top.values - mean.unsqueeze(-1)).pow(2).mean(dim=-1)
        return InitiatingTargets(top.indices, mean, spread)


@dataclass
class DenseReference:
    """P_ref over all of V at each common position.

    common: (C, V) P_ref (`ref_to_policy`) or log P_ref (`policy_to_ref`, exact where P_ref underflows).
    neg_entropy: (C,) fp32 Σ P_ref·log P_ref, the constant part of KL(P_ref ‖ P_θ) (`ref_to_policy` only).
    """

    initiating_targets: InitiatingTargets
    kl_direction: str
    common: torch.Tensor
    neg_entropy: torch.Tensor | None = None

    def initiating(self, rows: slice) -> InitiatingTargets:
        return self.initiating_targets.rows(rows)

    def kl(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        if self.kl_direction == "policy_to_ref":
            return common_kl_to_reference_loss(logits, self.common[rows])
        return common_kl_loss(logits, self.common[rows], self.neg_entropy[rows])


@dataclass
class TopMReference:
    """P_ref at each common position coarsened to its m most probable entries and one tail bucket holding
    the rest of its mass r; the KL is taken between the coarsened distributions (its error, bounded by the
    tail: `kl._KLFromTopM`, `kl._KLToTopM`).

    indices: (C, m) int64, the entries kept. common: (C, m) their P_ref, or log P_ref (`policy_to_ref`).
    tail: (C,) r, or log r. neg_entropy: (C,) Σ_top p·log p + r·log r (`ref_to_policy` only).
    """

    initiating_targets: InitiatingTargets
    kl_direction: str
    indices: torch.Tensor
    common: torch.Tensor
    tail: torch.Tensor
    neg_entropy: torch.Tensor | None = None

    def initiating(self, rows: slice) -> InitiatingTargets:
        return self.initiating_targets.rows(rows)

    def kl(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        indices, common, tail = self.indices[rows], self.common[rows], self.tail[rows]
        neg_entropy = None if self.neg_entropy is None else self.neg_entropy[rows]
        return top_m_kl(logits, self.kl_direction, indices, common, tail, neg_entropy)


def common_fields(logits: torch.Tensor, kl_direction: str, top_m: int | None) -> dict[str, torch.Tensor]:
    """The common-position fields of `DenseReference` (top_m None) or `TopMReference` (top_m = m, at most
    V) from the reference's logits there (C, V)."""
    with torch.no_grad():
        logits = at_least_fp32(logits)
        if top_m is None:
            if kl_direction == "policy_to_ref":
                return {"common": F.log_softmax(logits, dim=-1)}
            probs = F.softmax(logits, dim=-1)
            return {"common": probs, "neg_entropy": torch.special.xlogy(probs, probs).sum(-1)}
        log_probs = F.log_softmax(logits, dim=-1)
        top = log_probs.topk(top_m, dim=-1)
        # log r from the tail's own entries: 1 − Σ top would cancel to 0 for a small tail
        log_tail = log_probs.scatter(-1, top.indices, -math.inf).logsumexp(dim=-1)
        if kl_direction == "policy_to_ref":
            return {"indices": top.indices, "common": top.values, "tail": log_tail}
        probs, tail = top.values.exp(), log_tail.exp()
        neg_entropy = torch.special.xlogy(probs, probs).sum(-1) + torch.special.xlogy(tail, tail)
        return {"indices": top.indices, "common": probs, "tail": tail, "neg_entropy": neg_entropy}


@dataclass
class ModelReference:
    """The reference's final hidden states (or logits, with `project` None) at the positions that predict
    initiating (M, d) and common (C, d) tokens, projected by its `project` (n, d) -> (n, V) inside each chunk
    of the loss (without gradient), so that no (C, V) P_ref is held: the form used when no cache is built.
    """

    initiating_states: torch.Tensor
    common_states: torch.Tensor
    project: Callable | None
    top_k: int
    kl_direction: str = "ref_to_policy"

    def initiating(self, rows: slice) -> InitiatingTargets:
        with torch.no_grad():
            return initiating_targets(logits_of(self.initiating_states[rows], self.project), self.top_k)

    def kl(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        with torch.no_grad():
            fields = common_fields(logits_of(self.common_states[rows], self.project), self.kl_direction, None)
        # these rows' P_ref, projected now: no initiating targets
        return DenseReference(None, self.kl_direction, **fields).kl(logits, slice(None))


def reference_targets(
    states: torch.Tensor,
    roles: torch.Tensor,
    top_k: int,
    kl_direction: str = "ref_to_policy",
    top_m: int | None = None,
    project: Callable | None = None,
    chunk_rows: int | None = None,
) -> DenseReference | TopMReference:
    """The reference's targets for a batch, computed now: `DenseReference`, or `TopMReference` with top_m.

    Args:
        states: (B, T, d) the reference's final hidden states, or (B, T, V) its logits (project None);
            unshifted: position t-1 predicts token t. roles: (B, T) TokenRole of each input token.
        top_k: K, at most V. kl_direction: what the common positions keep (see `DenseReference`).
        top_m: None keeps all V entries at common positions; m (at most V) the top-m form.
        project: (n, d) -> (n, V), run `chunk_rows` positions at a time (at least once per kind, also for
            none, as ZeRO-3's collectives need): with top_m set, never more than `chunk_rows` × V logits
            are held.
    """

    def in_chunks(rows_states, fields):
        chunks = rows_states.split(chunk_rows or max(len(rows_states), 1))
        parts = [fields(logits_of(chunk, project)) for chunk in chunks]
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    initiating_states, common_states = at_forget_positions(states, roles)
    with torch.no_grad():
        initiating = in_chunks(initiating_states, lambda logits: vars(initiating_targets(logits, top_k)))
        common = in_chunks(common_states, lambda logits: common_fields(logits, kl_direction, top_m))
    form = DenseReference if top_m is None else TopMReference
    return form(InitiatingTargets(**initiating), kl_direction, **common)
