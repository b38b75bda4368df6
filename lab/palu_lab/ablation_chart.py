"""The paper's Figure 4 as a chart, shared by the miniature's ablation (`ablation.py`) and the converged
experiment's target ablation (`converged.py`)."""

from pathlib import Path

from palu_trainer.experiments import report
from palu_trainer.experiments.ablation_axes import Axis


def plot_axis(
    path: Path,
    axis: Axis,
    points: dict[str, report.EvaluatedModel],
    references,
    utility: str = "retain_utility",
    title: str = "PALU ablation",
) -> None:
    """The paper's Figure 4: FQ bars on a log left axis, bars of the metric `utility` on the right axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(points)
    ran = {x: run for x, run in enumerate(points.values()) if run.metrics}
    quality = [max(run.metrics["forget_quality"] or 0.0, report.FQ_FLOOR) for run in ran.values()]
    utilities = [run.metrics[utility] or 0.0 for run in ran.values()]
    figure, fq_axes = plt.subplots(figsize=(max(6.5, 1.3 * len(labels) + 2), 5))
    utility_axes = fq_axes.twinx()
    width = 0.38
    fq_axes.bar([x - width / 2 for x in ran], quality, width, color="tab:blue", label="forget quality (left)")
    utility_name = utility.replace("_", " ")
    utility_axes.bar(
        [x + width / 2 for x in ran], utilities, width, color="tab:orange", label=f"{utility_name} (right)"
    )
    for name, style in (("Original", ":"), ("Retain", "--")):
        metrics = references[name].metrics
        fq_axes.axhline(max(metrics["forget_quality"], report.FQ_FLOOR), color="tab:blue", ls=style, lw=1.2)
        utility_axes.axhline(metrics[utility], color="tab:orange", ls=style, lw=1.2)
        fq_axes.plot([], [], color="gray", ls=style, label=f"{name} (blue: FQ, orange: utility)")
    original_quality = max(references["Original"].metrics["forget_quality"], report.FQ_FLOOR)
    bottom = min([*quality, original_quality]) / 10
    fq_axes.set_yscale("log")
    fq_axes.set_ylim(bottom=bottom, top=3)
    for x, run in enumerate(points.values()):
        if not run.metrics:
            fq_axes.text(x, bottom * 3, "no result:\nsee table", ha="center", fontsize=8, color="red")
    utility_axes.set_ylim(0, 1.05)
    ticks = [f"{label}\n(default)" if label == axis.default else label for label in labels]
    fq_axes.set_xticks(range(len(labels)), ticks)
    fq_axes.set_ylabel("forget quality (log)")
    utility_axes.set_ylabel(utility_name)
    fq_axes.set_title(f"{title} — {axis.title}", fontsize=10)
    handles = [*fq_axes.get_legend_handles_labels()[0], *utility_axes.get_legend_handles_labels()[0]]
    figure.legend(handles=handles, fontsize=8, loc="lower center", ncol=2)
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
