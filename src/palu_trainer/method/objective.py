"""PALU's objective, one object owning its settings. Shapes: B batch, T sequence length, d the width of the
states it is handed (the final hidden size, or V when they are logits and `project` is None)."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from palu_trainer.method.chunking import AS_NEEDED, ProjectionCalls, mean_over_chunks
from palu_trainer.method.local_loss import local_entropy_loss
from palu_trainer.method.reference import ModelReference, Reference, reference_targets
from palu_trainer.method.roles import at_forget_positions, flat_rows, label_positions


def check_kl_weight(kl_weight):
    """λ: a number >= 0, or `alpha` (the released code: the KL is weighted by alpha, outside gamma)."""
    number = isinstance(kl_weight, int | float) and not isinstance(kl_weight, bool)
    if kl_weight != "alpha" and not (number and math.isfinite(kl_weight) and kl_weight >= 0):
        raise ValueError(
            "must be a number >= 0 (λ, the weight of the KL on common tokens) or `alpha` (the released "
            "code's tie of the KL weight to the retain weight)"
        )
    return kl_weight


@dataclass
class PALUTerms:
    """One batch's terms as computed (fp32 scalars, for the log) and `weighted`, the summands of the loss."""

    local: torch.Tensor
    kl: torch.Tensor
    retain: torch.Tensor
    weighted: dict[str, torch.Tensor]

    @property
    def loss(self) -> torch.Tensor:
        return sum(self.weighted.values())


@dataclass(frozen=True)
class PALUObjective:
    """loss = gamma·(local + λ·KL) + alpha·retain; with kl_weight `alpha` (the released code),
    gamma·local + alpha·KL + alpha·retain.

    top_k: K, resolved (`local_loss.resolve_top_k`). chunk_rows: positions projected at once
    (`chunking.logit_chunk_rows`); None: all at once. The other fields: `PALUOptions`' of the same name, whose
    defaults and checks they are (`PALUOptions.objective` builds this object).
    """

    top_k: int
    target: str
    target_gradient: bool
    kl_direction: str
    kl_weight: float | str
    local_loss_scale: str
    gamma: float
    alpha: float
    chunk_rows: int | None = None

    def reference(self, states, roles, project=None, top_m=None) -> Reference:
        """The reference's targets for a batch, computed now (`reference.reference_targets`)."""
        return reference_targets(
            states, roles, self.top_k, self.kl_direction, top_m, project, self.chunk_rows
        )

    def model_reference(self, states, roles, project=None) -> ModelReference:
        """The reference model's targets, projected inside the loss's chunks (see `ModelReference`)."""
        return ModelReference(*at_forget_positions(states, roles), project, self.top_k, self.kl_direction)

    def forget_terms(
        self,
        states: torch.Tensor,
        project: Callable | None,
        roles: torch.Tensor,
        reference: Reference,
        calls: ProjectionCalls = AS_NEEDED,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(local, KL) of one forget batch, fp32 scalars; redundant tokens contribute nothing.

        states: (B, T, d), unshifted: position t-1 predicts token t; roles: (B, T) their TokenRole. project:
        (n, d) -> (n, V), run only at the initiating and common positions, `chunk_rows` at a time; None:
        `states` are logits.
        """

        def local_rows(logits, rows):
            targets = reference.initiating(rows)
            scale = targets.topk_spread if self.local_loss_scale == "reference" else None
            return local_entropy_loss(
                logits,
                targets.topk_indices,
                self.target,
                targets.logit_mean,
                target_gradient=self.target_gradient,
                scale=scale,
            )

        initiating, common = at_forget_positions(states, roles)
        local = mean_over_chunks(
            initiating, project, local_rows, self.chunk_rows, calls.initiating, calls.recompute
        )
        kl = mean_over_chunks(common, project, reference.kl, self.chunk_rows, calls.common, calls.recompute)
        return local, kl

    def retain_nll(
        self,
        states: torch.Tensor,
        project: Callable | None,
        labels: torch.Tensor,
        calls: ProjectionCalls = AS_NEEDED,
    ) -> torch.Tensor:
        """Mean next-token NLL over label positions (`model(labels=...).loss`), projecting only the positions
        that predict a label; labels (B, T), -100 where none, unshifted. Exactly 0 when no label."""
        rows = label_positions(labels)
        targets = labels[:, 1:][rows[:, 0], rows[:, 1]]
        flat = flat_rows(states, rows[:, 0] * labels.shape[1] + rows[:, 1])

        def mean_nll(logits, rows):
            return F.cross_entropy(logits, targets[rows]) if len(logits) else logits.new_zeros(())

        return mean_over_chunks(flat, project, mean_nll, self.chunk_rows, calls.retain, calls.recompute)

    def weigh(self, local: torch.Tensor, kl: torch.Tensor, retain: torch.Tensor) -> PALUTerms:
        kl_factor = self.alpha if self.kl_weight == "alpha" else self.gamma * self.kl_weight
        weighted = {"local": self.gamma * local, "kl": kl_factor * kl, "retain": self.alpha * retain}
        return PALUTerms(local, kl, retain, weighted)


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
