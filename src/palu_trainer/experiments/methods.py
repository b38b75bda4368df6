"""The one table of unlearning methods that the demo, the GPU recipe and the bench run side by side.

Adding a method to the side-by-side is one entry here (plus, for a new trainer, its module and config).
"""

from dataclasses import dataclass, field


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
    muse_experiment: the experiment config it runs on MUSE.
    """

    trainer: str
    tofu_experiment: str = "unlearn/tofu/default"
    uses_spans: bool = False
    kl_weight_key: str | None = None
    bench_variants: dict[str, dict] = field(default_factory=lambda: {"": {}})
    side_by_side: bool = True
    in_fast_demo: bool = False
    muse_experiment: str = "unlearn/muse/default"


METHODS: dict[str, Method] = {
    "GradDiff": Method("GradDiff"),
    "NPO": Method("NPO", in_fast_demo=True),
    "SimNPO": Method("SimNPO"),
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
        muse_experiment="unlearn/muse/palu",
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


def muse_overrides(name: str) -> list[str]:
    """The experiment and trainer overrides that run method `name` on MUSE (spans are added by the caller)."""
    method = METHODS[name]
    return [f"experiment={method.muse_experiment}", f"trainer={method.trainer}"]
