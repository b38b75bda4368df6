"""Reference cache: the reference model's PALU targets for every forget row, computed once.

The forget set is fixed and the reference is the policy before its first step, so one pass of the
policy over the forget set yields everything PALU ever reads from the reference: no second model.
"""

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from palu_trainer.method.losses import ReferenceTargets, reference_targets
from palu_trainer.method.roles import TokenRole

logger = logging.getLogger(__name__)

CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cache_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `reference_cache_dtype` setting."""
    if name not in CACHE_DTYPES:
        raise ValueError(f"reference_cache_dtype={name!r}; choose one of {', '.join(CACHE_DTYPES)}")
    return CACHE_DTYPES[name]


@dataclass
class ReferenceCache:
    """Per forget row (keyed by dataset index), on host memory.

    topk_indices[i]: (M_i, K) int32; logit_mean[i]: (M_i,) fp32; common_probs[i]: (C_i, V) in the cache
    dtype; common_neg_entropy[i]: (C_i,) fp32; rows in the order of the row's initiating / common positions.
    """

    topk_indices: dict[int, torch.Tensor]
    logit_mean: dict[int, torch.Tensor]
    common_probs: dict[int, torch.Tensor]
    common_neg_entropy: dict[int, torch.Tensor]

    @property
    def nbytes(self) -> int:
        tables = (self.topk_indices, self.logit_mean, self.common_probs, self.common_neg_entropy)
        return sum(t.numel() * t.element_size() for table in tables for t in table.values())

    def targets(self, row_indices: Iterable[int], roles: torch.Tensor, device) -> ReferenceTargets:
        """The batch's targets, in the order `roles[roles == ROLE]` selects positions.

        Args:
            row_indices: (B,) dataset index of each batch row.
            roles: (B, T) roles of the batch's tokens, used to check the cache still fits it.
        """
        rows = [int(i) for i in row_indices]
        for row, row_roles in zip(rows, roles[:, 1:]):
            expected = (
                int((row_roles == TokenRole.INITIATING).sum()),
                int((row_roles == TokenRole.COMMON).sum()),
            )
            cached = (self.topk_indices[row].shape[0], self.common_probs[row].shape[0])
            if expected != cached:
                raise RuntimeError(
                    f"reference cache for forget row {row} holds {cached} initiating/common positions, the "
                    f"batch has {expected}: the forget data changed after the cache was built"
                )
        return ReferenceTargets(
            topk_indices=torch.cat([self.topk_indices[r] for r in rows]).to(device, torch.long),
            logit_mean=torch.cat([self.logit_mean[r] for r in rows]).to(device),
            common_probs=torch.cat([self.common_probs[r] for r in rows]).to(device, torch.float32),
            common_neg_entropy=torch.cat([self.common_neg_entropy[r] for r in rows]).to(device),
        )


def build_reference_cache(
    forward: Callable[[dict], torch.Tensor],
    batches: Iterable[dict],
    top_k: int,
    dtype: torch.dtype = torch.float32,
) -> ReferenceCache:
    """Run `forward` (input_ids, attention_mask → (B, T, V) logits) over collated forget batches.

    Each batch needs `input_ids`, `attention_mask`, `token_roles` and `index`. Called identically on
    every rank, so that ZeRO-3's collective forwards line up; each rank keeps the whole forget set.
    `top_k` is K as resolved against |V|; `dtype` stores the probabilities (see `cache_dtype`).
    """
    cache = ReferenceCache({}, {}, {}, {})
    with torch.no_grad():
        for batch in batches:
            logits = forward({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
            for row, (row_logits, row_roles) in enumerate(zip(logits, batch["token_roles"])):
                targets = reference_targets(row_logits[None], row_roles[None], top_k)
                index = int(batch["index"][row])
                cache.topk_indices[index] = targets.topk_indices.to("cpu", torch.int32)
                cache.logit_mean[index] = targets.logit_mean.cpu()
                cache.common_probs[index] = targets.common_probs.to("cpu", dtype)
                cache.common_neg_entropy[index] = targets.common_neg_entropy.cpu()
    return cache


def estimated_nbytes(roles: Iterable[torch.Tensor], top_k: int, vocab_size: int, dtype: torch.dtype) -> int:
    """Host bytes `build_reference_cache` would hold for forget rows with these (T,) role tensors.

    Per common position: V probabilities in `dtype` and one fp32 entropy; per initiating position: K int32
    indices and one fp32 mean. Counted before anything is built, from the roles alone.
    """
    common = initiating = 0
    for row_roles in roles:
        common += int((row_roles[1:] == TokenRole.COMMON).sum())
        initiating += int((row_roles[1:] == TokenRole.INITIATING).sum())
    item_size = torch.empty((), dtype=dtype).element_size()
    return common * (vocab_size * item_size + 4) + initiating * (top_k * 4 + 4)


def describe(cache: ReferenceCache, top_k: int, dtype: torch.dtype) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    initiating = sum(t.shape[0] for t in cache.topk_indices.values())
    common = sum(t.shape[0] for t in cache.common_probs.values())
    vocab = next((t.shape[1] for t in cache.common_probs.values() if t.numel()), 0)
    return (
        f"reference cache: {len(cache.topk_indices)} forget rows, {initiating} initiating positions x "
        f"K={top_k} int32, {common} common positions x V={vocab} {dtype_name}: "
        f"{cache.nbytes / 2**20:.1f} MiB of host memory; no reference model is kept"
    )
