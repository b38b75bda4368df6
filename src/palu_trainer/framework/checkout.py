"""Ground floor: where open-unlearning's checkout is, and putting its `src/` on sys.path.

open-unlearning is not a package: its `src/` holds top-level modules (`data`, `trainer`, `train`…)
that its scripts import after Python puts `src/` on the path. Everything that imports them calls
`ensure_importable()` first; this module itself imports nothing of the framework.
"""

import os
import sys
from pathlib import Path

PINNED_COMMIT = "d3d7cf9e6b3c125d16687d4232680d8d83548f1a"
PROJECT_ROOT = Path(__file__).resolve().parents[3]
CONFIG_DIR = PROJECT_ROOT / "configs"
# Where `make setup` records the checkout it used, per Python environment.
CHECKOUT_RECORD = Path(sys.prefix) / "etc" / "palu_trainer" / "open-unlearning-dir"
DEFAULT_CHECKOUT = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "palu-trainer" / "open-unlearning"
)


def checkout_dir() -> Path:
    """OPEN_UNLEARNING_DIR, else the checkout `make setup` recorded, else the default cache dir."""
    if os.environ.get("OPEN_UNLEARNING_DIR"):
        return Path(os.environ["OPEN_UNLEARNING_DIR"]).expanduser().resolve()
    if CHECKOUT_RECORD.is_file():
        return Path(CHECKOUT_RECORD.read_text().strip())
    return DEFAULT_CHECKOUT


def ensure_importable() -> Path:
    """Put the checkout's `src/` on sys.path (as its scripts do) and return that directory."""
    src = checkout_dir() / "src"
    if not (src / "trainer" / "unlearn" / "base.py").is_file():
        raise RuntimeError(
            f"open-unlearning not found at {src.parent}. Run `make setup`, or set "
            "OPEN_UNLEARNING_DIR to a checkout of https://github.com/locuslab/open-unlearning "
            f"(commit {PINNED_COMMIT})."
        )
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    return src
