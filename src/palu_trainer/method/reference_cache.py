"""Reference cache: the reference model's PALU targets for every forget row, computed once.

The forget set is fixed and the reference is the policy before its first step, so one pass of the
policy over the forget set yields everything PALU ever reads from the reference: no second model.
At a common position the cache keeps the reference's m most probable entries and their tail mass
(m + 1 numbers instead of |V|; see `losses.common_kl_loss_top_m` for the KL this gives and its error).
"""

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from palu_trainer.method.losses import ReferenceTargets, targets_from_selected
from palu_trainer.method.roles import TokenRole

logger = logging.getLogger(__name__)

CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INDEX_BYTES = 4  # vocabulary entries are stored as int32


def cache_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `reference_cache_dtype` setting."""
    if name not in CACHE_DTYPES:
        raise ValueError(f"reference_cache_dtype={name!r}; choose one of {', '.join(CACHE_DTYPES)}")
    return CACHE_DTYPES[name]


def estimated_cache_bytes(
    n_initiating: int, n_common: int, top_k: int, top_m: int, dtype: torch.dtype = torch.float32
) -> int:
    """Host bytes of the cache for a forget set, before building it (each rank holds all of it).

    Per initiating position: K int32 entries and the fp32 mean logit. Per common position: m int32
    entries, m probabilities in `dtype`, the fp32 tail mass and the fp32 constant of the KL.
    `top_m` is m as used (at most |V|).
    """
    probability_bytes = torch.finfo(dtype).bits // 8
    per_initiating = top_k * INDEX_BYTES + 4
    per_common = top_m * (INDEX_BYTES + probability_bytes) + 4 + 4
    return n_initiating * per_initiating + n_common * per_common


def count_positions(roles: Iterable[torch.Tensor]) -> tuple[int, int]:
    """Initiating and common positions (tokens t ≥ 1, predicted at t-1) over rows' roles (T,)."""
    initiating = common = 0
    for row_roles in roles:
        predicted = row_roles[1:]
        initiating += int((predicted == TokenRole.INITIATING).sum())
        common += int((predicted == TokenRole.COMMON).sum())
    return initiating, common


@dataclass
class ReferenceCache:
    """Per forget row (keyed by dataset index), on host memory.

    topk_indices[i]: (M_i, K) int32; logit_mean[i]: (M_i,) fp32; common_indices[i]: (C_i, m) int32;
    common_probs[i]: (C_i, m) in the cache dtype; common_tail_mass[i], common_neg_entropy[i]: (C_i,) fp32;
    rows in the order of the row's initiating / common positions.
    """

    topk_indices: dict[int, torch.Tensor]
    logit_mean: dict[int, torch.Tensor]
    common_indices: dict[int, torch.Tensor]
    common_probs: dict[int, torch.Tensor]
    common_tail_mass: dict[int, torch.Tensor]
    common_neg_entropy: dict[int, torch.Tensor]

    def tables(self) -> tuple[dict[int, torch.Tensor], ...]:
        return (
            self.topk_indices,
            self.logit_mean,
            self.common_indices,
            self.common_probs,
            self.common_tail_mass,
            self.common_neg_entropy,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for table in self.tables() for t in table.values())

    def targets(self, row_indices: Iterable[int], roles: torch.Tensor, device) -> ReferenceTargets:
        """The batch's targets, in the order `roles[roles == ROLE]` selects positions.

        Args:
            row_indices: (B,) dataset index of each batch row.
            roles: (B, T) roles of the batch's tokens, used to check the cache still fits it.
        """
        rows = [int(i) for i in row_indices]
        for row, row_roles in zip(rows, roles):
            expected = count_positions([row_roles])
            cached = (self.topk_indices[row].shape[0], self.common_probs[row].shape[0])
            if expected != cached:
                raise RuntimeError(
                    f"reference cache for forget row {row} holds {cached} initiating/common positions, the "
                    f"batch has {expected}: the forget data changed after the cache was built"
                )

        def stacked(table, dtype=None):
            return torch.cat([table[r] for r in rows]).to(device, dtype)

        return ReferenceTargets(
            topk_indices=stacked(self.topk_indices, torch.long),
            logit_mean=stacked(self.logit_mean),
            common_probs=stacked(self.common_probs, torch.float32),
            common_neg_entropy=stacked(self.common_neg_entropy),
            common_indices=stacked(self.common_indices, torch.long),
            common_tail_mass=stacked(self.common_tail_mass),
        )


def build_reference_cache(
    selected_logits: Callable[[dict], tuple[torch.Tensor, torch.Tensor]],
    batches: Iterable[dict],
    top_k: int,
    top_m: int,
    dtype: torch.dtype = torch.float32,
) -> ReferenceCache:
    """Run `selected_logits` over collated forget batches and keep each row's targets on the host.

    `selected_logits(batch)` gives the reference's logits at the batch's initiating (M, V) and common
    (C, V) positions, in row-major order (see `losses.forget_rows`). Each batch needs `input_ids`,
    `attention_mask`, `token_roles` and `index`. Called identically on every rank, so that ZeRO-3's
    collective forwards line up; each rank keeps the whole forget set. `top_k` is K as resolved against
    |V|; `top_m`: entries kept per common position; `dtype` stores their probabilities.
    """
    cache = ReferenceCache({}, {}, {}, {}, {}, {})
    with torch.no_grad():
        for batch in batches:
            targets = targets_from_selected(*selected_logits(batch), top_k, top_m)
            counts = [count_positions([row_roles]) for row_roles in batch["token_roles"]]
            initiating_parts = (targets.topk_indices, targets.logit_mean)
            common_parts = (
                targets.common_indices,
                targets.common_probs,
                targets.common_tail_mass,
                targets.common_neg_entropy,
            )
            split_initiating = [t.split([m for m, _ in counts]) for t in initiating_parts]
            split_common = [t.split([c for _, c in counts]) for t in common_parts]
            for row, index in enumerate(batch["index"].tolist()):
                cache.topk_indices[index] = split_initiating[0][row].to("cpu", torch.int32)
                cache.logit_mean[index] = split_initiating[1][row].cpu()
                cache.common_indices[index] = split_common[0][row].to("cpu", torch.int32)
                cache.common_probs[index] = split_common[1][row].to("cpu", dtype)
                cache.common_tail_mass[index] = split_common[2][row].cpu()
                cache.common_neg_entropy[index] = split_common[3][row].cpu()
    return cache


def describe(cache: ReferenceCache, top_k: int, dtype: torch.dtype) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    initiating = sum(t.shape[0] for t in cache.topk_indices.values())
    common = sum(t.shape[0] for t in cache.common_probs.values())
    top_m = next((t.shape[1] for t in cache.common_probs.values() if t.numel()), 0)
    tail = torch.cat(list(cache.common_tail_mass.values())) if cache.common_tail_mass else torch.zeros(0)
    tail_text = f"tail mass mean {tail.mean():.2e}, max {tail.max():.2e}" if tail.numel() else "no tail"
    return (
        f"reference cache: {len(cache.topk_indices)} forget rows, {initiating} initiating positions x "
        f"K={top_k} int32, {common} common positions x top m={top_m} int32 + {dtype_name} and a tail "
        f"bucket ({tail_text}): {cache.nbytes / 2**20:.1f} MiB of host memory; no reference model is kept"
    )
