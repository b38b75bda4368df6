"""`make convergence`: forget quality and utility after every unlearning epoch (the paper's Figure 5).

Each method unlearns the miniature's cached Original once, with the framework saving a checkpoint per epoch
(`trainer.args.save_strategy=epoch`); every checkpoint is evaluated with the stock TOFU evaluator, then
removed. Epoch 0 is Original itself. Output in results/convergence/: convergence.png, .md and .json.
"""

import argparse
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from palu_lab.method_lists import CONVERGENCE_METHODS
from palu_lab.miniature import (
    TOFU_SIZES,
    add_arguments,
    parse_arguments,
    start_run,
    tofu_miniature,
    whole_epoch_checkpoints,
)
from palu_trainer.experiments import report
from palu_trainer.experiments.methods import METHODS

PER_EPOCH_CHECKPOINTS = ("trainer.args.save_strategy=epoch", "trainer.args.save_only_model=true")


def unlearn_per_epoch(mini, method: str, learning_rate: float, epochs: int) -> list[report.EvaluatedModel]:
    """Unlearn with a checkpoint per epoch; evaluate each, then delete it. One run per epoch, in order."""
    name = f"{method}_convergence"
    overrides = [*PER_EPOCH_CHECKPOINTS, f"trainer.args.num_train_epochs={epochs}"]
    out_dir, seconds = mini.stages.unlearn(method, learning_rate, mini.original_dir, overrides, name)
    checkpoints = whole_epoch_checkpoints(out_dir)
    if sorted(checkpoints) != list(range(1, epochs + 1)):
        raise RuntimeError(f"{out_dir}: checkpoints of epochs {sorted(checkpoints)}, not 1-{epochs}")
    runs = []
    for epoch, checkpoint in sorted(checkpoints.items()):
        eval_json = mini.stages.evaluate(f"{name}_epoch{epoch}", checkpoint, mini.retain_eval, cache=False)
        runs.append(
            report.run_from_eval(eval_json, seconds * epoch / epochs, {"lr": learning_rate, "epoch": epoch})
        )
        shutil.rmtree(checkpoint)
    return runs


def plot(path: Path, curves: dict[str, list[report.EvaluatedModel]], references) -> None:
    """Two panels against epoch: forget quality (log) and retain utility; Retain as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (fq_axes, utility_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, runs in curves.items():
        epochs = [run.params["epoch"] for run in runs]
        quality = [max(run.metrics["forget_quality"] or 0.0, report.FQ_FLOOR) for run in runs]
        fq_axes.plot(epochs, quality, marker="o", label=method)
        utility_axes.plot(
            epochs, [run.metrics["retain_utility"] or 0.0 for run in runs], marker="o", label=method
        )
    retain = references["Retain"].metrics
    fq_axes.axhline(retain["forget_quality"], color="black", ls="--", lw=1, label="Retain")
    utility_axes.axhline(retain["retain_utility"], color="black", ls="--", lw=1, label="Retain")
    fq_axes.set_yscale("log")
    fq_axes.set_ylabel("forget quality (log)")
    utility_axes.set_ylabel("retain utility")
    utility_axes.set_ylim(0, 1.05)
    for axes in (fq_axes, utility_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_xlabel("unlearning epoch (0 = Original)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle("Convergence: every epoch's checkpoint, stock TOFU evaluator", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_convergence(args, methods: list[str]) -> dict[str, Path]:
    """Every method's curve on the miniature that `args` names: convergence.png, .md and .json."""
    size = TOFU_SIZES[args.size]
    epochs = args.epochs or size.unlearn_epochs
    progress = start_run("tofu", args.data, args.size, args.run_dir, len(methods) * (1 + epochs))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        mini = tofu_miniature(args, progress, pool)
        jobs = {method: pool.submit(unlearn_per_epoch, mini, method, args.lr, epochs) for method in methods}
        references = mini.references()
        start = report.EvaluatedModel(references["Original"].metrics, 0.0, {"lr": args.lr, "epoch": 0})
        curves = {method: [start, *job.result()] for method, job in jobs.items()}

    out_dir = args.run_dir
    paths = {name: out_dir / name for name in ("convergence.png", "convergence.md", "convergence.json")}
    plot(paths["convergence.png"], curves, references)
    rows = {f"{method}, epoch {run.params['epoch']}": run for method, runs in curves.items() for run in runs}
    paths["convergence.md"].write_text(
        "\n".join([
            "# Convergence: forget quality and utility after every unlearning epoch",
            "",
            report.table({**references, **rows}),
            "",
            f"Every method at lr {args.lr:g} with its stock config, {epochs} epochs; wall time: share of the "
            "unlearning run up to that epoch. Epoch 0 is Original.",
            *mini.notes,
            "",
            *report.TOFU.paper_sections({**references, **rows}),
            "",
            "![convergence](convergence.png)",
            "",
        ]),
        encoding="utf-8",
    )  # fmt: skip
    summary = {
        "references": {name: vars(run) for name, run in references.items()},
        "curves": {method: [vars(run) for run in runs] for method, runs in curves.items()},
        "wall_time_s": round(time.monotonic() - progress.start, 1),
        "stage_times_s": progress.stage_times,
    }
    paths["convergence.json"].write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    return progress.finish(paths)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m palu_lab.convergence", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(CONVERGENCE_METHODS))
    parser.add_argument("--lr", type=float, default=1e-3, help="every method's learning rate")
    parser.add_argument("--epochs", type=int, help="default: the size's unlearning epochs (10; FAST 5)")
    args = parse_arguments(parser, argv, "convergence")
    run_convergence(args, args.methods)


if __name__ == "__main__":
    main()
