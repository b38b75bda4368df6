"""`make demo`: an offline miniature of the paper's TOFU experiment, through open-unlearning's entry points.

Stages: the miniature (palu_lab.miniature: data, tokenizer and tiny Llama from scratch,
Original and Retain finetuned and evaluated with the stock evaluator) → unlearn Original with every method
on a shared learning-rate grid, evaluating each → `summary.md`, `summary.json` and a plot
(palu_trainer.experiments.report). `--bench muse`: the same on a MUSE-News subset. `--model smollm2`: the
real-model experiment on real TOFU, with seeds (palu_lab.real_model).
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path

from omegaconf import OmegaConf

from palu_lab.benchmarks.dataset_folders import IDK_ANSWERS, TofuBenchmark
from palu_lab.benchmarks.muse_subset import SYNTHETIC_ARTICLES
from palu_lab.method_lists import demo_methods
from palu_lab.miniature import (
    MUSE_SIZES,
    TOFU_SIZES,
    Miniature,
    Progress,
    Size,
    add_arguments,
    model_note,
    muse_miniature,
    parse_arguments,
    start_run,
    tofu_miniature,
    unlearning_run_name,
)
from palu_lab.trainer_config import trainer_config
from palu_trainer.experiments import report
from palu_trainer.experiments.benchmark_facts import BENCHMARKS
from palu_trainer.experiments.methods import METHODS, tuning_grid
from palu_trainer.framework.checkout import PROJECT_ROOT
from palu_trainer.method.local_loss import resolve_top_k


def method_notes(methods, benchmark: TofuBenchmark) -> list[str]:
    """Report notes on what the methods' table entries add to their stock configs."""
    notes = [
        f"{name}: also {' '.join(METHODS[name].trainer_overrides)}."
        for name in methods
        if METHODS[name].trainer_overrides
    ]
    if any(METHODS[name].uses_idk_answers for name in methods):
        notes.append(
            f'"I don\'t know" answers: {len(IDK_ANSWERS)} phrasings written for this project to '
            f"{benchmark.idk_answers} (the framework downloads its own from the hub, open-unlearning/idk)."
        )
    return notes


def grid_runs(methods, size: Size) -> list[tuple[str, float, dict, tuple[str, ...]]]:
    """(method, learning rate, report params, extra overrides) of every unlearning run of a comparison."""
    return [
        (method, rate, params, extra)
        for method in methods
        for rate, params, extra in tuning_grid(method, size.unlearn_learning_rates, size.tune_knobs)
    ]


def tuning_budget(methods, size: Size) -> str:
    """The report's line on how many runs each method had, and over what."""
    parts = []
    for method in methods:
        runs = tuning_grid(method, size.unlearn_learning_rates, size.tune_knobs)
        rates = sorted({rate for rate, _, _ in runs})
        knob = METHODS[method].knob if size.tune_knobs else None
        grid = f" x {knob.name} {list(knob.values)} (`{knob.key}`)" if knob else ""
        parts.append(f"{method} {len(runs)} runs: lr {rates}{grid}")
    return "Tuning budget (then the selection rule above): " + "; ".join(parts) + "."


def unlearn_grid(mini: Miniature, methods, pool) -> dict[str, list[report.EvaluatedModel]]:
    """Unlearn Original with every method at every point of its tuning grid, evaluate each."""
    size = mini.stages.size
    jobs = {
        (method, tuple(params.items())): pool.submit(
            mini.unlearn_and_evaluate, method, rate, extra, unlearning_run_name(method, params)
        )
        for method, rate, params, extra in grid_runs(methods, size)
    }
    grids: dict[str, list[report.EvaluatedModel]] = {}
    for (method, params), job in jobs.items():
        eval_json, seconds = job.result()
        run_params = {**dict(params), "epochs": size.unlearn_epochs}
        grids.setdefault(method, []).append(
            report.run_from_eval(eval_json, seconds, run_params, mini.stages.facts.scorecard)
        )
    return grids


def top_k_notes(methods, vocab_size: int) -> list[str]:
    """What each method's `top_k` resolves to on this vocabulary (a share of |V| means the same on any)."""
    notes = []
    for method in methods:
        top_k = OmegaConf.select(trainer_config(METHODS[method].trainer), "method_args.top_k")
        if top_k is not None:
            notes.append(
                f"{method}: top_k={top_k} gives K={resolve_top_k(top_k, vocab_size)} of the "
                f"{vocab_size}-token vocabulary (0.15625 is the paper's K=5000 of Llama-2's 32000)."
            )
    return notes


def compare(args, bench: str, data: str, size: Size, methods, make_miniature):
    """Every method's grid unlearned from the miniature `make_miniature(progress, pool)` makes, and
    evaluated; returns (miniature, references, grids, progress)."""
    progress = start_run(bench, data, args.size, args.run_dir, 2 * len(grid_runs(methods, size)))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        mini = make_miniature(progress, pool)
        grids = unlearn_grid(mini, methods, pool)
        references = mini.references()
    return mini, references, grids, progress


def finish(
    args,
    progress: Progress,
    mini: Miniature,
    references,
    grids,
    methods,
    data: str,
    extra=None,
    **report_args,
):
    """Write the report (`report_args`: write_report's title and notes; `extra`: more JSON)."""
    paths = report.write_report(
        args.run_dir,
        references,
        grids,
        extra={
            "stage_times_s": progress.stage_times,
            "size": {**asdict(mini.stages.size), "methods": methods},
            "data": data,
            **(extra or {}),
        },
        scorecard=mini.stages.facts.scorecard,
        **report_args,
    )
    return progress.finish(paths)


def run_tofu(args: argparse.Namespace, methods: tuple[str, ...] | None = None) -> dict[str, Path]:
    """The comparison on the TOFU miniature that `args` names (`miniature.parse_arguments`)."""
    size = TOFU_SIZES[args.size]
    methods = methods or demo_methods(fast=args.size == "fast")
    make_miniature = partial(tofu_miniature, args)
    mini, references, grids, progress = compare(args, "tofu", args.data, size, methods, make_miniature)
    notes = [
        *mini.notes,
        tuning_budget(methods, size),
        *top_k_notes(methods, mini.vocab_size),
        *method_notes(methods, mini.stages.benchmark),
    ]
    title = f"PALU vs stock unlearning methods — {mini.stages.benchmark.description}"
    return finish(args, progress, mini, references, grids, methods, args.data, title=title, notes=notes)


def run_muse(
    args: argparse.Namespace, muse_dir: Path, methods: tuple[str, ...] | None = None
) -> dict[str, Path]:
    """The comparison on the MUSE miniature, a subset of the MUSE-News folder `muse_dir`."""
    size = MUSE_SIZES[args.size]
    methods = methods or demo_methods(fast=args.size == "fast", bench="muse")
    make_miniature = partial(muse_miniature, args, muse_dir)
    mini, references, grids, progress = compare(args, "muse", "news", size, methods, make_miniature)
    benchmark = mini.stages.benchmark
    agreement = benchmark.annotator_agreement
    notes = [
        f"Data: {benchmark.description}. Rows: "
        + ", ".join(f"{name} {count}" for name, count in benchmark.rows.items())
        + ". KnowMem pairs are also rows of their side's corpus (a model trained from scratch has never "
        "seen a question otherwise; palu_lab.benchmarks.muse_subset).",
        f"{model_note(size, mini.vocab_size)}, finetuned on each corpus row as one sequence (the framework's "
        f"CompletionDataset); every method unlearns Original (forget and retain in the stock "
        f"PretrainingDataset's {size.max_length}-token chunks) for "
        f"{size.unlearn_epochs} epochs, batch {size.unlearn_batch_size}, learning rates "
        f"{list(size.unlearn_learning_rates)}, stock defaults.",
        tuning_budget(methods, size),
        "PALU's spans: the annotator's raw-text mode on the subset's forget rows (background: "
        f"sust/forget_2); against the gold spans of {SYNTHETIC_ARTICLES} held-out synthetic news articles "
        f"(palu_lab.benchmarks.synthetic_news) its word precision / recall / F1 are "
        f"{agreement.precision:.3f} / {agreement.recall:.3f} / {agreement.f1:.3f}.",
        "PrivLeak is relative to Retain's min-k% AUC; Retain's own uses the stock reference AUC of 0.5.",
    ]
    scores = {"precision": agreement.precision, "recall": agreement.recall, "f1": agreement.f1}
    title = f"PALU vs stock unlearning methods on MUSE — {benchmark.description}"
    return finish(
        args,
        progress,
        mini,
        references,
        grids,
        methods,
        "muse-news",
        extra={"annotator_synthetic_news": scores},
        title=title,
        notes=notes,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m palu_lab.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--bench", choices=list(BENCHMARKS), default="tofu")
    add_arguments(parser)
    parser.add_argument(
        "--muse-dir", type=Path, help="MUSE-News in the hub's layout (for --bench muse; default: ../shared)"
    )
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), help="unlearning methods to run (default: the table's)"
    )
    parser.add_argument(
        "--plan", action="store_true", help="with --model smollm2: print every run and the minutes, and exit"
    )
    args = parse_arguments(parser, argv, "")
    methods = tuple(args.methods) if args.methods else None
    if args.model != "tiny":
        from palu_lab import real_model

        real_model.run(args, methods)
    elif args.bench == "muse":
        run_muse(args, args.muse_dir or PROJECT_ROOT.parent / "shared" / "data" / "muse_news", methods)
    else:
        run_tofu(args, methods)


if __name__ == "__main__":
    main()
