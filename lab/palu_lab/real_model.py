"""The real-model TOFU experiment (issue 21): `make demo MINI_MODEL=smollm2` (`demo --model smollm2`).

SmolLM2-135M-Instruct (dequantised from 4 bits; experiments/smollm2.py) on a subset of real TOFU
(`miniature.TOFU_SIZES["smollm2"]`): Original finetuned on the subset, Retain on its retain part, both
through the framework's finetune (seed 0), evaluated with the stock evaluator. Then:
1. tuning on seed 0: every method on its grid (`methods.tuning_grid`, the same number of runs each);
2. the setting the selection rule picks per method, on the other seeds (data order, initialisation of
   anything random: `trainer.args.seed`, which open-unlearning's train.py seeds everything with);
3. two extra rows at PALU's selected setting on every seed: PALU trained on GPT-4o's span annotations
   instead of the project's, and PALU against the reference model (`reference_cache=false`);
4. the report: every row's metrics as mean [min–max] over the seeds (the paper's Table 1 and 2 columns),
   the plot of stock MU vs FQ with min–max bars, and a reading computed from those numbers (`reading`).
Every unlearning run and evaluation is cached on disk by a digest of its inputs: a stopped run continues
from what it finished. `--plan` prints every run and the estimated minutes, and exits.
"""

import argparse
import math
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy
from scipy.stats import ks_2samp

from palu_lab.method_lists import REAL_MODEL_BASELINES, REAL_MODEL_METHODS
from palu_lab.miniature import (
    TOFU_SIZES,
    Miniature,
    RealTofuSize,
    start_run,
    tofu_miniature,
    unlearning_run_name,
)
from palu_trainer.experiments import report
from palu_trainer.experiments.methods import tuning_grid

GPT4O = "gpt4o"  # the label of GPT-4o's span annotations in the subset (`span_annotations/gpt4o.jsonl`)
PALU_GPT4O = "PALU (GPT-4o spans)"
PALU_REFERENCE_MODEL = "PALU (reference model)"
REFERENCE_MODEL = "trainer.method_args.reference_cache=false"
UTILITY, FORGETTING = "model_utility", "forget_quality"
UNLEARN_STEP_WORK = 2.5  # an unlearning step in training steps: forget and retain batches, reference forward
# On a real model the stock MU means what it says (real authors and world facts are answerable): it is the
# x axis and the utility that the selection rule keeps.
SCORECARD = replace(
    report.TOFU,
    utility=UTILITY,
    selection_rule=(
        f"per method, among its seed-0 runs whose stock MU is at least {report.UTILITY_FLOOR:.0%} of the "
        "Original's, the one with the highest forget quality; if none keeps that much utility, the run "
        "with the highest MU"
    ),
    x_label="stock model utility (MU) ↑",
    title="MU vs forget quality: mean over seeds, bars min–max",
)
# The report's columns: the paper's Table 1, then the stock metrics it leaves out, then Table 2.
TABLE_1 = (*report.PAPER_TABLE_1, ("forget_rouge", "forget ROUGE ↓", "{:.3f}"))
TABLE_1 += (("retain_rouge", "retain ROUGE", "{:.3f}"), ("privleak", "privleak (→0)", "{:.1f}"))
TABLE_2 = report.PAPER_TABLE_2


@dataclass(frozen=True)
class Run:
    """One unlearning run: the report row it belongs to, the method, its setting and seed.

    spans: a label of another span file in the subset's `span_annotations/` (None: the benchmark's own).
    """

    row: str
    method: str
    seed: int
    learning_rate: float
    params: Mapping = field(hash=False)
    extra: tuple[str, ...] = ()
    spans: str | None = None

    @property
    def name(self) -> str:
        label = {PALU_GPT4O: "PALU-gpt4o-spans", PALU_REFERENCE_MODEL: "PALU-reference-model"}
        return unlearning_run_name(label.get(self.row, self.method), {**self.params, "seed": self.seed})

    def overrides(self) -> tuple[str, ...]:
        return (*self.extra, f"trainer.args.seed={self.seed}")


@dataclass(frozen=True)
class Spread:
    """A metric over seeds: mean, min and max, and how many seeds had a value."""

    mean: float
    low: float
    high: float
    seeds: int

    def format(self, pattern: str = "{:.3g}") -> str:
        if self.seeds == 1:
            return pattern.format(self.mean)
        return f"{pattern.format(self.mean)} [{pattern.format(self.low)}–{pattern.format(self.high)}]"

    def overlaps(self, other: "Spread") -> bool:
        return self.low <= other.high and other.low <= self.high


def aggregate(runs: Sequence[report.EvaluatedModel]) -> dict[str, Spread | None]:
    """Every metric of `runs` (one per seed) as its mean and min–max; None where no run has a value."""
    names = dict.fromkeys(name for run in runs for name in run.metrics)
    spreads: dict[str, Spread | None] = {}
    for name in names:
        values = [run.metrics.get(name) for run in runs]
        values = [float(value) for value in values if value is not None and not math.isnan(value)]
        spreads[name] = (
            Spread(float(numpy.mean(values)), min(values), max(values), len(values)) if values else None
        )
    return spreads


def fq_ladder(rows: int) -> list[float]:
    """The values FQ can take with `rows` forget rows against as many of Retain's: the two-sample KS
    p-value at D = k/rows, k = 0..rows (the framework's `ks_2samp`, default method)."""
    base = numpy.arange(rows, dtype=float)
    values = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # exact -> asymptotic for large D
        for k in range(rows + 1):
            values.append(float(ks_2samp(base, base + (k - 0.5 if k else 0.0)).pvalue))
    return values


def fq_resolution(rows: int) -> str:
    """What FQ can resolve with `rows` forget rows: its first values and its largest single step."""
    ladder = fq_ladder(rows)
    steps = [high - low for high, low in zip(ladder, ladder[1:], strict=False)]
    largest = max(range(len(steps)), key=steps.__getitem__)
    shown = ", ".join(f"{value:.3g}" for value in ladder[:12])
    return (
        f"FQ is the KS p-value of {rows} forget truth ratios against Retain's {rows}: the statistic D moves "
        f"in steps of 1/{rows}, so FQ takes only {rows + 1} values, {shown}, … "
        f"(D = 0, 1/{rows}, 2/{rows}, …). "
        f"The smallest change FQ can show is one step of D; the largest such step is "
        f"{ladder[largest]:.3g} → {ladder[largest + 1]:.3g} (D = {largest}/{rows} → {largest + 1}/{rows})."
    )


def tuning_runs(methods: Sequence[str], size: RealTofuSize) -> list[Run]:
    """Every method's grid on the first seed."""
    return [
        Run(method, method, size.seeds[0], rate, params, extra)
        for method in methods
        for rate, params, extra in tuning_grid(method, size.unlearn_learning_rates, size.tune_knobs)
    ]


def tuning_note(methods: Sequence[str], size: RealTofuSize) -> str:
    """The report's line on the equal tuning budget."""
    runs = len(tuning_grid(methods[0], size.unlearn_learning_rates, size.tune_knobs))
    grid = (
        "learning rates x the method's knob (the table's grid)"
        if size.tune_knobs
        else "the stated subset of the table's grid: every method at its config's knob value"
    )
    return (
        f"Tuning budget: {runs} runs per method on seed {size.seeds[0]}, learning rates "
        f"{list(size.unlearn_learning_rates)}, {grid}; the selected setting then runs on seeds "
        f"{list(size.seeds[1:])}."
    )


def seed_runs(selected: Mapping[str, Run], seeds: Sequence[int]) -> list[Run]:
    """The selected setting of every method on the other seeds, and PALU's extra rows on every seed."""
    runs = [replace(run, seed=seed) for run in selected.values() for seed in seeds[1:]]
    palu = selected.get("PALU")
    if palu is not None:
        runs += [replace(palu, row=PALU_GPT4O, seed=seed, spans=GPT4O) for seed in seeds]
        runs += [
            replace(palu, row=PALU_REFERENCE_MODEL, seed=seed, extra=(*palu.extra, REFERENCE_MODEL))
            for seed in seeds
        ]
    return runs


def seed_run_count(methods: Sequence[str], seeds: Sequence[int]) -> int:
    return len(methods) * (len(seeds) - 1) + (2 * len(seeds) if "PALU" in methods else 0)


def budget(methods: Sequence[str], size: RealTofuSize, jobs: int) -> dict[str, float]:
    """Estimated wall minutes per stage: steps x the size's seconds per step, plus process starts and
    evaluations, `jobs` processes at a time (the costs are measured beside another job)."""
    layout, step, start = size.layout, size.step_seconds, size.process_seconds
    retain_rows = len(layout.retain_authors) * layout.rows_per_author
    batch = size.finetune_batch_size or 8
    finetunes = [
        math.ceil(rows / batch) * size.finetune_epochs * step + start
        for rows in (layout.forget_rows + retain_rows, retain_rows)
    ]
    # each unlearning step runs a forget and a retain batch, and most methods a reference forward
    steps = math.ceil(layout.forget_rows / size.unlearn_batch_size) * size.unlearn_epochs
    unlearn = UNLEARN_STEP_WORK * steps * step + start
    per_run = unlearn + size.eval_seconds
    parallel = min(jobs, 2)
    seconds = {
        "finetune Original and Retain": max(finetunes) if parallel > 1 else sum(finetunes),
        "evaluate Original and Retain": 2 * size.eval_seconds / parallel,
        "tuning on seed 0": len(tuning_runs(methods, size)) * per_run / parallel,
        "selected settings on the other seeds, extra PALU rows": (
            seed_run_count(methods, size.seeds) * per_run / parallel
        ),
    }
    return {stage: value / 60 for stage, value in seconds.items()}


def budget_lines(methods: Sequence[str], size: RealTofuSize, jobs: int) -> list[str]:
    minutes = budget(methods, size, jobs)
    lines = [f"  {stage}: {value:.0f} min" for stage, value in minutes.items()]
    return [*lines, f"  total: {sum(minutes.values()):.0f} min (estimate, {min(jobs, 2)} jobs at a time)"]


def plan_lines(methods: Sequence[str], size: RealTofuSize, size_name: str, jobs: int) -> list[str]:
    """Every run of the experiment and the estimated minutes (`--plan`)."""
    layout = size.layout
    retain_rows = len(layout.retain_authors) * layout.rows_per_author
    lines = [
        f"real-model experiment, size {size_name}: {size.model_config}, "
        f"{'bf16 (training under autocast, evaluation in bf16)' if size.bf16 else 'fp32'}",
        f"data: forget05 authors {layout.forget_authors.start}-{layout.forget_authors.stop - 1} "
        f"({layout.forget_rows} forget rows), {len(layout.retain_authors)} retain authors "
        f"({retain_rows} rows), "
        f"holdout authors {layout.holdout_authors.start}-{layout.holdout_authors.stop - 1}, "
        f"evaluation-only sets capped at {layout.eval_rows} rows, {size.eval_max_new_tokens} new tokens",
        fq_resolution(layout.forget_rows),
        f"finetune Original (full, {layout.forget_rows + retain_rows} rows) and Retain (retain_subset, "
        f"{retain_rows} rows): {size.finetune_epochs} epochs, lr {size.finetune_learning_rate:g}, "
        f"batch {size.finetune_batch_size}, seed {size.seeds[0]}; then both evaluated",
        f"unlearning: {size.unlearn_epochs} epochs, batch {size.unlearn_batch_size}; "
        f"seeds {list(size.seeds)}",
        f"tuning on seed {size.seeds[0]} ({len(tuning_runs(methods, size))} runs):",
        *(f"  {run.name}" for run in tuning_runs(methods, size)),
        f"then ({seed_run_count(methods, size.seeds)} runs; <setting> = the method's selected one):",
        *(f"  {method}_<setting>_seed{seed}" for method in methods for seed in size.seeds[1:]),
    ]
    if "PALU" in methods:
        lines += [f"  {PALU_GPT4O}: PALU-gpt4o-spans_<setting>_seed{seed}" for seed in size.seeds]
        lines += [
            f"  {PALU_REFERENCE_MODEL}: PALU-reference-model_<setting>_seed{seed} ({REFERENCE_MODEL})"
            for seed in size.seeds
        ]
    return [*lines, "estimated wall time:", *budget_lines(methods, size, jobs)]


def unlearn_and_evaluate(mini: Miniature, run: Run) -> report.EvaluatedModel:
    """Unlearn Original as `run` says and evaluate (both cached)."""
    stages = mini.stages
    spans = stages.benchmark.span_annotations.parent / f"{run.spans}.jsonl" if run.spans else None
    out_dir, seconds = stages.unlearn_cached(
        run.method, run.learning_rate, mini.original_dir, run.overrides(), run.name, spans
    )
    eval_json = stages.evaluate(run.name, out_dir, mini.retain_eval, cache=True)
    params = {**run.params, "seed": run.seed, "epochs": stages.size.unlearn_epochs}
    return report.run_from_eval(eval_json, seconds, params, SCORECARD)


def compare(first: str, second: str, rows: Mapping[str, Mapping[str, Spread | None]]) -> tuple[str, str]:
    """(verdict, sentence) on `first`'s FQ against `second`'s at their utilities, against the seed spread.

    Verdicts: "beats" (FQ higher on every seed: ranges apart, and utility no lower: MU ranges overlap or
    first's is higher), "ahead within the spread" / "behind within the spread" (FQ ranges overlap),
    "behind" (FQ lower on every seed), each with " at lower utility" when first's MU range lies below.
    """
    fq_a, fq_b = rows[first].get(FORGETTING), rows[second].get(FORGETTING)
    mu_a, mu_b = rows[first].get(UTILITY), rows[second].get(UTILITY)
    if None in (fq_a, fq_b, mu_a, mu_b):
        return "unknown", f"{first} vs {second}: a metric is missing, no reading."
    if fq_a.low > fq_b.high:
        verdict = "beats"
    elif fq_a.high < fq_b.low:
        verdict = "behind"
    else:
        verdict = (
            "level within the spread"
            if fq_a.mean == fq_b.mean
            else "ahead within the spread"
            if fq_a.mean > fq_b.mean
            else "behind within the spread"
        )
    lower_utility = mu_a.high < mu_b.low
    if lower_utility:
        verdict += " at lower utility"
    difference = fq_a.mean - fq_b.mean
    spread = max(fq_a.high - fq_a.low, fq_b.high - fq_b.low)
    against = (
        f"{abs(difference) / spread:.1f}x the larger seed range ({spread:.3g})" if spread > 0 else "no spread"
    )
    utility = f"MU {mu_a.format('{:.3f}')} vs {mu_b.format('{:.3f}')}: " + (
        "equal within the seed ranges"
        if mu_a.overlaps(mu_b)
        else f"{'lower' if lower_utility else 'higher'} by {abs(mu_a.mean - mu_b.mean):.3f}"
    )
    phrase = {
        "beats": f"beats {second} on every seed",
        "behind": f"is behind {second} on every seed",
        "ahead within the spread": f"is ahead of {second} within the seed spread",
        "behind within the spread": f"is behind {second} within the seed spread",
        "level within the spread": f"is level with {second}",
    }[verdict.removesuffix(" at lower utility")]
    sentence = (
        f"{first} vs {second}: FQ {fq_a.format()} vs {fq_b.format()}, mean difference {difference:+.3g} = "
        f"{against}; {utility}. Reading: {first} {phrase}{' at lower utility' if lower_utility else ''}."
    )
    return verdict, sentence


def reading(
    rows: Mapping[str, Mapping[str, Spread | None]],
    baselines: Sequence[str] = REAL_MODEL_BASELINES,
    subject: str = "PALU",
) -> list[str]:
    """The report's reading, computed from the rows' spreads over seeds: does `subject`'s FQ (PALU's, or a
    variant's row) beat each baseline's at equal utility, and by how much against the spread; do GPT-4o's
    spans and the reference model change PALU's."""
    if subject not in rows:
        return [f"{subject} was not run: no reading."]
    present = [name for name in baselines if name in rows]
    verdicts, lines = {}, []
    for name in present:
        verdicts[name], sentence = compare(subject, name, rows)
        lines.append(sentence)
    beaten = [name for name in present if verdicts[name] == "beats"]
    summary = (
        f"{subject} beats {', '.join(beaten)} on FQ at equal or higher utility on every seed"
        if beaten
        else f"{subject} beats none of " + ", ".join(present) + " on FQ on every seed at equal utility"
    )
    rest = [name for name in present if name not in beaten]
    if beaten and rest:
        summary += f"; not {', '.join(rest)}"
    lines.insert(0, summary + f" (FQ ranges over seeds apart, MU ranges overlapping or {subject}'s higher).")
    for extra, question in ((PALU_GPT4O, "Span quality"), (PALU_REFERENCE_MODEL, "Reference cache")):
        if extra in rows:
            lines.append(f"{question}: " + compare(extra, "PALU", rows)[1])
    return lines


def spread_table(rows: Mapping[str, Mapping[str, Spread | None]], columns) -> str:
    """A Markdown table of every row's metrics as mean [min–max] over seeds."""
    headers = ["model", *(header for _, header, _ in columns), "seeds"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for name, spreads in rows.items():
        cells = [spreads[key].format(pattern) if spreads.get(key) else "—" for key, _, pattern in columns]
        seeds = max((spread.seeds for spread in spreads.values() if spread), default=0)
        lines.append("| " + " | ".join([name, *cells, str(seeds)]) + " |")
    return "\n".join(lines)


def plot(path: Path, rows: Mapping[str, Mapping[str, Spread | None]], references: Sequence[str]) -> None:
    """Stock MU (x) vs FQ (y, log): each row at its mean over seeds, bars from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 5))
    for name, spreads in rows.items():
        x, y = spreads.get(UTILITY), spreads.get(FORGETTING)
        if x is None or y is None:
            continue
        floor = report.FQ_FLOOR
        ys = [max(value, floor) for value in (y.mean, y.low, y.high)]
        if name in references:  # Original a star, Retain a plus, as report.plot draws them
            style = {"marker": "*P"[list(references).index(name) % 2], "color": "black", "markersize": 12}
        else:
            style = {"marker": "s" if name.startswith("PALU (") else "o"}
        axes.errorbar(
            [x.mean],
            [ys[0]],
            xerr=[[x.mean - x.low], [x.high - x.mean]],
            yerr=[[ys[0] - ys[1]], [ys[2] - ys[0]]],
            capsize=4,
            linestyle="none",
            label=name,
            **style,
        )
    report.save_plot(figure, axes, path, SCORECARD, legend_size=8)


def write_report(
    out_dir: Path,
    references: Mapping[str, report.EvaluatedModel],
    rows: Mapping[str, Sequence[report.EvaluatedModel]],
    tuning: Mapping[str, Sequence[report.EvaluatedModel]],
    notes: Sequence[str],
    extra: Mapping,
) -> dict[str, Path]:
    """summary.md, summary.json and mu_vs_fq.png: references, every row over seeds, the reading, the tuning
    runs."""
    spreads = {name: aggregate([run]) for name, run in references.items()}
    spreads |= {name: aggregate(runs) for name, runs in rows.items()}
    lines = reading(spreads)
    tuning_rows = {
        f"{method} ({report.format_params(run.params)})": run
        for method, runs in tuning.items()
        for run in runs
    }
    markdown = [
        "# PALU vs stock unlearning methods on a real model: SmolLM2-135M-Instruct (dequantised from 4 bits)",
        "",
        "Every cell: mean [min–max] over the seeds (Original and Retain: one model each).",
        "",
        "## The paper's Table 1: utility, memorization, truth ratios (and the stock ROUGEs, privleak)",
        "",
        spread_table(spreads, TABLE_1),
        "",
        "## The paper's Table 2: membership inference AUCs, forget vs holdout",
        "",
        spread_table(spreads, TABLE_2),
        "",
        "## Reading",
        "",
        *(f"- {line}" for line in lines),
        "",
        "## How the numbers were made",
        "",
        f"Selection: {SCORECARD.selection_rule}.",
        *(f"\n{note}" for note in notes),
        "",
        "## Tuning runs (seed 0)",
        "",
        report.table(tuning_rows, report.COLUMNS),
        "",
        f"![{SCORECARD.title}]({SCORECARD.plot_file})",
        "",
    ]
    summary = {
        "reading": lines,
        "rows": {
            name: {key: asdict(value) if value else None for key, value in s.items()}
            for name, s in spreads.items()
        },
        "runs": {name: [vars(run) for run in runs] for name, runs in rows.items()},
        "references": {name: vars(run) for name, run in references.items()},
        "tuning": {method: [vars(run) for run in runs] for method, runs in tuning.items()},
        **extra,
    }
    paths = report.save_summary(out_dir, markdown, summary, SCORECARD)
    plot(paths["plot"], spreads, list(references))
    return paths


def run(args: argparse.Namespace, methods: Sequence[str] | None = None) -> dict[str, Path]:
    """The experiment that `args` names (`demo --model smollm2`), or its plan (`--plan`)."""
    size = TOFU_SIZES[args.size]
    methods = tuple(methods or REAL_MODEL_METHODS)
    if args.plan:
        print("\n".join(plan_lines(methods, size, args.size, args.jobs)))
        return {}
    tuning = tuning_runs(methods, size)
    stage_count = 2 * (len(tuning) + seed_run_count(methods, size.seeds))
    progress = start_run("tofu", "tofu", args.size, args.run_dir, stage_count)
    for line in ["estimated wall time:", *budget_lines(methods, size, args.jobs)]:
        progress.say(line)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        mini = tofu_miniature(args, progress, pool)
        tuned = dict(
            zip(tuning, pool.map(lambda run_: unlearn_and_evaluate(mini, run_), tuning), strict=True)
        )
        references = mini.references()
        original_utility = references["Original"].metrics[UTILITY] or 0.0
        selected = {}
        for method in methods:
            runs = [run_ for run_ in tuned if run_.method == method]
            best = report.select_run([tuned[run_] for run_ in runs], original_utility, SCORECARD)
            selected[method] = next(run_ for run_ in runs if tuned[run_] is best)
            progress.say(f"selected {selected[method].name}")
        more = seed_runs(selected, size.seeds)
        results = {
            **tuned,
            **dict(zip(more, pool.map(lambda run_: unlearn_and_evaluate(mini, run_), more), strict=True)),
        }
    rows: dict[str, list[report.EvaluatedModel]] = {}
    for run_, evaluated in results.items():
        chosen = selected[run_.method]
        if run_.row != run_.method or (run_.params == chosen.params and run_.extra == chosen.extra):
            rows.setdefault(run_.row, []).append(evaluated)
    tuning_by_method = {
        method: [tuned[run_] for run_ in tuned if run_.method == method] for method in methods
    }
    layout = size.layout
    notes = [
        *mini.notes[:1],
        f"Model: {size.model_config} (dequantised from 4 bits), "
        f"{'bf16 autocast in training, bf16 weights in evaluation' if size.bf16 else 'fp32'}; Original and "
        f"Retain finetuned {size.finetune_epochs} epochs at lr {size.finetune_learning_rate:g}, batch "
        f"{size.finetune_batch_size}, seed {size.seeds[0]}; unlearning {size.unlearn_epochs} epochs, batch "
        f"{size.unlearn_batch_size}, seeds {list(size.seeds)} (`trainer.args.seed`: data order and "
        "everything the framework seeds); evaluation: the stock TOFU evaluator, evaluation-only sets capped "
        f"at {layout.eval_rows} rows, {size.eval_max_new_tokens} new tokens.",
        fq_resolution(layout.forget_rows),
        tuning_note(methods, size),
        f"{PALU_GPT4O}: PALU at its selected setting trained on GPT-4o's span annotations of forget05 "
        "(../shared) instead of the project's (span_annotations/tofu_forget05.jsonl), which every other "
        f"span method uses. {PALU_REFERENCE_MODEL}: PALU at its selected setting with `{REFERENCE_MODEL}`.",
        "Wall times: stage_times_s in summary.json.",
    ]
    extra = {
        "stage_times_s": progress.stage_times,
        "size": {**asdict(size), "methods": methods},
        "selected": {method: run_.name for method, run_ in selected.items()},
    }
    paths = write_report(args.run_dir, references, rows, tuning_by_method, notes, extra)
    return progress.finish(paths)
