"""The one table of unlearning methods that the demo, the GPU recipe and the bench run side by side: adding a
method to them is one entry here (plus, for a new trainer, its module and config). Which of them the lab's
experiments and measurements run: lab/palu_lab/method_lists.py."""

from dataclasses import dataclass

import numpy


@dataclass(frozen=True)
class Knob:
    """A method's own hyperparameter that the equal-budget grid tunes besides the learning rate."""

    name: str  # as the report lists it
    key: str  # the Hydra override that sets it
    values: tuple[float, ...]  # the grid, its stock value included


@dataclass(frozen=True)
class Method:
    """How the side-by-side runs one method."""

    trainer: str  # the trainer config (`trainer=<name>`), the framework's own or this plugin's
    tofu_experiment: str = "unlearn/tofu/default"
    uses_spans: bool = False  # its forget set reads span annotations (`span_annotations=<file>`)
    # its forget set pairs each answer with an "I don't know" answer from a JSON lines file of strings
    # (`idk_path=<file>`; experiment unlearn/tofu/idk_local)
    uses_idk_answers: bool = False
    trainer_overrides: tuple[str, ...] = ()  # a required `method_args` value, a recipe's settings
    kl_weight_key: str | None = None  # the override that sets its λ (`make tofu LAMBDA=`, `make tofu-sweep`)
    side_by_side: bool = True  # run by `make demo` and `make compare` unless `--methods` names others
    muse_experiment: str | None = "unlearn/muse/default"  # None: not offered on MUSE here
    # its own hyperparameter in the equal-budget grid (learning rates x knob values); None: it has none
    # besides the learning rate, and gets as many runs on a finer learning-rate grid instead
    knob: Knob | None = None


KNOB_VALUES = 3  # values per knob: the same for every method, so every method gets the same number of runs


def method_arg(name: str, *values: float) -> Knob:
    return Knob(name, f"trainer.method_args.{name}", values)


# The paper's Table 1, in its order.
METHODS: dict[str, Method] = {
    # Knob grids bracket each config's value (GradDiff alpha 1, DPO and NPO beta 0.1, SimNPO beta 4.5, PDU's
    # retain NLL bound 0.3, TPO beta 0.32, PALU lambda 1: the paper's lambda grid is {1, 2, 5, 10}).
    "GradAscent": Method("GradAscent"),
    "GradDiff": Method("GradDiff", knob=method_arg("alpha", 0.5, 1.0, 2.0)),
    # DPO with "I don't know" as the preferred answer.
    "DPO": Method(
        "DPO",
        tofu_experiment="unlearn/tofu/idk_local",
        uses_idk_answers=True,
        muse_experiment=None,  # no local "I don't know" set for raw text
        knob=method_arg("beta", 0.05, 0.1, 0.5),
    ),
    "NPO": Method("NPO", knob=method_arg("beta", 0.05, 0.1, 0.5)),
    "SimNPO": Method("SimNPO", knob=method_arg("beta", 2.5, 4.5, 6.5)),
    # The framework's community/methods/PDU/run.sh "final best parameters" for TOFU (retain_loss_eps has no
    # default): primal-dual on, retain preference 100, retain NLL bound 0.3, dual step 5, 5 warm-up epochs.
    "PDU": Method(
        "PDU",
        trainer_overrides=(
            "trainer.method_args.primal_dual=true",
            "trainer.method_args.alpha=100",
            "trainer.method_args.retain_loss_eps=0.3",
            "trainer.method_args.dual_step_size=5",
            "trainer.method_args.dual_warmup_epochs=5",
        ),
        knob=method_arg("retain_loss_eps", 0.1, 0.3, 1.0),
    ),
    "TPO": Method(
        "TPO",
        tofu_experiment="unlearn/tofu/tpo",
        uses_spans=True,
        muse_experiment=None,
        knob=method_arg("beta", 0.1, 0.32, 1.0),
    ),
    "PALU": Method(
        "PALU",
        tofu_experiment="unlearn/tofu/palu",
        uses_spans=True,
        kl_weight_key="trainer.method_args.kl_weight",
        muse_experiment="unlearn/muse/palu",
        knob=Knob("lambda", "trainer.method_args.kl_weight", (1.0, 2.0, 5.0)),
    ),
    # The released code's loss (configs/trainer/PALU_release.yaml): run by name, `--methods PALU_release`.
    "PALU_release": Method(
        "PALU_release",
        tofu_experiment="unlearn/tofu/palu",
        uses_spans=True,
        side_by_side=False,
        muse_experiment="unlearn/muse/palu",
        knob=method_arg("alpha", 1.0, 2.0, 5.0),
    ),
}


def side_by_side_methods(bench: str = "tofu") -> tuple[str, ...]:
    """The methods a comparison runs by default; `bench`: tofu or muse."""
    return tuple(
        name
        for name, method in METHODS.items()
        if method.side_by_side and (bench == "tofu" or method.muse_experiment is not None)
    )


def tuning_grid(
    name: str, learning_rates: tuple[float, ...], tune_knobs: bool
) -> list[tuple[float, dict, tuple[str, ...]]]:
    """Every run method `name` gets: (learning rate, the report's params, extra overrides) per run.

    Without `tune_knobs`, the learning rates alone. With it, learning rates x the knob's values; a method
    without a knob gets as many runs on a finer learning-rate grid over the same range (log-spaced), so that
    every method has the same budget.
    """
    knob = METHODS[name].knob
    if tune_knobs and knob is not None:
        return [
            (rate, {"lr": rate, knob.name: value}, (f"{knob.key}={value}",))
            for rate in learning_rates
            for value in knob.values
        ]
    rates = learning_rates
    if tune_knobs:  # no knob
        low, high = min(rates), max(rates)
        low, high = (low / 2, high * 2) if low == high else (low, high)
        rates = [float(f"{rate:.2g}") for rate in numpy.geomspace(low, high, len(rates) * KNOB_VALUES)]
    return [(rate, {"lr": rate}, ()) for rate in rates]
