"""The reference model's PALU targets for every forget row, computed once: the forget set is fixed and the
reference is the policy before its first step, so one pass of the policy over the forget set yields all PALU
ever reads from the reference (no second model). A common position keeps the reference's m most probable
entries and their tail mass (`reference.TopMReference`): about m + 1 numbers instead of |V|.
"""

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from palu_trainer.method.reference import InitiatingTargets, TopMReference
from palu_trainer.method.roles import TokenRole

CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INDEX_BYTES = 4  # vocabulary entries are kept as int32
PARTS = ("initiating", "common")


@dataclass
class ReferenceCache:
    """The reference's `TopMReference` of every forget row (keyed by dataset index), on host memory.

    initiating[name][i], common[name][i]: row i's `InitiatingTargets` / `TopMReference` field `name` at its
    initiating / common positions, in their order; vocabulary entries int32, `common` in the cache dtype
    (log P_ref for `policy_to_ref`, so that probabilities that underflow to 0 keep their exact log), the
    rest fp32.
    """

    kl_direction: str
    initiating: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    common: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tables = [*self.initiating.values(), *self.common.values()]
        return sum(t.numel() * t.element_size() for table in tables for t in table.values())

    def targets(self, row_indices: Iterable[int], roles: torch.Tensor, device) -> TopMReference:
        """The batch's targets, in the order `roles[roles == ROLE]` selects positions: row_indices (B,) the
        dataset index of each batch row; roles (B, T), which the cache must still fit."""
        rows = [int(i) for i in row_indices]
        for row, row_roles in zip(rows, roles):
            expected = count_positions([row_roles])
            cached = (self.initiating["topk_indices"][row].shape[0], self.common["indices"][row].shape[0])
            if expected != cached:
                raise RuntimeError(
                    f"reference cache for forget row {row} holds {cached} initiating/common positions, the "
                    f"batch has {expected}: the forget data changed after the cache was built"
                )
        dtypes = {"topk_indices": torch.long, "indices": torch.long, "common": torch.float32}

        def batch(tables):
            return {
                name: torch.cat([table[r] for r in rows]).to(device, dtypes.get(name))
                for name, table in tables.items()
            }

        return TopMReference(
            InitiatingTargets(**batch(self.initiating)), self.kl_direction, **batch(self.common)
        )

    def save(self, path: Path, settings: Mapping[str, str]) -> None:
        """Write the cache to `path` as safetensors (no pickle), with the `settings` that produced it."""
        from safetensors.torch import save_file

        tensors = {
            f"{part}/{name}/{row}": tensor.contiguous()
            for part in PARTS
            for name, table in getattr(self, part).items()
            for row, tensor in table.items()
        }
        metadata = {"kl_direction": self.kl_direction, "settings": json.dumps(dict(settings), sort_keys=True)}
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: Path) -> tuple["ReferenceCache", dict[str, str]]:
        """The cache `save` wrote to `path`, and the settings it was saved with."""
        from safetensors import safe_open

        with safe_open(str(path), "pt") as file:
            metadata = file.metadata()
            cache = cls(metadata["kl_direction"])
            for key in file.keys():
                part, name, row = key.split("/")
                getattr(cache, part).setdefault(name, {})[int(row)] = file.get_tensor(key)
        return cache, json.loads(metadata["settings"])


def build_reference_cache(
    batch_targets: Callable[[dict], TopMReference],
    batches: Iterable[dict],
    dtype: torch.dtype = torch.float32,
) -> ReferenceCache:
    """Run `batch_targets` (the reference's targets at the batch's initiating and common positions, in
    row-major order) over collated forget batches (`input_ids`, `attention_mask`, `token_roles`, `index`) and
    keep each row's targets on the host, the (log) probabilities in `dtype`. Called identically on every
    rank, so that ZeRO-3's collective forwards line up; each rank keeps the whole forget set.
    """
    cache = None
    dtypes = {"topk_indices": torch.int32, "indices": torch.int32, "common": dtype}
    with torch.no_grad():
        for batch in batches:
            targets = batch_targets(batch)
            cache = cache or ReferenceCache(targets.kl_direction)
            sizes = zip(*(count_positions([row_roles]) for row_roles in batch["token_roles"]))
            fields = (vars(targets.initiating_targets), vars(targets))
            for tables, values, part_sizes in zip((cache.initiating, cache.common), fields, sizes):
                for name, value in values.items():
                    if isinstance(value, torch.Tensor):  # not kl_direction, initiating_targets or None
                        table = tables.setdefault(name, {})
                        for index, part in zip(batch["index"].tolist(), value.split(list(part_sizes))):
                            table[index] = part.to("cpu", dtypes.get(name))
    if cache is None:
        raise ValueError("the reference cache needs at least one forget batch")
    return cache


def count_positions(roles: Iterable[torch.Tensor]) -> tuple[int, int]:
    """Initiating and common positions (tokens t ≥ 1, predicted at t-1) over rows' roles (T,)."""
    predicted = [row_roles[1:] for row_roles in roles]
    return tuple(
        sum(int((p == role).sum()) for p in predicted) for role in (TokenRole.INITIATING, TokenRole.COMMON)
    )


def estimated_nbytes(
    initiating: int,
    common: int,
    top_k: int,
    top_m: int,
    dtype: torch.dtype,
    kl_direction: str = "ref_to_policy",
) -> int:
    """Host bytes `build_reference_cache` would hold for this many initiating and common positions (see
    `count_positions`), known before anything is built. Per initiating position: K int32 indices, an fp32
    mean and an fp32 spread. Per common position: m int32 entries and their (log) probabilities in `dtype`,
    plus the fp32 tail mass and KL constant (ref_to_policy) or the fp32 log tail mass (policy_to_ref).
    """
    item_size = torch.empty((), dtype=dtype).element_size()
    per_common = top_m * (INDEX_BYTES + item_size) + (4 if kl_direction == "policy_to_ref" else 8)
    return common * per_common + initiating * (top_k * INDEX_BYTES + 8)


def describe(cache: ReferenceCache, top_k: int, dtype: torch.dtype) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    initiating = sum(t.shape[0] for t in cache.initiating["topk_indices"].values())
    common = sum(t.shape[0] for t in cache.common["indices"].values())
    top_m = next((t.shape[1] for t in cache.common["indices"].values() if t.numel()), 0)
    tail = torch.cat(list(cache.common["tail"].values()) or [torch.zeros(0)])
    if cache.kl_direction == "policy_to_ref":
        tail = tail.exp()
    tail_text = (
        f"P_ref's tail mass mean {tail.mean():.2e}, max {tail.max():.2e}" if tail.numel() else "no tail"
    )
    return (
        f"reference cache: {len(cache.initiating['topk_indices'])} forget rows, {initiating} initiating "
        f"positions x K={top_k} int32, {common} common positions x top m={top_m} int32 + {dtype_name} and a "
        f"tail bucket ({tail_text}): {cache.nbytes / 2**20:.1f} MiB of host memory; no reference model is "
        "kept"
    )
