"""Reference cache: the reference model's PALU targets for every forget row, computed once.

The forget set is fixed and the reference is the policy before its first step, so one pass of the
policy over the forget set yields everything PALU ever reads from the reference: no second model.
"""

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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

    topk_indices[i]: (M_i, K) int32; logit_mean[i]: (M_i,) fp32; rows in the order of the row's initiating /
    common positions. For KL(P_ref ‖ P_θ): common_probs[i] (C_i, V) in the cache dtype and
    common_neg_entropy[i] (C_i,) fp32; for KL(P_θ ‖ P_ref): common_log_probs[i] (C_i, V) in the cache dtype
    (log P_ref itself, so probabilities that underflow to 0 keep their exact log). Unused tables are empty.
    """

    topk_indices: dict[int, torch.Tensor] = field(default_factory=dict)
    logit_mean: dict[int, torch.Tensor] = field(default_factory=dict)
    common_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    common_neg_entropy: dict[int, torch.Tensor] = field(default_factory=dict)
    common_log_probs: dict[int, torch.Tensor] = field(default_factory=dict)

    def _tables(self) -> dict[str, dict[int, torch.Tensor]]:
        return {name: table for name, table in vars(self).items() if table}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for table in self._tables().values() for t in table.values())

    def common_rows(self) -> dict[int, torch.Tensor]:
        return self.common_log_probs or self.common_probs

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
            cached = (self.topk_indices[row].shape[0], self.common_rows()[row].shape[0])
            if expected != cached:
                raise RuntimeError(
                    f"reference cache for forget row {row} holds {cached} initiating/common positions, the "
                    f"batch has {expected}: the forget data changed after the cache was built"
                )
        dtypes = {
            "topk_indices": torch.long,
            "common_probs": torch.float32,
            "common_log_probs": torch.float32,
        }
        return ReferenceTargets(
            **{
                name: torch.cat([table[r] for r in rows]).to(device, dtypes.get(name))
                for name, table in self._tables().items()
            }
        )


def build_reference_cache(
    forward: Callable[[dict], torch.Tensor],
    batches: Iterable[dict],
    top_k: int,
    dtype: torch.dtype = torch.float32,
    kl_direction: str = "ref_to_policy",
) -> ReferenceCache:
    """Run `forward` (input_ids, attention_mask → (B, T, V) logits) over collated forget batches.

    Each batch needs `input_ids`, `attention_mask`, `token_roles` and `index`. Called identically on
    every rank, so that ZeRO-3's collective forwards line up; each rank keeps the whole forget set.
    `top_k` is K as resolved against |V|; `dtype` stores the (log) probabilities (see `cache_dtype`);
    `kl_direction` picks what is kept on common positions (see `ReferenceCache`).
    """
    cache = ReferenceCache()
    dtypes = {"topk_indices": torch.int32, "common_probs": dtype, "common_log_probs": dtype}
    with torch.no_grad():
        for batch in batches:
            logits = forward({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
            for row, (row_logits, row_roles) in enumerate(zip(logits, batch["token_roles"])):
                targets = reference_targets(row_logits[None], row_roles[None], top_k, kl_direction)
                index = int(batch["index"][row])
                for name, value in vars(targets).items():
                    if value is not None:
                        getattr(cache, name)[index] = value.to("cpu", dtypes.get(name))
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
    common = sum(t.shape[0] for t in cache.common_rows().values())
    vocab = next((t.shape[1] for t in cache.common_rows().values() if t.numel()), 0)
    return (
        f"reference cache: {len(cache.topk_indices)} forget rows, {initiating} initiating positions x "
        f"K={top_k} int32, {common} common positions x V={vocab} {dtype_name}: "
        f"{cache.nbytes / 2**20:.1f} MiB of host memory; no reference model is kept"
    )
