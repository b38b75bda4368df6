"""The converged real-model experiment (issue 30): `make converged` (`python -m
palu_lab.converged --data tofu --tofu-dir ...`).

The real-model experiment's data, model, Original and Retain (experiments/real_model.py, cached), at the
paper's budget: 10 unlearning epochs, the first a warm-up (the CPU overlay's warmup_ratio 0.1).
1. tuning on seed 0: every method on the same learning-rate grid x two values of its own knob
   (`method_lists.CONVERGED_KNOB_VALUES`); each run saves a checkpoint per epoch, epochs `CURVE_EPOCHS` are
   evaluated with the curve metrics (FQ, MU, forget ROUGE; KS D follows from FQ) and the last with the
   full stock set;
2. fronts: every (run, evaluated epoch) is a point (MU, FQ); each method's Pareto front, and the best FQ it
   reaches while keeping MU at 90% and 80% of the Original's;
3. seeds: the setting that the selection rule picks per method (on the last epoch), on seeds 1 and 2, curves
   included: the table is mean [min–max] over 3 seeds;
4. PALU's utility cliff: at the pilot's cliff learning rate, the paper's knobs beyond its grid and the
   scale-free local loss (`local_loss_scale=reference`), with each term's gradient norm logged;
5. the paper's target ablation (its Figure 4, right): each target c of the ablation axis at PALU's selected
   setting, seed 0, with c's gradient as `trainer=PALU` sets it.
Every unlearning run and evaluation is cached on disk by its inputs (a stopped experiment continues);
checkpoints and weights are deleted once evaluated. `--plan` prints every run and the estimated time.
"""

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy

from palu_lab import real_model
from palu_lab.ablation_chart import plot_axis
from palu_lab.method_lists import (
    BROAD_RATES,
    CONVERGED_KNOB_VALUES,
    PALU_FORMS,
    REAL_MODEL_BASELINES,
    REAL_MODEL_LORA_METHODS,
    REAL_MODEL_METHODS,
)
from palu_lab.miniature import (
    SMOLLM2,
    TOFU_SIZES,
    Miniature,
    NotCached,
    RealTofuSize,
    add_arguments,
    file_digest,
    parse_arguments,
    start_run,
    tofu_miniature,
    whole_epoch_checkpoints,
)
from palu_lab.real_model import FORGETTING, SCORECARD, UTILITY, Run, Spread, aggregate
from palu_lab.stage_archive import StageArchive, this_machine
from palu_trainer.experiments import report
from palu_trainer.experiments.ablation_axes import AXES
from palu_trainer.experiments.methods import METHODS
from palu_trainer.framework.checkout import PROJECT_ROOT

# The learning-rate grid, the same for every method. Pilot (issue 30's table, 8a3b9e1, seed 0, 10 epochs):
# at 1e-5 PALU and TPO barely move (forget ROUGE 0.90, 0.88), at 3e-5 PALU's MU collapses while NPO and TPO
# keep 88% of it. 1e-4 (the 2-epoch table's upper rate) was the top until SimNPO's own tuning runs (aa11273):
# at 1e-4 it kept 85-86% of Original's MU after 10 epochs (forget ROUGE 0.48-0.50, FQ 5e-4), since the stock
# SimNPO's forget gradient is npo_coeff 0.125 of GradDiff's at a memorised answer. 3e-4 extends the grid
# towards its collapse, for every method alike.
LEARNING_RATES = (1e-5, 3e-5, 1e-4, 3e-4)
# LoRA rows (issue 32, `--lora`): PALU and NPO with LoRA adapters (`+peft=lora`: r 16, alpha 32, every
# linear layer of the body) under the same protocol and budget, reported apart (`lora/`). Their rates are the
# grid's x LORA_RATE_FACTOR, the usual ratio of adapter to full-finetuning rates: an adapter's update is a
# rank-16 product that starts at zero, so the same rate moves the model far less.
LORA_OVERRIDE = "+peft=lora"
LORA_RATE_FACTOR = 10
CURVE_EPOCHS = (1, 2, 4, 6, 8)  # evaluated with the curve metrics; the last epoch with the full set
# The curve metrics: the stock set without the ones the curves do not read (forget_quality computes the
# forget truth ratios itself; model_utility its nine parts). Keys as the metric configs' @package names them.
CURVE_METRICS = tuple(
    f"~eval.tofu.metrics.{name}"
    for name in ("forget_truth_ratio", "forget_Q_A_Prob", "privleak", "extraction_strength")
)
PER_EPOCH = (
    "trainer.args.save_strategy=epoch",
    "trainer.args.save_only_model=true",
    "++trainer.args.logging_first_step=true",  # not in the framework's trainer args: added
)
TERM_GRADIENT_NORMS = "trainer.method_args.log_term_gradient_norms=true"
UTILITY_SHARES = (0.9, 0.8)  # the fronts' "equal utility": MU at least this share of the Original's
FULL_FINETUNING = " (full finetuning)"  # a full-finetuning row's suffix where the LoRA report shows it
HOW = ("full finetuning", "LoRA")
# Issue 59: PALU's local loss with gradient through its target c, beside the archived runs (all with c
# detached). A row by name: (method, the form's name in run names, overrides). PALU_release is a method of
# its own (configs/trainer/PALU_release.yaml: c with gradient and the release's KL and weights).
FORM_ROWS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "PALU_cgrad": ("PALU", "c-gradient", ("trainer.method_args.target_gradient=true",)),
}
CONVERGED_ROWS = (*REAL_MODEL_METHODS, *FORM_ROWS, "PALU_release")
# The new rows' tuning runs started with the first knob value at the rates of the detached form's cliff
# (3e-5, then 1e-4), then 1e-5 (all archived). At 1e-4 every PALU form's MU was 0 from epoch 2, so 3e-4 can
# only collapse sooner and waits for the rest (`RUN_LAST_RATES`); at 1e-5 the c-gradient forms kept 91% of
# Original's MU at epoch 4 and lost it by epoch 6, so the second knob value (more KL or retain weight) starts
# there, where it can still answer whether c's gradient keeps utility.
RUN_ORDER_RATES = (3e-6, 1e-5, 2e-5, 3e-5, 1e-4, 3e-4)
RUN_LAST_RATES = (3e-4,)
# Issue 59 read the new rows' fronts after about 10 of its 12 machine-hours of tuning: both c-gradient forms
# lose MU at every rate of the grid before FQ moves (at 1e-5 MU 0.344 with FQ still the Original's at epoch 4,
# 0.12-0.15 at epoch 6; at 3e-5 by epoch 2), so the grid misses their useful range on the low side. It extends
# one step down, 3e-6, for both forms alike (the detached form barely moves at 1e-5 already). The converged
# size only: the FAST smoke run and the LoRA rows keep their grids.
EXTENDED_RATES: dict[str, tuple[float, ...]] = {"PALU_cgrad": (3e-6,), "PALU_release": (3e-6,)}
# Read again at the 12 machine-hours (e4633db): at 3e-6 neither form moves (forget ROUGE 0.958 and FQ 6.6e-5
# through epoch 10), and with λ/α 1 every c-gradient run at 3e-5 and above is below 80% of the Original's MU
# from epoch 2 (1e-4: epoch 1) and ends there. The runs that cannot change the selection (the last epoch's
# highest FQ at MU >= 80%) are held back so that the seeds and the target ablation run: (rate, knob value's
# index) per row, the second value at 3e-5 and 1e-4 and both at 3e-4. λ/α 2 at 3e-6 and 1e-5 stay.
HELD_BACK: dict[str, tuple[tuple[float, int], ...]] = {
    row: ((3e-5, 1), (1e-4, 1), (3e-4, 0), (3e-4, 1)) for row in EXTENDED_RATES
}
CLIFF_LEARNING_RATE = 3e-5  # the pilot's: PALU reaches FQ 0.27 there and its MU falls to 0
# The cliff study's variants of PALU (seed 0, λ 1 unless changed): the paper's knobs across and beyond its
# grid, then the scale-free local loss. The unchanged setting is the tuning run at the same rate.
CLIFF_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {  # label: (name in run names, overrides)
    "λ=10 (grid top)": ("lambda10", ("trainer.method_args.kl_weight=10.0",)),
    "λ=100": ("lambda100", ("trainer.method_args.kl_weight=100.0",)),
    "α=10 (retain weight)": ("alpha10", ("trainer.method_args.alpha=10.0",)),
    "K=1% of |V|": ("topk0.01", ("trainer.method_args.top_k=0.01",)),
    "c=top-K mean": ("target-topk_mean", ("trainer.method_args.target=topk_mean",)),
    "N=1": ("n1", ("num_initiating_tokens=1",)),
    "scale-free local loss": ("scale-reference", ("trainer.method_args.local_loss_scale=reference",)),
}
# MU's sets (retain, real authors, world facts) hold 40 rows each here, not the 2-epoch layout's 10. MU is the
# harmonic mean of nine parts, and on 10 rows Original's world-facts ROUGE is 0.2 (two answers): one answer
# more or less moves MU by about 18%, or to 0. Measured at 4bf92d4 (10 rows): GradDiff lr 1e-5 alpha 1 had MU
# 0.40, 0.33, 0.40, 0.33, 0.42, 0.32 at epochs 1-10, alpha 2 had 0 at epoch 6, between 0.40 and 0.31; "MU at
# least 90% of the Original's" would read one world fact. On 40 rows one answer moves MU by about 4%.
CONVERGED_LAYOUT = replace(SMOLLM2.layout, eval_rows=40)
# Seconds of one curve evaluation beside another job, fp32, 40-row MU sets: 364-453 s measured at aa11273 (an
# Intel Xeon with AVX-512); the final full one 575-696 s.
CURVE_EVAL_SECONDS = 410.0

# fp32 throughout: bf16 autocast needs a CPU with bf16 instructions (avx512_bf16, AMX), and the machines that
# run this differ. On an AMD EPYC with AVX2 only, a bf16-autocast training step of Original took 209 s
# (8 s on the avx512_bf16 machine of the 2-epoch experiment); one precision keeps every stage comparable.
CONVERGED = replace(
    SMOLLM2,
    layout=CONVERGED_LAYOUT,
    eval_seconds=650.0,
    bf16=False,
    unlearn_epochs=10,
    unlearn_learning_rates=LEARNING_RATES,
    tune_knobs=True,
    step_seconds=12.5,  # measured: Original's fp32 finetune, beside Retain's (the bf16 size's 8 s)
)
# The FAST variant (`--fast`, tests): 2 forget rows, 2 epochs (the first evaluated), one rate, seeds 0 and 1.
CONVERGED_FAST = replace(
    TOFU_SIZES["smollm2-fast"], unlearn_epochs=2, unlearn_learning_rates=(5e-5,), tune_knobs=True
)
# The broad-retain layout (`--layout broad`, issue 79): the paper's Original knows 200 authors and its retain
# term covers 190; the four-author layout's retain term sees 2 authors, the same rows MU reads. Here Original
# is finetuned on 20 authors, the 2 forget authors and 18 retain authors, every row of each (400 rows), Retain
# on the 18, and the retain term draws from all 18 (360 rows). The forget set, the holdout, MU's row counts,
# the budget and the evaluator stay. MU's retain part reads retain_perturbed's first 40 rows, authors 0 and 1,
# trained retain authors as TOFU's retain_perturbed's are, and the rows the four-author layout reads.
BROAD_LAYOUT = replace(CONVERGED_LAYOUT, retain_authors=range(0, 18))
BROAD_ROWS = tuple(BROAD_RATES)
CONVERGED_BROAD = replace(
    CONVERGED,
    layout=BROAD_LAYOUT,
    unlearn_learning_rates=tuple(sorted({rate for rates in BROAD_RATES.values() for rate in rates})),
)
CONVERGED_BROAD_FAST = replace(
    CONVERGED_FAST, layout=replace(CONVERGED_FAST.layout, retain_authors=range(0, 2))
)
TOFU_SIZES["smollm2-converged"] = CONVERGED
TOFU_SIZES["smollm2-converged-fast"] = CONVERGED_FAST
TOFU_SIZES["smollm2-converged-broad"] = CONVERGED_BROAD
TOFU_SIZES["smollm2-converged-broad-fast"] = CONVERGED_BROAD_FAST
LAYOUTS = {"four-author": "smollm2-converged", "broad": "smollm2-converged-broad"}


def runs_palu_studies(methods: Sequence[str], size: RealTofuSize, lora: bool) -> bool:
    """Whether the run holds PALU's cliff study and target ablation (the four-author layout's, no LoRA)."""
    return "PALU" in methods and not lora and size not in (CONVERGED_BROAD, CONVERGED_BROAD_FAST)


class Scored:
    """A point's MU and FQ, read off its `metrics` (0 where missing)."""

    metrics: Mapping

    @property
    def utility(self) -> float:
        return self.metrics.get(UTILITY) or 0.0

    @property
    def quality(self) -> float:
        return self.metrics.get(FORGETTING) or 0.0


ScoredPoint = TypeVar("ScoredPoint", bound=Scored)


@dataclass(frozen=True)
class Point(Scored):
    """One evaluated epoch of one run: its metrics (KS D added)."""

    run: Run
    epoch: int
    metrics: Mapping

    @property
    def name(self) -> str:
        return self.run.name


@dataclass(frozen=True)
class ReadPoint(Scored):
    """A point read back from a report's converged.json: the run's name, the epoch, its metrics."""

    name: str
    epoch: int
    metrics: Mapping


def ks_statistic(forget_quality: float | None, rows: int) -> int | None:
    """D·rows, the KS statistic of the forget truth ratios in steps of 1/rows, from FQ: with `rows` values
    on each side FQ takes only the p-values of `real_model.fq_ladder`, one per D."""
    if forget_quality is None or math.isnan(forget_quality):
        return None
    ladder = numpy.log(numpy.maximum(real_model.fq_ladder(rows), 1e-300))
    return int(numpy.argmin(abs(ladder - math.log(max(forget_quality, 1e-300)))))


def evaluated_epochs(epochs: int) -> tuple[int, ...]:
    """The epochs evaluated with the curve metrics (`CURVE_EPOCHS` below the last)."""
    return tuple(epoch for epoch in CURVE_EPOCHS if epoch < epochs)


def knob_grid(method: str, learning_rates: Sequence[float]) -> list[tuple[float, dict, tuple[str, ...]]]:
    """(learning rate, params, overrides) of every tuning run of `method`."""
    knob = METHODS[method].knob
    return [
        (rate, {"lr": rate, knob.name: value}, (f"{knob.key}={value}",))
        for rate in learning_rates
        for value in CONVERGED_KNOB_VALUES[method]
    ]


def learning_rates(size: RealTofuSize, lora: bool = False) -> tuple[float, ...]:
    factor = LORA_RATE_FACTOR if lora else 1
    # rounded: 3e-4 in run names and command lines, not 3.0000000000000003e-4
    return tuple(round(rate * factor, 12) for rate in size.unlearn_learning_rates)


def row_method(row: str) -> tuple[str, dict, tuple[str, ...]]:
    """A row's method, the params naming its form, and the form's overrides (`FORM_ROWS`)."""
    if row not in FORM_ROWS:
        return row, {}, ()
    method, form, overrides = FORM_ROWS[row]
    return method, {"variant": form}, overrides


def tuning_runs(rows: Sequence[str], size: RealTofuSize, lora: bool = False) -> list[Run]:
    """Every row's tuning runs on seed 0; with `lora`, its LoRA rows ("PALU LoRA": adapters, LoRA's
    rates)."""
    adapters = ({"adapters": "LoRA"}, (LORA_OVERRIDE,)) if lora else ({}, ())
    return [
        Run(f"{row} LoRA" if lora else row, method, size.seeds[0], rate,
            {**adapters[0], **params, **form}, (*adapters[1], *form_overrides, *extra))
        for row in rows
        for method, form, form_overrides in [row_method(row)]
        for rate, params, extra in row_grid(row, method, size, lora)
    ]  # fmt: skip


def row_grid(row: str, method: str, size: RealTofuSize, lora: bool = False) -> list:
    """The row's `knob_grid`: at the converged size with `EXTENDED_RATES` below the grid's rates and without
    `HELD_BACK`."""
    converged = size is CONVERGED and not lora
    rates = (*(EXTENDED_RATES.get(row, ()) if converged else ()), *learning_rates(size, lora))
    if size is CONVERGED_BROAD:
        rates = BROAD_RATES.get(row, rates)
    held = HELD_BACK.get(row, ()) if converged else ()
    knob, values = METHODS[method].knob, CONVERGED_KNOB_VALUES[method]
    return [
        (rate, params, extra)
        for rate, params, extra in knob_grid(method, rates)
        if (rate, values.index(params[knob.name])) not in held
    ]


def run_order(runs: Sequence[Run]) -> list[Run]:
    """The order the pool starts them in: `RUN_LAST_RATES` after the rest, each row's first knob value before
    its second, and the rates in `RUN_ORDER_RATES`' order (cached runs cost nothing, so this orders the new
    ones)."""

    def position(run: Run) -> tuple[bool, int, int]:
        knob = METHODS[run.method].knob
        value = run.params.get(knob.name) if knob else None
        values = CONVERGED_KNOB_VALUES.get(run.method, ())
        rate = run.learning_rate / (LORA_RATE_FACTOR if "adapters" in run.params else 1)
        order = [round(r, 12) for r in RUN_ORDER_RATES]
        return (
            round(rate, 12) in RUN_LAST_RATES,
            values.index(value) if value in values else 0,
            order.index(round(rate, 12)) if round(rate, 12) in order else len(order),
        )

    return sorted(runs, key=position)


def cliff_runs(size: RealTofuSize) -> list[Run]:
    """PALU's cliff variants at the cliff's learning rate (the grid's first rate where it has none)."""
    rates = size.unlearn_learning_rates
    rate = CLIFF_LEARNING_RATE if CLIFF_LEARNING_RATE in rates else rates[0]
    _, params, stock = knob_grid("PALU", [rate])[0]
    return [
        Run(label, "PALU", size.seeds[0], rate, {**params, "variant": name}, (*stock, *overrides))
        for label, (name, overrides) in CLIFF_VARIANTS.items()
    ]


# The target ablation's runs: every target of the ablation axis but the default, whose point is PALU's
# selected run.
TARGET_VARIANTS = {label: overrides for label, overrides in AXES["c"].points.items() if overrides}


# The target ablation's setting: PALU's selection when it ran (issue 59), by the rule of the day on the last
# epoch (lr 1e-5, λ 1); the grid's first rate in a run whose grid lacks it.
TARGET_LEARNING_RATE = 1e-5


def target_base(tuning: Sequence["Curve"], size: RealTofuSize) -> "Curve":
    """PALU's tuning run that the target ablation varies: at `TARGET_LEARNING_RATE`, its first knob value."""
    rates = size.unlearn_learning_rates
    rate = TARGET_LEARNING_RATE if TARGET_LEARNING_RATE in rates else rates[0]
    knob = METHODS["PALU"].knob.name
    return next(
        curve
        for curve in tuning
        if curve.run.row == "PALU"
        and curve.run.learning_rate == rate
        and curve.run.params.get(knob) == CONVERGED_KNOB_VALUES["PALU"][0]
    )


def target_runs(selected: Run) -> list[Run]:
    """`TARGET_VARIANTS` at `selected` (PALU's selected setting on seed 0), named as the cliff study's
    target variant, so the same setting is one run."""
    return [
        replace(
            selected,
            row=f"c={label}",
            params={**selected.params, "variant": f"target-{label}"},
            extra=(*selected.extra, *overrides),
        )
        for label, overrides in TARGET_VARIANTS.items()
    ]


def run_overrides(run: Run) -> tuple[str, ...]:
    """The run's command line additions: its own, checkpoints per epoch, and PALU's term gradient norms."""
    norms = (TERM_GRADIENT_NORMS,) if run.method in PALU_FORMS else ()
    return (*run.overrides(), *PER_EPOCH, *norms)


@dataclass(frozen=True)
class Curve:
    """A run's evaluated epochs, its folder (logs, trainer_state.json) and its unlearning seconds."""

    run: Run
    points: list[Point]
    out_dir: Path
    seconds: float


def unlearn_with_curve(mini: Miniature, run: Run, keep: Callable[[Path], None] | None = None) -> Curve:
    """Unlearn Original as `run` says, saving every epoch; evaluate the curve epochs' checkpoints and the
    final model (each cached by the run's cache folder and epoch), then delete checkpoints and weights and
    `keep` (archive) the run's stage folders."""
    stages, epochs = mini.stages, mini.stages.size.unlearn_epochs
    out_dir, seconds = stages.unlearn_cached(
        run.method, run.learning_rate, mini.original_dir, run_overrides(run), run.name
    )
    checkpoints = whole_epoch_checkpoints(out_dir)
    rows = stages.size.layout.forget_rows
    points, eval_dirs = [], []
    for epoch in (*evaluated_epochs(epochs), epochs):
        final = epoch == epochs
        eval_json = stages.evaluate(
            f"{run.name}_epoch{epoch}",
            out_dir if final else checkpoints.get(epoch, out_dir / f"checkpoint-of-epoch-{epoch}"),
            mini.retain_eval,
            cache=True,
            metrics=None if final else CURVE_METRICS,
            key=[out_dir.name, f"epoch {epoch}"],
        )
        metrics = report.metrics_from_eval(eval_json, SCORECARD)
        metrics["ks_d"] = ks_statistic(metrics[FORGETTING], rows)
        points.append(Point(run, epoch, metrics))
        eval_dirs.append(eval_json.parent)
    for path in out_dir.glob("checkpoint-*"):
        shutil.rmtree(path)
    (out_dir / "model.safetensors").unlink(missing_ok=True)
    for stage_dir in (*eval_dirs, out_dir) if keep else ():  # the run last: it is finished once all are
        keep(stage_dir)
    return Curve(run, points, out_dir, seconds)


def point_at(curve: Curve, epoch: int) -> Point:
    return next(point for point in curve.points if point.epoch == epoch)


def pareto_front(points: Sequence[ScoredPoint]) -> list[ScoredPoint]:
    """The points no other beats on both MU and FQ, by MU descending (FQ then ascends)."""
    front, best = [], -math.inf
    for point in sorted(points, key=lambda p: (-p.utility, -p.quality)):
        if point.quality > best:
            front.append(point)
            best = point.quality
    return front


def best_at_utility(points: Sequence[ScoredPoint], floor: float) -> ScoredPoint | None:
    """The point of highest FQ among those with MU >= floor (None: no point keeps that much)."""
    kept = [point for point in points if point.utility >= floor]
    return max(kept, key=lambda p: p.quality) if kept else None


SELECTION_RULE = (
    "per method, among every (setting, evaluated epoch) of its seed-0 tuning runs whose MU is at least "
    f"{report.UTILITY_FLOOR:.0%} of the Original's, the one with the highest FQ; ties go to the higher MU, "
    "then the lower learning rate. A method none of whose points at that MU has an FQ above the Original's "
    "has no admissible point: no setting is selected and no seed runs. Seeds 1 and 2 run the selected "
    "setting and are read at the selected epoch"
)


def select_point(points: Sequence[Point], original: Mapping) -> Point | None:
    """`SELECTION_RULE` on a row's tuning points; None: no admissible point."""
    floor = report.UTILITY_FLOOR * (original.get(UTILITY) or 0.0)
    admissible = [
        point
        for point in points
        if point.utility >= floor and point.quality > (original.get(FORGETTING) or 0.0)
    ]
    if not admissible:
        return None
    return max(admissible, key=lambda p: (p.quality, p.utility, -p.run.learning_rate))


TERM_KEYS = ("local_loss", "kl_loss", "retain_loss", "grad_norm", "grad_norm_local", "grad_norm_kl")
TERM_KEYS += ("grad_norm_retain",)


def logged_terms(curve: Curve) -> list[dict]:
    """PALU's logged terms and gradient norms at every logged step of the run (trainer_state.json)."""
    state = json.loads((curve.out_dir / "trainer_state.json").read_text())
    return [
        {key: entry.get(key) for key in ("step", *TERM_KEYS)}
        for entry in state["log_history"]
        if "local_loss" in entry
    ]


def commit_of(path: Path = PROJECT_ROOT) -> str:
    """The checkout's commit, `+dirty` when tracked files differ from it (the numbers' provenance)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno"], cwd=path, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return (
        head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
        if head.returncode == 0
        else "unknown"
    )


def setting(run: Run) -> str:
    return report.format_params({key: value for key, value in run.params.items() if key != "variant"})


def curve_spreads(curves: Sequence[Curve], original: Mapping) -> dict[int, dict[str, Spread | None]]:
    """Per epoch (0 = Original), each metric over the curves' seeds."""
    epochs = [0, *(point.epoch for point in curves[0].points)]
    spreads = {0: aggregate([report.EvaluatedModel(dict(original))])}
    for index, epoch in enumerate(epochs[1:]):
        spreads[epoch] = aggregate(
            [report.EvaluatedModel(dict(curve.points[index].metrics)) for curve in curves]
        )
    return spreads


CURVE_PANELS = (
    (FORGETTING, "forget quality (log)", True),
    (UTILITY, "model utility (MU)", False),
    ("forget_rouge", "forget ROUGE", False),
    ("ks_d", "KS statistic D·n (of the forget rows)", False),
)


def plot_curves(
    path: Path,
    curves: Mapping[str, dict[int, dict]],
    retain: Mapping,
    rows: int,
    full: Mapping[str, dict[int, dict]] | None = None,
    selected_epochs: Mapping[str, int] | None = None,
) -> None:
    """Four panels against the unlearning epoch: each method's selected setting, mean over seeds with the
    min–max band, a ring at its selected epoch (`selected_epochs`); Retain dashed. `full`: the LoRA report's
    full-finetuning curves of the same methods, dashed in the colour of each method's LoRA line, without
    bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(2, 2, figsize=(11, 7.5))
    for (key, label, log), axes in zip(CURVE_PANELS, panels.flat):
        for method, spreads in curves.items():
            epochs = [epoch for epoch, s in spreads.items() if s.get(key)]
            values = [spreads[epoch][key] for epoch in epochs]
            floor = report.FQ_FLOOR if log else -math.inf
            mean = [max(v.mean, floor) for v in values]
            seeds = max(v.seeds for v in values)
            shown = method if seeds > 1 else f"{method} (seed 0 only)"
            line = axes.plot(epochs, mean, marker="o", label=shown)[0]
            chosen = (selected_epochs or {}).get(method)
            if chosen in epochs:
                axes.plot(
                    [chosen], [mean[epochs.index(chosen)]], marker="o", ms=13, mfc="none",
                    color=line.get_color(), lw=0,
                )  # fmt: skip
            axes.fill_between(
                epochs, [max(v.low, floor) for v in values], [max(v.high, floor) for v in values],
                color=line.get_color(), alpha=0.2,
            )  # fmt: skip
            full_spreads = (full or {}).get(method.removesuffix(" LoRA"))
            if full_spreads:
                full_epochs = [epoch for epoch, s in full_spreads.items() if s.get(key)]
                axes.plot(
                    full_epochs, [max(full_spreads[epoch][key].mean, floor) for epoch in full_epochs],
                    ls="--", marker="x", color=line.get_color(),
                    label=method.removesuffix(" LoRA") + FULL_FINETUNING,
                )  # fmt: skip
        reference = 0 if key == "ks_d" else retain.get(key)
        if reference is not None:
            axes.axhline(reference, color="black", ls="--", lw=1, label="Retain")
        if log:
            axes.set_yscale("log")
        if key == "ks_d":
            axes.set_ylim(-0.5, rows + 0.5)
        axes.set_xlabel("unlearning epoch (0 = Original; epoch 1 is the warm-up)")
        axes.set_ylabel(label)
        axes.grid(True, which="both", alpha=0.3)
    panels.flat[0].legend(fontsize=8)
    figure.suptitle(
        "SmolLM2 on real TOFU: each method's selected setting, mean over seeds, band min–max; "
        "ring: the selected epoch"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_fronts(
    path: Path,
    points: Mapping[str, list[Point]],
    references: Mapping,
    shares,
    full: Mapping[str, list[ReadPoint]] | None = None,
) -> None:
    """MU (x) vs FQ (y, log): every tuning run at every evaluated epoch (faint), each method's Pareto front
    (line), the Original (star), Retain (plus) and the equal-utility floors (dotted); left every point, right
    the region the floors ask about (MU from 75% of the Original's). FQ more than ten times below the
    Original's (a model further from Retain than the Original; a collapsed one reaches 1e-23) is drawn at
    that bottom line, which would otherwise stretch the axis over 20 decades. `full`: the LoRA report's
    full-finetuning points of the same methods, whose fronts are drawn dashed in each method's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    original, retain = references["Original"].metrics, references["Retain"].metrics
    bottom = max(original[FORGETTING], report.FQ_FLOOR) / 10

    def shown(quality: float) -> float:
        return max(quality, bottom)

    figure, panels = plt.subplots(1, 2, figsize=(14.5, 5.5))
    for axes in panels:
        for method, method_points in points.items():
            dots = axes.scatter(
                [p.utility for p in method_points], [shown(p.quality) for p in method_points], s=12, alpha=0.3
            )
            front = pareto_front(method_points)
            axes.plot(
                [p.utility for p in front], [shown(p.quality) for p in front],
                marker="o", color=dots.get_facecolor()[0][:3], label=f"{method} front",
            )  # fmt: skip
            full_front = pareto_front((full or {}).get(method.removesuffix(" LoRA"), []))
            if full_front:
                axes.plot(
                    [p.utility for p in full_front], [shown(p.quality) for p in full_front],
                    ls="--", marker="x", color=dots.get_facecolor()[0][:3],
                    label=f"{method.removesuffix(' LoRA')}{FULL_FINETUNING} front",
                )  # fmt: skip
        axes.plot([original[UTILITY]], [shown(original[FORGETTING])], "k*", ms=12, label="Original")
        axes.plot([retain[UTILITY]], [retain[FORGETTING]], "kP", ms=10, label="Retain")
        for share, style in zip(shares, (":", "-.")):
            axes.axvline(
                share * original[UTILITY], color="gray", ls=style, lw=1, label=f"{share:.0%} of Original's MU"
            )
        axes.set_yscale("log")
        axes.set_ylim(bottom / 2, 2)
        axes.set_xlabel("model utility (MU) ↑")
        axes.grid(True, which="both", alpha=0.3)
    panels[0].set_ylabel(f"forget quality (log) ↑; below {bottom:.2g} drawn at it")
    panels[0].set_title("every point")
    utilities = [p.utility for method_points in points.values() for p in method_points]
    low = 0.75 * original[UTILITY]
    panels[1].set_xlim(low, max([*utilities, original[UTILITY], retain[UTILITY]]) + 0.01)
    panels[1].set_title(f"MU ≥ {low:.3f} (75% of the Original's): the equal-utility floors")
    panels[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: no point hidden
    figure.suptitle("Every tuning run at every evaluated epoch (seed 0); lines: each method's Pareto front")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def front_lines(
    points: Mapping[str, list[Point]], original_utility: float, shares=UTILITY_SHARES
) -> list[str]:
    """The fronts' answer to "at equal utility": per share of the Original's MU, each method's best FQ."""
    lines = []
    for share in shares:
        floor = share * original_utility
        best = {method: best_at_utility(method_points, floor) for method, method_points in points.items()}
        ranked = sorted(best, key=lambda m: -(best[m].quality if best[m] else -1.0))
        cells = [
            f"{method} {best[method].quality:.3g} ({setting(best[method].run)}, epoch {best[method].epoch}, "
            f"MU {best[method].utility:.3f})"
            if best[method]
            else f"{method}: no point"
            for method in ranked
        ]
        lines.append(
            f"At MU ≥ {share:.0%} of the Original's (≥ {floor:.3f}), best FQ: " + "; ".join(cells) + "."
        )
    return lines


def front_table(points: Mapping[str, list[Point]], original_utility: float, shares=UTILITY_SHARES) -> str:
    headers = ["method", "points", *(f"best FQ at MU ≥ {s:.0%}" for s in shares), "front (MU, FQ)"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for method, method_points in points.items():
        cells = []
        for share in shares:
            best = best_at_utility(method_points, share * original_utility)
            cells.append(f"{best.quality:.3g} ({setting(best.run)}, ep {best.epoch})" if best else "—")
        front = ", ".join(f"({p.utility:.3f}, {p.quality:.2g})" for p in pareto_front(method_points))
        lines.append("| " + " | ".join([method, str(len(method_points)), *cells, front]) + " |")
    return "\n".join(lines)


COMPARED_COLUMNS = (
    real_model.TABLE_1[0],
    ("ks_d", "KS D ↓", "{:.1f}"),
    *(column for column in real_model.TABLE_1 if column[0] in (UTILITY, "forget_rouge", "retain_rouge")),
    *real_model.TABLE_2[:1],
)


@dataclass(frozen=True)
class FullFinetuning:
    """The full-finetuning report's rows, curves and tuning points that the LoRA report reads beside its own
    (the same data, Original, Retain, budget and selection rule; `make converged` made them)."""

    path: Path
    commit: str
    rows: Mapping[str, Mapping[str, Spread | None]]
    curves: Mapping[str, dict[int, dict[str, Spread | None]]]
    points: Mapping[str, list[ReadPoint]]  # row: its seed-0 (tuning) runs at every evaluated epoch

    @classmethod
    def read(cls, path: Path) -> "FullFinetuning | None":
        if not path.is_file():
            return None
        summary = json.loads(path.read_text(encoding="utf-8"))

        def spreads(values: Mapping) -> dict[str, Spread | None]:
            return {key: Spread(**value) if value else None for key, value in values.items()}

        points: dict[str, dict[tuple[str, int], ReadPoint]] = {}
        for point in summary["points"]:  # seed 0's (the tuning runs'), each once: the seeded list repeats it
            if point["run"].endswith("_seed0"):
                metrics = {key: value for key, value in point.items() if key not in ("run", "row", "epoch")}
                read = ReadPoint(point["run"], point["epoch"], metrics)
                points.setdefault(point["row"], {})[read.name, read.epoch] = read
        return cls(
            path,
            summary["commit"],
            {name: spreads(values) for name, values in summary["rows"].items()},
            {
                name: {int(epoch): spreads(values) for epoch, values in by_epoch.items()}
                for name, by_epoch in summary["curves"].items()
            },
            {row: list(kept.values()) for row, kept in points.items()},
        )


def lora_against_full(
    full: FullFinetuning | None,
    spreads: Mapping[str, Mapping[str, Spread | None]],
    points: Mapping[str, list[Point]],
    original_utility: float,
    shares=UTILITY_SHARES,
) -> tuple[list[str], list[str]]:
    """(Markdown, reading) of what LoRA costs: each LoRA row beside the same method's full-finetuning row,
    over seeds, and the best FQ each reaches on seed 0 at each utility floor."""
    if full is None:
        return [], []
    methods = [row.removesuffix(" LoRA") for row in spreads if row.endswith(" LoRA")]
    methods = [method for method in methods if method in full.rows]
    rows = {}
    for method in methods:
        rows[method + FULL_FINETUNING] = full.rows[method]
        rows[f"{method} LoRA"] = spreads[f"{method} LoRA"]
    headers = ["method", *(f"best FQ at MU ≥ {share:.0%}, {how}" for share in shares for how in HOW)]
    fronts = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for method in methods:
        cells = []
        for share in shares:
            for best in (
                best_at_utility(full.points.get(method, []), share * original_utility),
                best_at_utility(points.get(f"{method} LoRA", []), share * original_utility),
            ):
                cells.append(
                    f"{best.quality:.3g} ({best.name}, ep {best.epoch}, MU {best.utility:.3f})"
                    if best
                    else "—"
                )
        fronts.append("| " + " | ".join([method, *cells]) + " |")
    reading = [real_model.compare(f"{m} LoRA", m + FULL_FINETUNING, rows)[1] for m in methods]
    markdown = [
        "## LoRA against full finetuning",
        "",
        f"The full-finetuning rows are ../{full.path.name} (commit {full.commit}): the same data, Original, "
        "Retain, budget and selection rule, every weight trained at the grid's rates.",
        "",
        real_model.spread_table(rows, COMPARED_COLUMNS),
        "",
        "Seed 0, every tuning run at every evaluated epoch (cells: FQ (run, epoch, MU)):",
        "",
        *fronts,
        "",
        *(f"- {line}" for line in reading),
        "",
    ]
    return markdown, reading


OUTCOME_HEADERS = (
    "final FQ", "final MU", "forget ROUGE", "retain ROUGE",
    *(f"best FQ at MU ≥ {s:.0%}" for s in UTILITY_SHARES),
)  # fmt: skip


def outcome_cells(curve: Curve, original_utility: float) -> list[str]:
    """`OUTCOME_HEADERS`' cells: the final model's metrics, then the best FQ along the curve at each
    utility floor, with its epoch."""
    final = curve.points[-1].metrics
    best = [best_at_utility(curve.points, share * original_utility) for share in UTILITY_SHARES]
    return [
        report.format_value(final.get(FORGETTING), "{:.3g}"),
        report.format_value(final.get(UTILITY), "{:.3f}"),
        report.format_value(final.get("forget_rouge"), "{:.3f}"),
        report.format_value(final.get("retain_rouge"), "{:.3f}"),
        *(f"{b.quality:.3g} (ep {b.epoch})" if b else "—" for b in best),
    ]


def cliff_table(base: Curve, variants: Sequence[Curve], original_utility: float) -> tuple[str, list[str]]:
    """PALU's cliff study: per variant, the first step's terms and gradient norms, the final model, and the
    best FQ along its epochs at each utility floor; and which variants keep MU where the base does not."""
    headers = [
        "variant", "step-1 local / KL / retain", "step-1 grad norm: local / KL / retain (total)",
        *OUTCOME_HEADERS,
    ]  # fmt: skip
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    rows = [
        (f"paper (λ=1, lr {base.run.learning_rate:g})", base),
        *((curve.run.row, curve) for curve in variants),
    ]
    best_of = {}
    for label, curve in rows:
        logged = logged_terms(curve)
        first = logged[0] if logged else {}
        terms = " / ".join(report.format_value(first.get(k), "{:.3g}") for k in TERM_KEYS[:3])
        norms = " / ".join(report.format_value(first.get(k), "{:.3g}") for k in TERM_KEYS[4:])
        norms += f" ({report.format_value(first.get('grad_norm'), '{:.3g}')})"
        best_of[label] = [best_at_utility(curve.points, share * original_utility) for share in UTILITY_SHARES]
        cells = [terms, norms, *outcome_cells(curve, original_utility)]
        lines.append("| " + " | ".join([label.replace("|", "\\|"), *cells]) + " |")
    base_label = rows[0][0]
    reading = []
    for index, share in enumerate(UTILITY_SHARES):
        base_best = best_of[base_label][index]
        base_quality = base_best.quality if base_best else -1.0
        better = [
            f"{label} ({best[index].quality:.3g})"
            for label, best in best_of.items()
            if label != base_label and best[index] and best[index].quality > base_quality
        ]
        reading.append(
            f"At MU ≥ {share:.0%} of the Original's, the paper's form reaches FQ "
            f"{base_best.quality:.3g} (epoch {base_best.epoch})" if base_best else
            f"At MU ≥ {share:.0%} of the Original's, the paper's form has no point"
        )  # fmt: skip
        reading[-1] += "; higher: " + (", ".join(better) if better else "none of the variants") + "."
    return "\n".join(lines), reading


# The paper's reading of its target ablation (Section "Analysis of Optimization Target c"); its Figure 4's bar
# heights are not in its text.
PAPER_TARGET_READING = (
    "The paper adopts c = the global mean of the current model's logits (global_mean) and calls the uniform "
    'target "a maximum entropy constraint that proves too strict".'
)


def target_section(
    default: Curve, targets: Sequence[Curve], references: Mapping, original_utility: float, chart: Path
) -> tuple[list[str], list[str]]:
    """The target ablation's markdown (a row per target of `AXES["c"]`, in the paper's order; the default's
    row is PALU's selected run) and reading, and its chart: the paper's Figure 4 (right), FQ and MU of the
    final models."""
    axis = AXES["c"]
    by_label = {axis.default: default, **{curve.run.row.removeprefix("c="): curve for curve in targets}}
    curves = {label: by_label[label] for label in axis.points}
    headers = ["target c", *OUTCOME_HEADERS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for label, curve in curves.items():
        shown = f"{label} (default)" if label == axis.default else label
        lines.append("| " + " | ".join([shown, *outcome_cells(curve, original_utility)]) + " |")
    finals = {label: report.EvaluatedModel(dict(curve.points[-1].metrics)) for label, curve in curves.items()}
    plot_axis(chart, axis, finals, references, utility=UTILITY, title=f"PALU at {setting(default.run)}")
    floor = UTILITY_SHARES[-1]

    def best_quality(label: str) -> float:
        best = best_at_utility(curves[label].points, floor * original_utility)
        return best.quality if best else -1.0

    ranked = sorted(curves, key=best_quality, reverse=True)
    reading = [
        f"Ranked by the best FQ at MU ≥ {floor:.0%} of the Original's along the curve: "
        + " > ".join(
            f"{label} ({best_quality(label):.3g})" if best_quality(label) >= 0 else f"{label} (no point)"
            for label in ranked
        )
        + ".",
        PAPER_TARGET_READING,
    ]
    markdown = [
        f"Seed {default.run.seed}, PALU at {setting(default.run)} (its selection when the ablation ran), c's "
        "gradient as `trainer=PALU` sets it; which targets are shift-invariant: docs/method.md.",
        "",
        *lines,
        "",
        *(f"- {line}" for line in reading),
        "",
        f"![targets]({chart.name})",
        "",
    ]
    return markdown, reading


def run_all(pool, function, items: Sequence) -> list:
    """`function` on every item on `pool`, results in order; the first failure cancels the runs not started
    (`pool.map` would go on with all of them before raising)."""
    futures = [pool.submit(function, item) for item in items]
    try:
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        raise


def seed_runs(selected: Mapping[str, Run], seeds: Sequence[int]) -> list[Run]:
    return [replace(run, seed=seed) for run in selected.values() for seed in seeds[1:]]


def run_minutes(size: RealTofuSize) -> float:
    """Estimated machine minutes of one run beside another job: unlearning (real_model's step work),
    the curve evaluations and the final full one, a process start each."""
    steps = math.ceil(size.layout.forget_rows / size.unlearn_batch_size) * size.unlearn_epochs
    unlearn = real_model.UNLEARN_STEP_WORK * steps * size.step_seconds + size.process_seconds
    curve_seconds = CURVE_EVAL_SECONDS * size.eval_seconds / CONVERGED.eval_seconds
    curve = len(evaluated_epochs(size.unlearn_epochs)) * curve_seconds
    return (unlearn + curve + size.eval_seconds) / 60


def plan_lines(methods: Sequence[str], size: RealTofuSize, jobs: int, lora: bool = False) -> list[str]:
    tuning = tuning_runs(methods, size, lora)
    ablated = runs_palu_studies(methods, size, lora)
    cliff = cliff_runs(size) if ablated else []
    targets = list(TARGET_VARIANTS) if ablated else []
    seeds = len(methods) * (len(size.seeds) - 1)
    per_run, parallel = run_minutes(size), min(jobs, 2)
    total = (len(tuning) + seeds + len(cliff) + len(targets)) * per_run / parallel
    return [
        f"converged real-model experiment: {size.model_config}, {size.layout.forget_rows} forget rows, "
        f"{size.unlearn_epochs} epochs (the first a warm-up), batch {size.unlearn_batch_size}",
        real_model.fq_resolution(size.layout.forget_rows),
        f"evaluated after epochs {list(evaluated_epochs(size.unlearn_epochs))} (FQ, MU, forget ROUGE) and "
        f"{size.unlearn_epochs} (the full stock set); MU on {size.layout.eval_rows or 'all'} rows of each "
        "of its sets (retain, real authors, world facts)",
        f"tuning on seed {size.seeds[0]}: {len(tuning)} runs, learning rates "
        f"{list(learning_rates(size, lora)) if size is not CONVERGED_BROAD else BROAD_RATES} "
        + ("(LoRA adapters) " if lora else "")
        + "x two values of each method's knob:",
        *(f"  {run.name}" for run in tuning),
        f"seeds {list(size.seeds[1:])} of each method's selected setting: {seeds} runs",
        f"PALU's utility cliff: {len(cliff)} runs at lr {cliff[0].learning_rate:g}:" if cliff else "",
        *(f"  {run.row}: {' '.join(run.extra[1:])}" for run in cliff),
        f"the target ablation at PALU lr {TARGET_LEARNING_RATE:g}, seed {size.seeds[0]}: "
        f"{len(targets)} runs, c = " + ", ".join(targets)
        if targets
        else "",
        f"estimated: {per_run:.0f} min per run beside another job; {total / 60:.1f} h wall at {parallel} "
        f"jobs (plus Original and Retain if not cached: ~{finetune_minutes(size):.0f} min, at once)",
    ]


def finetune_minutes(size: RealTofuSize) -> float:
    """Estimated minutes of Original's finetuning (the longer of the two, run beside Retain's)."""
    rows = (len(size.layout.forget_authors) + len(size.layout.retain_authors)) * size.layout.rows_per_author
    steps = math.ceil(rows / (size.finetune_batch_size or 8)) * size.finetune_epochs
    return (steps * size.step_seconds + size.process_seconds) / 60


def write_report(
    out_dir: Path,
    references: Mapping[str, report.EvaluatedModel],
    tuning: Sequence[Curve],
    selections: Mapping[str, Point | None],
    seeded: Mapping[str, list[Curve]],
    cliff: Sequence[Curve],
    extra: Mapping,
    full: FullFinetuning | None = None,
    targets: Sequence[Curve] = (),
    target_default: Curve | None = None,
) -> dict[str, Path]:
    """converged.md, converged.json, curves.png and fronts.png, and targets.png with `targets` (the target
    ablation's runs, beside `target_default`); `full`: the LoRA report's full-finetuning rows, compared with
    its own. `selections`: each row's selected point (`select_point`), None where it has none."""
    original = references["Original"].metrics
    forget_rows = extra["forget_rows"]
    spreads = {name: aggregate([run]) for name, run in references.items()}
    for name, reference in references.items():
        d = ks_statistic(reference.metrics[FORGETTING], forget_rows)
        spreads[name]["ks_d"] = None if d is None else Spread(d, d, d, 1)
    floor = report.UTILITY_FLOOR * original[UTILITY]
    selected_lines = []
    for row, chosen in selections.items():
        if chosen is None:
            spreads[f"{row}: no admissible point"] = {}
            selected_lines.append(f"{row}: no admissible point")
            continue
        at_epoch = [point_at(curve, chosen.epoch) for curve in seeded[row]]
        spreads[row] = aggregate([report.EvaluatedModel(dict(point.metrics)) for point in at_epoch])
        under = [f"seed {p.run.seed} (MU {p.utility:.3f})" for p in at_epoch if p.utility < floor]
        selected_lines.append(
            f"{row} {setting(chosen.run)}, epoch {chosen.epoch}"
            + (f" ({', '.join(under)} under the floor of {floor:.3f} at that epoch)" if under else "")
        )
    lines = (
        real_model.reading(spreads, extra["baselines"], extra["subject"])
        if selections.get(extra["subject"])
        else [f"{extra['subject']} has no admissible point: no reading."]
    )
    points = {
        row: [p for curve in tuning if curve.run.row == row for p in curve.points] for row in selections
    }
    fronts = front_lines(points, original[UTILITY])
    curves = {
        method: curve_spreads(curves, {**original, "ks_d": ks_statistic(original[FORGETTING], forget_rows)})
        for method, curves in seeded.items()
    }
    paths = {name: out_dir / name for name in ("converged.md", "converged.json", "curves.png", "fronts.png")}
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_curves(
        paths["curves.png"], curves, references["Retain"].metrics, forget_rows, full.curves if full else None,
        {row: chosen.epoch for row, chosen in selections.items() if chosen},
    )  # fmt: skip
    against_full, full_reading = lora_against_full(full, spreads, points, original[UTILITY])
    plot_fronts(paths["fronts.png"], points, references, UTILITY_SHARES, full.points if full else None)
    ks_column = (("ks_d", f"KS D·{forget_rows} ↓", "{:.1f}"),)
    machine = extra["machine_time_h"]
    markdown = [
        f"# Converged: {extra['title']} on SmolLM2-135M-Instruct at the paper's budget",
        "",
        f"Commit {extra['commit']}; command `{extra['command']}`. Machine time {machine:.1f} h: the "
        f"{len(extra['made_times_s'])} stages' own times when they were made (cached ones included), "
        f"{extra['jobs']} at a time, so about {machine / extra['jobs']:.1f} h of wall time; this invocation "
        f"took {extra['wall_time_h']:.1f} h (stage times in converged.json).",
        "",
        "## Table: each method's selected setting at its selected epoch, mean [min–max] over seeds",
        "",
        f"Selection: {SELECTION_RULE}. At an epoch before the last only the curve metrics (FQ, KS D, MU and "
        "its parts, forget ROUGE) were evaluated: the other cells are —.",
        "",
        real_model.spread_table(spreads, (*real_model.TABLE_1[:1], *ks_column, *real_model.TABLE_1[1:])),
        "",
        real_model.spread_table(spreads, real_model.TABLE_2),
        "",
        "Selected: " + "; ".join(selected_lines) + ".",
        "",
        "## Reading",
        "",
        *(f"- {line}" for line in lines),
        *(f"- {line}" for line in fronts),
        "",
        "## Fronts: every tuning run at every evaluated epoch (seed 0)",
        "",
        front_table(points, original[UTILITY]),
        "",
        "![fronts](fronts.png)",
        "",
        "## Curves: each method's selected setting, per epoch",
        "",
        "![curves](curves.png)",
        "",
        *against_full,
    ]
    cliff_reading: list[str] = []
    if cliff:
        base = next(
            curve
            for curve in tuning
            if curve.run.row == "PALU"
            and curve.run.learning_rate == cliff[0].run.learning_rate
            and curve.run.params.get("lambda") == CONVERGED_KNOB_VALUES["PALU"][0]
        )
        table, cliff_reading = cliff_table(base, cliff, original[UTILITY])
        markdown += ["## PALU's utility cliff", "", table, "", *(f"- {line}" for line in cliff_reading), ""]
    target_reading: list[str] = []
    if targets:
        paths["targets.png"] = out_dir / "targets.png"
        section, target_reading = target_section(
            target_default, targets, references, original[UTILITY], paths["targets.png"]
        )
        markdown += ["## The paper's target ablation (its Figure 4, right)", "", *section]
    notes = list(extra["notes"])
    if not any(spread.get("fluency") for spread in spreads.values()):
        notes.append(
            f"Fluency is — in every row: its classifier ({report.FLUENCY_CLASSIFIER}) was not in this "
            "machine's Hugging Face cache, so the evaluations ran without it "
            "(report.fluency_classifier_available)."
        )
    markdown += ["## How the numbers were made", "", *notes, ""]
    paths["converged.md"].write_text("\n".join(markdown), encoding="utf-8")
    summary = {
        "reading": lines,
        "fronts": fronts,
        "cliff": cliff_reading,
        "targets": target_reading,
        "against_full_finetuning": full_reading,
        "rows": {n: {k: asdict(v) if v else None for k, v in s.items()} for n, s in spreads.items()},
        "selected": {row: chosen.run.name if chosen else None for row, chosen in selections.items()},
        "selected_epochs": {row: chosen.epoch if chosen else None for row, chosen in selections.items()},
        "curves": {
            method: {
                epoch: {k: asdict(v) if v else None for k, v in s.items()} for epoch, s in by_epoch.items()
            }
            for method, by_epoch in curves.items()
        },
        "points": [
            {"run": p.run.name, "row": p.run.row, "epoch": p.epoch, **p.metrics}
            for curve in (*tuning, *cliff, *targets, *(c for cs in seeded.values() for c in cs))
            for p in curve.points
        ],
        "terms": {
            curve.run.name: logged_terms(curve)
            for curve in (*tuning, *cliff, *targets)
            if curve.run.method in PALU_FORMS
        },
        **{key: value for key, value in extra.items() if key not in ("notes", "baselines", "subject")},
    }
    paths["converged.json"].write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    return paths


def run(args: argparse.Namespace, methods: Sequence[str]) -> dict[str, Path]:
    size, lora = TOFU_SIZES[args.size], args.lora
    if args.plan:
        print("\n".join(plan_lines(methods, size, args.jobs, lora)))
        return {}
    commit = commit_of()
    tuning_list = tuning_runs(methods, size, lora)
    rows = list(dict.fromkeys(run.row for run in tuning_list))
    ablated = runs_palu_studies(methods, size, lora)
    cliff_list = cliff_runs(size) if ablated else []
    targets_count = len(TARGET_VARIANTS) if ablated else 0
    runs = len(tuning_list) + len(cliff_list) + targets_count + len(methods) * (len(size.seeds) - 1)
    stages = runs * (2 + len(evaluated_epochs(size.unlearn_epochs)))
    progress = start_run("tofu", "tofu", args.size, args.run_dir, stages)
    progress.say(f"commit {commit}")
    for line in plan_lines(methods, size, args.jobs, lora)[-1:]:
        progress.say(line)
    archive = StageArchive(args.archive, args.results / ".cache") if args.archive else None
    if archive:
        progress.say(f"restored {archive.restore()} finished stages from {args.archive}")
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        mini = tofu_miniature(args, progress, pool)
        keep = None
        if archive and not args.render:
            origin = {
                "original": file_digest(mini.original_dir / "model.safetensors")[:16],
                "commit": commit,
                "machine": this_machine(),
            }
            # archived when they finish, without holding the runs back
            mini.retain_eval.add_done_callback(
                lambda done: archive.keep(done.result().parent, origin, aggregates_only=False)
            )
            mini.original_eval.add_done_callback(lambda done: archive.keep(done.result().parent, origin))

            def keep(stage_dir: Path) -> None:
                archive.keep(stage_dir, origin)

        def unlearn(run_: Run) -> Curve:
            return unlearn_with_curve(mini, run_, keep)

        def unlearn_if_archived(run_: Run) -> Curve | None:
            """`--render`: the run's curve where its stages are archived, else None (said)."""
            try:
                return unlearn(run_)
            except NotCached as missing:
                progress.say(f"--render: {run_.name} left out: {missing}")
                return None

        finished = {curve.run: curve for curve in run_all(pool, unlearn, run_order(tuning_list))}
        tuning = [finished[run_] for run_ in tuning_list]
        references = mini.references()
        selections = {
            row: select_point(
                [p for curve in tuning if curve.run.row == row for p in curve.points],
                references["Original"].metrics,
            )
            for row in rows
        }
        for row, chosen in selections.items():
            progress.say(
                f"selected for {row}: "
                + (f"{chosen.run.name}, epoch {chosen.epoch}" if chosen else "no admissible point")
            )
        selected = {row: chosen.run for row, chosen in selections.items() if chosen}
        more = seed_runs(selected, size.seeds)
        target_default = target_base(tuning, size) if ablated else None
        target_list = target_runs(target_default.run) if ablated else []
        later = run_all(
            pool, unlearn_if_archived if args.render else unlearn, [*more, *cliff_list, *target_list]
        )
    by_run = {curve.run: curve for curve in (*tuning, *later) if curve}
    seeded = {
        row: [by_run[replace(run_, seed=s)] for s in size.seeds if replace(run_, seed=s) in by_run]
        for row, run_ in selected.items()
    }
    cliff = [by_run[run_] for run_ in cliff_list]
    targets = [by_run[run_] for run_ in target_list]
    wall = time.monotonic() - progress.start
    notes = [
        *mini.notes,
        real_model.fq_resolution(size.layout.forget_rows),
        (
            f"LoRA ({LORA_OVERRIDE}, configs/peft/lora.yaml): learning rates "
            f"{list(learning_rates(size, lora))}, the full-finetuning grid x {LORA_RATE_FACTOR}; "
            "knob values: "
            if lora
            else f"Learning rates {list(size.unlearn_learning_rates)} for every method (pilot: issue 30's "
            "table at 8a3b9e1; 3e-4 added when SimNPO at 1e-4 kept 85-86% of MU, docs/real-model.md); knob "
            "values: "
        )
        + "; ".join(
            f"{m} {METHODS[row_method(m)[0]].knob.name} {list(CONVERGED_KNOB_VALUES[row_method(m)[0]])}"
            for m in methods
        )
        + ".",
        *(
            [
                "Held back after issue 59's 12 tuning hours (they cannot change the selection): "
                + "; ".join(
                    f"{row} lr {rate:g} {METHODS[row_method(row)[0]].knob.name} "
                    f"{CONVERGED_KNOB_VALUES[row_method(row)[0]][index]:g}"
                    for row, held in HELD_BACK.items()
                    if row in methods
                    for rate, index in held
                )
                + "."
            ]
            if size is CONVERGED and not lora and any(row in methods for row in HELD_BACK)
            else []
        ),
        f"Selection: {SELECTION_RULE}.",
        f"Curve epochs {list(evaluated_epochs(size.unlearn_epochs))}: forget_quality, forget_Q_A_ROUGE and "
        "model_utility of the stock evaluator; the last epoch: the full set with the paper's metrics. KS D "
        "is "
        "read off FQ (each D has one p-value).",
        "Each unlearning run and evaluation is cached in results/.cache; checkpoints and weights are deleted "
        "once evaluated.",
    ]
    if args.render:
        notes.append(
            "Rendered from the archive (--render): nothing was trained or evaluated again. A selected "
            "setting whose other seeds were never run (the selection rule changed after they ran) is read on "
            "the seeds that were: the tables' last column counts them."
        )
    if archive:
        origins, commits = (
            ", ".join(f"{value} ({count} runs)" for value, count in archive.origins(field).items())
            for field in ("original", "commit")
        )
        notes.append(
            f"Archived in {args.archive} (continued across machines): Original is finetuned again from the "
            f"same recipe and seed on each machine; the unlearning runs by the Original they started from "
            f"(sha1 of its weights): {origins}; by the commit that ran them: {commits}."
        )
    extra = {
        "commit": commit,
        "command": "python -m palu_lab.converged " + " ".join(args.argv),
        "wall_time_h": wall / 3600,
        "machine_time_h": sum(progress.made_times.values()) / 3600,
        "jobs": args.jobs,
        "stage_times_s": progress.stage_times,
        "made_times_s": progress.made_times,
        "forget_rows": size.layout.forget_rows,
        "size": {**asdict(size), "methods": list(methods)},
        "title": "PALU and NPO with LoRA adapters" if lora else "PALU vs stock methods",
        "subject": "PALU LoRA" if lora else "PALU",
        "baselines": [row for row in rows if row != "PALU LoRA"] if lora else REAL_MODEL_BASELINES,
        "notes": notes,
    }
    full = FullFinetuning.read(args.run_dir / "converged.json") if lora else None
    if lora and full is None:
        extra["notes"].append(
            f"No full-finetuning report at {args.run_dir / 'converged.json'}, so the LoRA rows stand "
            "alone: `make converged` (the same options without LoRA=1) makes it, from the cache where it ran."
        )
    out_dir = args.run_dir / "lora" if lora else args.run_dir
    paths = write_report(
        out_dir, references, tuning, selections, seeded, cliff, extra, full, targets, target_default
    )
    return progress.finish(paths)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m palu_lab.converged", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(model="smollm2", data="tofu")  # the real model on real TOFU, nothing else
    parser.add_argument("--methods", nargs="+", choices=[*CONVERGED_KNOB_VALUES, *FORM_ROWS])
    parser.add_argument(
        "--lora",
        action="store_true",
        help=f"the LoRA rows: {', '.join(REAL_MODEL_LORA_METHODS)} with +peft=lora at LoRA's rates, in lora/",
    )
    parser.add_argument(
        "--plan", action="store_true", help="print every run and the estimated time, and exit"
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="make nothing: the report from cached or archived stages only (with --archive), Original and "
        "Retain not finetuned; a seed run that was never made is left out",
    )
    parser.add_argument(
        "--layout",
        choices=tuple(LAYOUTS),
        default="four-author",
        help="four-author: Original knows 2 forget and 2 retain authors; broad: 2 forget and 18 retain "
        "authors, the retain term on all 18 (results/converged-broad-smollm2-tofu/)",
    )
    parser.add_argument(
        "--archive",
        type=Path,
        help="keep finished stages' small files here (commit it) and restore them from it: a run that "
        "continues on another machine",
    )
    args = parse_arguments(parser, argv, "converged")
    args.size = LAYOUTS[args.layout] + ("-fast" if args.fast else "")
    if args.layout == "broad":
        if args.lora:
            parser.error("--layout broad runs full finetuning only (its rows: " + ", ".join(BROAD_ROWS) + ")")
        if not args.run:
            broad_name = args.run_dir.name.replace("converged", "converged-broad", 1)
            args.run_dir = args.run_dir.with_name(broad_name)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    default_rows = BROAD_ROWS if args.layout == "broad" else CONVERGED_ROWS
    run(args, args.methods or list(REAL_MODEL_LORA_METHODS if args.lora else default_rows))


if __name__ == "__main__":
    main()
