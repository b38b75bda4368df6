"""`palu-recipe kit DIR`: PALU's and TPO's contribution folders in open-unlearning's format
(`community/methods/<NAME>/README.md` and `run.sh`, as its contributing guide asks) written into a framework
checkout DIR. Its `results.md` (package data, so the kit works from the wheel) is the measured real-model
table of this project's docs/results.md, with its model, commits and dates, told without reference to the
rest of that page; `run.sh` calls the framework's own `src/train.py` and `src/eval.py`,
with the plugin installed."""

import sys
from pathlib import Path
from types import SimpleNamespace

import yaml

from palu_trainer.framework.checkout import RESOURCES_DIR

KIT_DIR = RESOURCES_DIR / "kit"  # templates: README.md, run.sh, results.md, <name>.bib, contributions.yaml


def contributions() -> list[SimpleNamespace]:
    """One per method folder, from the kit's contributions.yaml (its keys as attributes; `best`: the learning
    rate and knob value of run.sh's final stage, the trainer config's and the framework's defaults)."""
    return [
        SimpleNamespace(**entry) for entry in yaml.safe_load((KIT_DIR / "contributions.yaml").read_text())
    ]


def measured_results() -> str:
    """The measured table and how it was made (`results.md`)."""
    return (KIT_DIR / "results.md").read_text()


def write_kit(checkout: Path) -> list[Path]:
    """Write `community/methods/{PALU,TPO}/` into the framework checkout `checkout`; returns the files."""
    if not (checkout / "src" / "train.py").is_file():
        raise FileNotFoundError(f"{checkout} is not an open-unlearning checkout (no src/train.py)")
    results = measured_results()
    written = []
    for contribution in contributions():
        folder = checkout / "community" / "methods" / contribution.name
        folder.mkdir(parents=True, exist_ok=True)
        fields = {  # what the templates README.md and run.sh name
            "contribution": contribution,
            "links": "\n".join(f"- {link}" for link in contribution.links),
            "results": results,
            "bibtex": (KIT_DIR / f"{contribution.name}.bib").read_text().strip(),
            "knob_grid": " ".join(contribution.knob_grid),
            "learning_rates": " ".join(contribution.learning_rates),
        }
        for name in ("README.md", "run.sh"):
            (folder / name).write_text((KIT_DIR / name).read_text().format(**fields))
            written.append(folder / name)
        (folder / "run.sh").chmod(0o755)
    return written


def write_kit_into(checkout: Path) -> None:
    """`palu-recipe kit DIR`: the kit written into `checkout`, each file's path printed; exit 1 naming a
    folder that is not a framework checkout."""
    try:
        written = write_kit(checkout)
    except FileNotFoundError as error:
        sys.exit(f"palu-recipe kit: {error}")
    for path in written:
        print(path)
