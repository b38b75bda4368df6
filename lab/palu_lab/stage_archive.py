"""Finished stages kept small enough for git, so that a long experiment continues on another machine.

The stage cache (`miniature.Stages.run_cached_stage`) lives in `results/.cache`, which a new machine does not
have. `StageArchive` copies what a finished stage's readers need out of it (its marker, the unlearning run's
`trainer_state.json`, an evaluation's aggregate values; a reference evaluation whole, since the forget
quality of every later evaluation reads its per-row truth ratios) into a folder that is committed, and puts
it back into an empty cache. Weights are never archived: the finetuned Original and Retain are made again
from their recipe on each machine, and every stage that reads them is keyed by that recipe, not by their
bytes, which differ between CPUs. Each archived stage records the digest of the Original it unlearned
(`origin.json`, with the commit that ran it), so that a report can say how many Originals and commits its
runs came from.
"""

import json
import shutil
from pathlib import Path

MARKER = "demo_stage.json"
ORIGIN = "origin.json"
EVAL_FILES = ("TOFU_EVAL.json", "MUSE_EVAL.json")
KEPT_FILES = ("trainer_state.json", *EVAL_FILES)


class StageArchive:
    """The archive folder `folder` of the stage cache `cache_dir`."""

    def __init__(self, folder: Path, cache_dir: Path):
        self.folder, self.cache_dir = folder, cache_dir

    def restore(self) -> int:
        """Copy every archived stage that the cache lacks into it; returns how many."""
        restored = 0
        for stage in sorted(self.folder.glob("*/" + MARKER)):
            target = self.cache_dir / stage.parent.name
            if (target / MARKER).is_file():
                continue
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(stage.parent, target)
            restored += 1
        return restored

    def keep(self, stage_dir: Path, origin: dict, aggregates_only: bool = True) -> None:
        """Archive the finished stage `stage_dir` (a folder of the cache) with its `origin`; evaluation files
        reduced to their aggregate values unless `aggregates_only` is false."""
        if not (stage_dir / MARKER).is_file():
            raise ValueError(f"{stage_dir} is not a finished stage (no {MARKER})")
        target = self.folder / stage_dir.name
        if (target / MARKER).is_file():
            return  # archived by the session that made it, whose origin it keeps
        target.mkdir(parents=True, exist_ok=True)
        for name in (*KEPT_FILES, MARKER):  # the marker last: a stage copied halfway is not finished
            source = stage_dir / name
            if not source.is_file():
                continue
            if name in EVAL_FILES and aggregates_only:
                logs = json.loads(source.read_text())
                reduced = {
                    key: {"agg_value": value.get("agg_value") if isinstance(value, dict) else value}
                    for key, value in logs.items()
                }
                (target / name).write_text(json.dumps(reduced, indent=1) + "\n")
            else:
                shutil.copyfile(source, target / name)
        (target / ORIGIN).write_text(json.dumps(origin, indent=1) + "\n")

    def origins(self, field: str = "original") -> dict[str, int]:
        """Archived unlearning runs per value of their origin's `field` (Original's digest, the commit)."""
        counts: dict[str, int] = {}
        for path in sorted(self.folder.glob("unlearn-*/" + ORIGIN)):
            value = json.loads(path.read_text()).get(field, "unknown")
            counts[value] = counts.get(value, 0) + 1
        return counts


def this_machine() -> str:
    """The CPU's model name (its rounding is what makes a finetuned Original differ between machines)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
