"""The one table of unlearning methods that the demo, the GPU recipe and the bench run side by side.

Adding a method to the side-by-side is one entry here (plus, for a new trainer, its module and config).
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Knob:
    """The one hyperparameter of a method that the demo tunes besides the learning rate (fair budget).

    name: as the report lists it; key: the override that sets it; values: the grid, stock value included.
    """

    name: str
    key: str
    values: tuple[float, ...]


@dataclass(frozen=True)
class Method:
    """How the side-by-side runs one method.

    trainer: the trainer config (`trainer=<name>`), the framework's own or this plugin's.
    tofu_experiment: the experiment config it runs on TOFU.
    uses_spans: its forget set reads span annotations (`span_annotations=<file>`).
    kl_weight_key: the override that sets its λ (`make tofu LAMBDA=`, `make tofu-sweep`), if it has one.
    bench_variants: label -> extra `method_args`, one bench row each ("" is the stock config).
    side_by_side: run by `make demo` and `make compare` unless `--methods` names others.
    in_fast_demo: run by `make demo FAST=1` (and so by `make test`).
    knob: its own hyperparameter in the demo's grid; every method gets as many values, so as many runs.
    """

    trainer: str
    tofu_experiment: str = "unlearn/tofu/default"
    uses_spans: bool = False
    kl_weight_key: str | None = None
    bench_variants: dict[str, dict] = field(default_factory=lambda: {"": {}})
    side_by_side: bool = True
    in_fast_demo: bool = False
    knob: Knob | None = None


METHODS: dict[str, Method] = {
    # Each knob's grid brackets the framework's stock value (GradDiff alpha 1, NPO beta 0.1, SimNPO beta 4.5).
    "GradDiff": Method("GradDiff", knob=Knob("alpha", "trainer.method_args.alpha", (0.5, 1.0, 2.0))),
    "NPO": Method("NPO", in_fast_demo=True, knob=Knob("beta", "trainer.method_args.beta", (0.05, 0.1, 0.5))),
    "SimNPO": Method("SimNPO", knob=Knob("beta", "trainer.method_args.beta", (2.5, 4.5, 6.5))),
    "PALU": Method(
        "PALU",
        tofu_experiment="unlearn/tofu/palu",
        uses_spans=True,
        kl_weight_key="trainer.method_args.kl_weight",
        bench_variants={
            "reference model": {"reference_cache": False},
            "reference cache": {"reference_cache": True},
        },
        in_fast_demo=True,
        # the paper's lambda grid is {1, 2, 5, 10}; three values keep the budget equal to the others'
        knob=Knob("lambda", "trainer.method_args.kl_weight", (1.0, 2.0, 5.0)),
    ),
}


def side_by_side_methods(fast: bool = False) -> tuple[str, ...]:
    """The methods a comparison runs by default; `fast`: the demo's FAST subset."""
    return tuple(
        name for name, method in METHODS.items() if (method.in_fast_demo if fast else method.side_by_side)
    )


def tofu_overrides(name: str) -> list[str]:
    """The experiment and trainer overrides that run method `name` on TOFU (spans are added by the caller)."""
    method = METHODS[name]
    return [f"experiment={method.tofu_experiment}", f"trainer={method.trainer}"]
