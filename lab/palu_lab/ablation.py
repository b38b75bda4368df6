"""`make ablation`: the paper's PALU ablations (its Figure 4 and strategy tables) on the offline miniature.

One axis at a time, the others at PALU's defaults: every point unlearns the miniature's cached Original with
PALU plus the point's overrides, is evaluated with the stock TOFU evaluator (with the paper's extra
metrics), and lands in a bar chart (forget quality on a log left axis, retain utility on the right,
Original and Retain as lines) and a table per axis, in results/ablation/. Points with the same overrides
(every axis's default point, N=All and "all tokens") run once.
"""

import argparse
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from palu_lab.ablation_chart import plot_axis
from palu_lab.miniature import (
    TOFU_SIZES,
    add_arguments,
    parse_arguments,
    start_run,
    tofu_miniature,
)
from palu_lab.trainer_config import trainer_config
from palu_trainer.experiments import report
from palu_trainer.experiments.ablation_axes import ABLATED_METHOD, AXES, Axis
from palu_trainer.method.local_loss import resolve_top_k


def point_run_name(overrides: tuple[str, ...]) -> str:
    """A point's run folder, from its overrides: PALU_default, PALU_top_k-0.03125, ..."""
    if not overrides:
        return f"{ABLATED_METHOD}_default"
    values = "_".join(
        f"{key.rsplit('.', 1)[-1]}-{value}"
        for key, value in (override.split("=", 1) for override in overrides)
    )
    return f"{ABLATED_METHOD}_" + re.sub(r"[^A-Za-z0-9._]+", "-", values)


def run_point(mini, overrides: tuple[str, ...], learning_rate: float) -> report.EvaluatedModel:
    """Unlearn and evaluate one point; a failed run becomes a row that names its log instead of numbers."""
    name = point_run_name(overrides)
    params = {"lr": learning_rate, "overrides": " ".join(overrides) or "PALU defaults"}
    try:
        eval_json, seconds = mini.unlearn_and_evaluate(ABLATED_METHOD, learning_rate, overrides, name)
    except RuntimeError as error:
        mini.stages.progress.say(f"{name} failed: {str(error).splitlines()[0]}")
        return report.EvaluatedModel({}, None, {**params, "error": f"logs/unlearn_{name}.log"})
    return report.run_from_eval(eval_json, seconds, params)


def rendered_point(
    mini, overrides: tuple[str, ...], learning_rate: float, stage_times: dict
) -> report.EvaluatedModel:
    """`--render`: the point's evaluation from an earlier (maybe stopped) run, or a row saying it has none;
    `stage_times`: that run's, for the wall time."""
    name = point_run_name(overrides)
    params = {"lr": learning_rate, "overrides": " ".join(overrides) or "PALU defaults"}
    eval_json = mini.stages.run_dir / "evals" / name / mini.stages.facts.eval_file
    if not eval_json.is_file():
        return report.EvaluatedModel({}, None, {**params, "error": f"not evaluated: no {eval_json}"})
    return report.run_from_eval(eval_json, stage_times.get(f"unlearn {name}"), params)


def write_axis(out_dir: Path, name: str, axis: Axis, points, references, notes) -> dict[str, Path]:
    """`<name>.md` (the demo's columns and the paper's Tables 1 and 2) and `<name>.png`."""
    rows = {**references, **{f"{name}={label}": run for label, run in points.items()}}
    markdown = [
        f"# PALU ablation — {axis.title}",
        "",
        f"Default point: {axis.default}.",
        "",
        report.table(rows, first_header="point"),
        "",
        *report.TOFU.paper_sections(rows),
        *(
            f"- {label}: no result ({run.params['error']})"
            for label, run in points.items()
            if not run.metrics
        ),
        *notes,
        "",
        f"![{axis.title}]({name}.png)",
        "",
    ]
    paths = {"table": out_dir / f"{name}.md", "chart": out_dir / f"{name}.png"}
    paths["table"].write_text("\n".join(markdown), encoding="utf-8")
    plot_axis(paths["chart"], axis, points, references)
    return paths


def run_ablation(args, axes: dict[str, Axis]) -> dict[str, dict[str, Path]]:
    """Every point of `axes` on the miniature that `args` names; a table and chart per axis."""
    size = TOFU_SIZES[args.size]
    distinct = list(dict.fromkeys(overrides for axis in axes.values() for overrides in axis.points.values()))
    progress = start_run("tofu", args.data, args.size, args.run_dir, 2 * len(distinct))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        mini = tofu_miniature(args, progress, pool)
        if args.render:
            earlier = args.run_dir / "ablation.json"
            stage_times = json.loads(earlier.read_text())["stage_times_s"] if earlier.is_file() else {}
            point = partial(rendered_point, stage_times=stage_times)
        else:
            stage_times, point = {}, run_point
        jobs = {overrides: pool.submit(point, mini, overrides, args.lr) for overrides in distinct}
        results = {overrides: job.result() for overrides, job in jobs.items()}
        references = mini.references()
    stock_top_k = OmegaConf.select(trainer_config(ABLATED_METHOD), "method_args.top_k")
    # an override's value as Hydra reads it: "1" is the integer K=1, "0.03125" a share of |V|
    k_values = {
        label: yaml.safe_load(o[0].split("=")[1]) if o else stock_top_k
        for label, o in AXES["k"].points.items()
    }
    resolved = ", ".join(f"{label} -> K={resolve_top_k(v, mini.vocab_size)}" for label, v in k_values.items())
    notes = [
        *mini.notes,
        f"Every point: PALU at lr {args.lr:g}, {size.unlearn_epochs} epochs, stock PALU config plus the "
        "point's overrides (hyperparameters column).",
        f"K on this {mini.vocab_size}-token vocabulary: {resolved}.",
        f"Charts: forget quality (KS p-value against Retain) on a log axis, values below {report.FQ_FLOOR:g} "
        "drawn at it; dotted lines Original, dashed Retain."
        + (" Rendered from the evaluations on disk." if args.render else ""),
    ]
    paths, summary = {}, {"references": {n: vars(r) for n, r in references.items()}, "axes": {}}
    for name, axis in axes.items():
        points = {label: results[overrides] for label, overrides in axis.points.items()}
        paths[name] = write_axis(args.run_dir, name, axis, points, references, notes)
        summary["axes"][name] = {
            "title": axis.title,
            "default": axis.default,
            "points": {label: vars(run) for label, run in points.items()},
        }
    summary["vocab_size"] = mini.vocab_size
    summary["wall_time_s"] = round(time.monotonic() - progress.start, 1)
    summary["stage_times_s"] = {**stage_times, **progress.stage_times}
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
    parser = argparse.ArgumentParser(prog="python -m palu_lab.ablation", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--axes", nargs="+", choices=list(AXES), default=list(AXES))
    parser.add_argument("--lr", type=float, default=1e-3, help="PALU's learning rate at every point")
    parser.add_argument(
        "--render",
        action="store_true",
        help="no unlearning: charts and tables from the evaluations already in the run folder (a stopped "
        "sweep); points without one are marked",
    )
    parser.add_argument(
        "--point",
        type=parse_point,
        action="append",
        help="replace the points of the one axis given with --axes: LABEL=KEY=VALUE[,KEY=VALUE...] "
        "(repeat; the first is drawn as the default)",
    )
    args = parse_arguments(parser, argv, "ablation")
    axes = {name: AXES[name] for name in args.axes}
    if args.point:
        if len(axes) != 1:
            parser.error("--point replaces the points of one axis: give exactly one with --axes")
        ((name, axis),) = axes.items()
        axes = {name: Axis(f"{axis.title.split(':')[0]}: custom points", dict(args.point), args.point[0][0])}
    run_ablation(args, axes)


if __name__ == "__main__":
    main()
