"""The one table of benchmarks (TOFU, MUSE) that the miniature and the GPU recipe run, as `methods.py` is for
methods: their hub datasets and local mirrors, splits, experiment configs, evaluation files and scorecards.
"""

from dataclasses import dataclass

from palu_trainer.experiments import report
from palu_trainer.experiments.methods import METHODS
from palu_trainer.framework.local_mirrors import LOCAL_MIRRORS


def tofu_splits(forget_percent: int) -> tuple[str, str, str]:
    """TOFU's forget, retain and holdout configs for forgetting `forget_percent`% of its authors."""
    return f"forget{forget_percent:02d}", f"retain{100 - forget_percent:02d}", f"holdout{forget_percent:02d}"


@dataclass(frozen=True, kw_only=True)
class BenchmarkFacts:
    """How the framework runs one benchmark."""

    # as plans and reports call it, and the prefix of its evaluator's file (`TOFU_EVAL.json`); lowercased, the
    # folder of its experiment configs (`eval/tofu/default`)
    name: str
    hub_id: str  # its dataset on the hub; `{subset}` stands for the subset's name
    # subset (the recipe's `--forget` on TOFU, `--split` on MUSE) -> its forget, retain and holdout splits
    splits: dict[str, tuple[str, str, str]]
    scorecard: report.Scorecard  # what the report reads of the evaluation's file, selects by and plots

    @property
    def eval_experiment(self) -> str:  # the framework's stock evaluation
        return f"eval/{self.name.lower()}/default"

    @property
    def eval_file(self) -> str:  # what the evaluator writes to the evaluation's output folder
        return f"{self.name}_EVAL.json"

    def method_overrides(self, name: str) -> list[str]:
        """Experiment and trainer overrides of method `name` here; spans and idk answers are the caller's."""
        method = METHODS[name]
        experiment = method.tofu_experiment if self.name == "TOFU" else method.muse_experiment
        if experiment is None:
            raise ValueError(f"{name} has no MUSE experiment in this plugin (experiments/methods.py)")
        return [f"experiment={experiment}", f"trainer={method.trainer}", *method.trainer_overrides]

    def hub(self, subset: str) -> str:
        return self.hub_id.format(subset=subset)

    def mirror_variable(self, subset: str) -> str | None:
        """The environment variable that points this subset's hub dataset at a local folder, if one does."""
        return LOCAL_MIRRORS.get(self.hub(subset))


TOFU = BenchmarkFacts(
    name="TOFU",
    hub_id="locuslab/TOFU",
    splits={f"{percent:02d}": tofu_splits(percent) for percent in (1, 5, 10)},
    scorecard=report.TOFU,
)
MUSE = BenchmarkFacts(
    name="MUSE",
    hub_id="muse-bench/MUSE-{subset}",
    splits={corpus: ("forget", "retain1", "holdout") for corpus in ("News", "Books")},
    scorecard=report.MUSE,
)
BENCHMARKS = {"tofu": TOFU, "muse": MUSE}
# What experiment=unlearn/muse/* and eval=muse load: config -> splits
MUSE_LOADS = {
    "raw": ("forget", "retain1"),
    "verbmem": ("forget",),
    "knowmem": ("forget_qa", "retain_qa", "forget_qa_icl", "retain_qa_icl"),
    "privleak": ("forget", "holdout"),
}
