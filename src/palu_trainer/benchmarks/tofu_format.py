"""A local benchmark in TOFU's format: which configs of a dataset folder play which part."""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TofuBenchmark:
    """A local TOFU-format folder (see `hf_dir`), its forget/retain/holdout configs and forget spans."""

    tofu_dir: Path
    forget_split: str
    retain_split: str
    holdout_split: str
    span_annotations: Path
    max_new_tokens: int
    description: str
