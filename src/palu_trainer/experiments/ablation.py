"""`make ablation`: the paper's PALU ablations (its Figure 4 and strategy tables) on the offline miniature.

One axis at a time, the others at the demo's PALU defaults: every point unlearns the demo's cached
Original with PALU plus the point's overrides, is evaluated with the stock TOFU evaluator, and lands in a
bar chart (forget quality on a log left axis, retain utility on the right, Original and Retain as lines)
and a table per axis, in results/ablation/.
"""

import argparse
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from palu_trainer.experiments import report
from palu_trainer.experiments.demo import (
    MINIATURE_STAGES,
    Progress,
    add_miniature_arguments,
    build_miniature,
    parse_miniature_arguments,
)


@dataclass(frozen=True)
class Axis:
    """One ablation: its title, its points (label, overrides) and the label of PALU's default point."""

    title: str
    points: tuple[tuple[str, tuple[str, ...]], ...]
    default: str
    needs: str = ""  # what must be merged before every point of it runs


def top_k(value: str) -> tuple[str, ...]:
    return (f"trainer.method_args.top_k={value}",)


def initiating(strategy: str, **values) -> tuple[str, ...]:
    return (f"initiating_strategy={strategy}", *(f"{key}={value}" for key, value in values.items()))


# THE table of the paper's axes (one place to adjust override names). K is a share of |V| matching the
# paper's values on Llama-2 (1, 1000, 5000, 10000 of 32000); N and the strategy belong to the forget dataset.
AXES = {
    "k": Axis(
        "K: reference top-K flattened (share of |V|; Llama-2 values)",
        (
            ("1", top_k("1")),
            ("1k/32k", top_k("0.03125")),
            ("5k/32k", top_k("0.15625")),
            ("10k/32k", top_k("0.3125")),
            ("all", top_k("all")),
        ),
        default="5k/32k",
        needs="issue #11 (top_k as a share of |V| or `all`)",
    ),
    "n": Axis(
        "N: initiating tokens per span",
        (*((str(n), (f"num_initiating_tokens={n}",)) for n in (1, 2, 3, 4)), ("All", initiating("all"))),
        default="3",
        needs="issue #11 for All (initiating_strategy)",
    ),
    "c": Axis(
        "c: target of the local entropy loss",
        tuple(
            (target, (f"trainer.method_args.target={target}",))
            for target in ("uniform", "topk_mean", "ref_mean", "global_mean")
        ),
        default="global_mean",
    ),
    "strategy": Axis(
        "initiating tokens of each span",
        (
            ("first 3", initiating("first_n", num_initiating_tokens=3)),
            ("random 3", initiating("random_n", num_initiating_tokens=3)),
            ("all tokens", initiating("all")),
            ("first 25%", initiating("ratio", initiating_ratio=0.25)),
            ("first 50%", initiating("ratio", initiating_ratio=0.5)),
            ("first 100%", initiating("ratio", initiating_ratio=1.0)),
        ),
        default="first 3",
        needs="issue #11 (initiating_strategy)",
    ),
}
METHOD = "PALU"


def slug(label: str) -> str:
    """A point's label as part of a run name: "first 25%" -> "first-25pct"."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", label.replace("%", "pct")).strip("-")


def point_name(axis_name: str, label: str) -> str:
    return f"{METHOD}_{axis_name}_{slug(label)}"


def run_point(mini, axis_name: str, label: str, overrides, learning_rate: float) -> report.EvaluatedModel:
    """Unlearn and evaluate one point; a failed run becomes a row that names its log instead of numbers."""
    name = point_name(axis_name, label)
    params = {"lr": learning_rate, "overrides": " ".join(overrides)}
    try:
        eval_json, seconds = mini.demo.unlearn_and_evaluate(
            METHOD, learning_rate, mini.original_dir, mini.retain_eval.result, overrides, name
        )
    except RuntimeError as error:
        mini.progress.say(f"{name} failed: {str(error).splitlines()[0]}")
        return report.EvaluatedModel({}, None, {**params, "error": f"logs/unlearn_{name}.log"})
    return report.run_from_eval(eval_json, seconds, params)


def rendered_point(
    mini, axis_name: str, label: str, overrides, learning_rate: float
) -> report.EvaluatedModel:
    """`--render`: the point's evaluation from an earlier run, or a row saying it has none."""
    name = point_name(axis_name, label)
    params = {"lr": learning_rate, "overrides": " ".join(overrides)}
    eval_json = mini.demo.finished_evaluation(name, mini.original_eval.result())
    if eval_json is None:
        return report.EvaluatedModel({}, None, {**params, "error": f"not evaluated, logs/unlearn_{name}.log"})
    return report.run_from_eval(eval_json, None, params)


def plot_axis(path: Path, axis: Axis, points: dict[str, report.EvaluatedModel], references) -> None:
    """Figure 4 of the paper: FQ bars on a log left axis, retain utility bars on the right axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(points)
    xs = range(len(labels))
    ran = [x for x, run in zip(xs, points.values(), strict=True) if "error" not in run.params]
    runs = [run for run in points.values() if "error" not in run.params]
    quality = [max(run.metrics["forget_quality"] or 0.0, report.FQ_FLOOR) for run in runs]
    utility = [run.metrics["retain_utility"] or 0.0 for run in runs]
    figure, fq_axes = plt.subplots(figsize=(max(6, 1.3 * len(labels) + 2), 5))
    utility_axes = fq_axes.twinx()
    width = 0.38
    fq_axes.bar([x - width / 2 for x in ran], quality, width, color="tab:blue", label="forget quality (left)")
    utility_axes.bar(
        [x + width / 2 for x in ran], utility, width, color="tab:orange", label="retain utility (right)"
    )
    for name, style in (("Original", ":"), ("Retain", "--")):
        metrics = references[name].metrics
        fq_axes.axhline(max(metrics["forget_quality"], report.FQ_FLOOR), color="tab:blue", ls=style, lw=1.2)
        utility_axes.axhline(metrics["retain_utility"], color="tab:orange", ls=style, lw=1.2)
        fq_axes.plot([], [], color="gray", ls=style, label=f"{name} (blue: FQ, orange: utility)")
    original_quality = max(references["Original"].metrics["forget_quality"] or 0.0, report.FQ_FLOOR)
    bottom = min([*quality, original_quality]) / 10
    fq_axes.set_yscale("log")
    fq_axes.set_ylim(bottom=bottom, top=3)
    for x, run in zip(xs, points.values(), strict=True):
        if "error" in run.params:
            fq_axes.text(x, bottom * 3, "no result:\nsee table", ha="center", fontsize=8, color="red")
    utility_axes.set_ylim(0, 1.05)
    fq_axes.set_xticks(
        list(xs), [f"{label}\n(default)" if label == axis.default else label for label in labels]
    )
    fq_axes.set_ylabel(f"forget quality (KS p-value vs Retain, log; < {report.FQ_FLOOR:g} drawn at it)")
    utility_axes.set_ylabel("retain utility")
    fq_axes.set_title(f"PALU ablation — {axis.title}", fontsize=10)
    handles = [*fq_axes.get_legend_handles_labels()[0], *utility_axes.get_legend_handles_labels()[0]]
    figure.legend(handles=handles, fontsize=8, loc="lower center", ncol=2)
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_axis(out_dir: Path, axis_name: str, axis: Axis, points, references, notes) -> dict[str, Path]:
    rows = {**references, **{f"{axis_name}={label}": run for label, run in points.items()}}
    failed = {label: run.params["error"] for label, run in points.items() if "error" in run.params}
    markdown = [
        f"# PALU ablation — {axis.title}",
        "",
        f"Default point: {axis.default}. " + (f"Needs {axis.needs}." if axis.needs else ""),
        "",
        report.table(rows),
        "",
        report.table(rows, report.PAPER_TABLE_1[1:], "point"),
        "",
        *(f"- {label}: no result ({log})" for label, log in failed.items()),
        *notes,
        "",
        f"![{axis.title}]({axis_name}.png)",
        "",
    ]
    paths = {"table": out_dir / f"{axis_name}.md", "chart": out_dir / f"{axis_name}.png"}
    paths["table"].write_text("\n".join(markdown), encoding="utf-8")
    plot_axis(paths["chart"], axis, points, references)
    return paths


def run(args, axes: dict[str, Axis]) -> dict[str, dict[str, Path]]:
    points = [(name, label, overrides) for name, axis in axes.items() for label, overrides in axis.points]
    progress = Progress(total_stages=MINIATURE_STAGES + 2 * len(points))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        mini = build_miniature(
            args.data, args.size, args.run_dir, args.results / ".cache", args.seed, pool, progress,
            args.tofu_dir, args.spans,
        )  # fmt: skip
        jobs = {
            (name, label): pool.submit(
                rendered_point if args.render else run_point, mini, name, label, overrides, args.lr
            )
            for name, label, overrides in points
        }
        results = {(name, label): job.result() for (name, label), job in jobs.items()}
        references = mini.references()
    notes = [
        *mini.notes(),
        f"Every point: PALU at lr {args.lr:g}, {mini.size.unlearn_epochs} epochs, the demo's PALU config "
        "plus the point's overrides (hyperparameters column).",
    ]
    paths, summary = {}, {"references": {n: vars(r) for n, r in references.items()}, "axes": {}}
    for name, axis in axes.items():
        axis_points = {label: results[name, label] for label, _ in axis.points}
        paths[name] = write_axis(args.run_dir, name, axis, axis_points, references, notes)
        summary["axes"][name] = {"title": axis.title, "default": axis.default, "points": {
            label: vars(run) for label, run in axis_points.items()}}  # fmt: skip
    summary["wall_time_s"] = round(time.monotonic() - progress.start, 1)
    summary["stage_times_s"] = progress.stage_times
    (args.run_dir / "ablation.json").write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    progress.say(f"done in {summary['wall_time_s']:.0f} s")
    for name, axis_paths in paths.items():
        for path in axis_paths.values():
            print(f"{name}: {path}")
    return paths


def parse_point(text: str) -> tuple[str, tuple[str, ...]]:
    label, separator, overrides = text.partition("=")
    if not separator or "=" not in overrides:
        raise argparse.ArgumentTypeError(f"--point {text!r}: expected LABEL=KEY=VALUE[,KEY=VALUE...]")
    return label, tuple(overrides.split(","))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m palu_trainer.experiments.ablation", description=__doc__.splitlines()[0]
    )
    add_miniature_arguments(parser, render=True)
    parser.add_argument("--axes", nargs="+", choices=list(AXES), default=list(AXES))
    parser.add_argument("--lr", type=float, default=1e-3, help="PALU's learning rate at every point")
    parser.add_argument(
        "--point",
        type=parse_point,
        action="append",
        help="replace the points of the one axis given with --axes: LABEL=KEY=VALUE[,KEY=VALUE...] "
        "(repeat; the first is drawn as the default)",
    )
    args = parse_miniature_arguments(parser, argv, "ablation")
    axes = {name: AXES[name] for name in args.axes}
    if args.point:
        if len(axes) != 1:
            parser.error("--point replaces the points of one axis: give exactly one with --axes")
        ((name, axis),) = axes.items()
        axes = {name: Axis(f"{axis.title.split(':')[0]}: custom points", tuple(args.point), args.point[0][0])}
    run(args, axes)


if __name__ == "__main__":
    main()
