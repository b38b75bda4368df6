"""The lab's choices among the entries of the method table (palu_trainer.experiments.methods, the plugin's
one table of methods): which of them each experiment and measurement runs. Outside methods.py, the one
module that names table methods in a list (tests/experiments/test_methods.py)."""

from palu_trainer.experiments.methods import side_by_side_methods

# `make demo FAST=1` (and so `make test`): the side-by-side methods the small variant runs
FAST_DEMO_METHODS = ("NPO", "TPO", "PALU")
# `make bench`: label -> extra `method_args`, one bench row each ("" is the stock config); a method not
# named here gets one row, its stock config. DPO is not benched (its forget rows are answer pairs);
# PALU_release costs what PALU's cached row does.
BENCH_VARIANTS = {
    "DPO": {},
    "PALU": {"reference model": {"reference_cache": False}, "reference cache": {"reference_cache": True}},
    "PALU_release": {},
}

# `make converged` (issue 30) crosses two values of each method's knob: its config's value, then the
# next value of its grid (METHODS) on the side that keeps more utility, since the pilot's failure mode
# was lost utility (a larger retain weight α for GradDiff, a larger β for NPO, SimNPO and TPO, a larger
# λ for PALU).
CONVERGED_KNOB_VALUES = {
    "GradDiff": (1.0, 2.0),
    "NPO": (0.1, 0.5),
    "SimNPO": (4.5, 6.5),
    "TPO": (0.32, 1.0),
    "PALU": (1.0, 2.0),
    # The release ties lambda to alpha (kl_weight: alpha): its knob is alpha, at PALU's lambda values.
    "PALU_release": (1.0, 2.0),
}

# The broad-retain layout of `make converged` (issue 79, `--layout broad`): its rows and each one's learning
# rates: PALU's around its four-author cliff (between 1e-5 and 3e-5, with the paper's 2e-5), NPO's and TPO's
# where their four-author selections lie.
BROAD_RATES = {"PALU": (1e-5, 2e-5, 3e-5, 1e-4), "NPO": (3e-5, 1e-4, 3e-4), "TPO": (3e-5, 1e-4, 3e-4)}

# The methods each measurement puts beside PALU, besides the side-by-side: the bench's ratio denominators, the
# paper's Figure 5 (convergence), and the baselines `make gpu-check` runs on a GPU.
BENCH_BASELINES = ("GradDiff", "NPO")
CONVERGENCE_METHODS = ("PALU", "NPO")
GPU_CHECK_BASELINES = ("TPO", "NPO")
# The real-model experiment (issue 21): the methods it runs by default, and those its reading compares
# PALU with.
REAL_MODEL_METHODS = ("GradDiff", "NPO", "SimNPO", "TPO", "PALU")
REAL_MODEL_LORA_METHODS = ("PALU", "NPO")  # `make converged LORA=1`: its LoRA rows (issue 32)
REAL_MODEL_BASELINES = ("NPO", "SimNPO", "TPO")
PALU_FORMS = ("PALU", "PALU_release")  # the table's entries that run PALUTrainer (they log its terms)


def demo_methods(fast: bool = False, bench: str = "tofu") -> tuple[str, ...]:
    """The methods a miniature comparison runs by default: the side-by-side on `bench` (tofu or muse);
    `fast`: those of them in FAST_DEMO_METHODS."""
    methods = side_by_side_methods(bench=bench)
    return tuple(name for name in methods if name in FAST_DEMO_METHODS) if fast else methods


def bench_variants(name: str) -> dict[str, dict]:
    """Method `name`'s bench rows: label -> extra `method_args` ("" is the stock config)."""
    return BENCH_VARIANTS.get(name, {"": {}})
