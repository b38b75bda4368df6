"""Ground floor: where open-unlearning's checkout is, and putting its `src/` on sys.path. open-unlearning is
not a package: its scripts import `src/`'s top-level modules (`data`, `trainer`, `train`…) with `src/` on the
path, so whatever imports them calls `ensure_importable()` first. This module imports none of them."""

import os
import sys
from pathlib import Path

TESTED_COMMITS = {
    "d3d7cf9": "transformers 4.45.1",
    "4ad738a": "transformers 4.51.3 (upstream main after its PR #175)",
    "c3301d8": "transformers 5.5.4 (its PR #191)",
}
# configs/ and span_annotations/: in a wheel, copies inside the package; in a clone, links to the repo's
# top-level folders (setup.cfg's package_data). Not resolved, so that both read through the package.
RESOURCES_DIR = Path(__file__).parents[1] / "resources"
CONFIG_DIR = RESOURCES_DIR / "configs"
# The clone's root, for the lab (results/, ../shared): meaningless in an installed wheel.
PROJECT_ROOT = Path(__file__).resolve().parents[3]
# Where `make setup` records the checkout it used, per Python environment.
CHECKOUT_RECORD = Path(sys.prefix) / "etc" / "palu_trainer" / "open-unlearning-dir"
DEFAULT_CHECKOUT = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "palu-trainer" / "open-unlearning"
)


def is_checkout(path: Path) -> bool:
    return (path / "src" / "trainer" / "unlearn" / "base.py").is_file()


def checkout_choice() -> tuple[Path, str]:
    """The open-unlearning checkout to import, and why it is that one: OPEN_UNLEARNING_DIR; else the one whose
    modules the running framework script (`src/train.py`, `src/eval.py`) imported already; else the
    checkout `make setup` recorded for this environment; else the working directory when it is a checkout
    and no other was chosen (the framework's own environment, the plugin installed into it); else the
    default cache dir. A checkout in the working directory never overrides a chosen one."""
    if os.environ.get("OPEN_UNLEARNING_DIR"):
        return Path(os.environ["OPEN_UNLEARNING_DIR"]).expanduser().resolve(), "OPEN_UNLEARNING_DIR"
    running = getattr(sys.modules.get("trainer"), "__file__", None)
    if running and is_checkout(Path(running).resolve().parents[2]):
        return Path(running).resolve().parents[2], "the running framework script's"
    if CHECKOUT_RECORD.is_file():
        return Path(CHECKOUT_RECORD.read_text().strip()), f"recorded by make setup in {CHECKOUT_RECORD}"
    if is_checkout(Path.cwd()):
        return Path.cwd().resolve(), "the working directory (no OPEN_UNLEARNING_DIR, none recorded)"
    return DEFAULT_CHECKOUT, "the default"


def checkout_dir() -> Path:
    return checkout_choice()[0]


_imported: list[tuple[Path, str]] = []  # the first `ensure_importable`'s checkout and why


def imported_checkout() -> tuple[Path, str]:
    """The checkout this process imports the framework from, and why (`checkout_choice` when it was made)."""
    return _imported[0] if _imported else checkout_choice()


def ensure_importable() -> Path:
    """Put the checkout's `src/` on sys.path (as its scripts do) and return that directory."""
    checkout, why = checkout_choice()
    src = checkout / "src"
    if not _imported:
        _imported.append((checkout, why))
    if not is_checkout(src.parent):
        tested = ", ".join(f"{commit} with {stack}" for commit, stack in TESTED_COMMITS.items())
        raise RuntimeError(
            f"open-unlearning not found at {src.parent}. Run `make setup`, run from your open-unlearning "
            "checkout, or set OPEN_UNLEARNING_DIR to a checkout of "
            f"https://github.com/locuslab/open-unlearning (tested: {tested})."
        )
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    return src
