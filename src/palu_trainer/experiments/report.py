"""Paper-style summary of TOFU evaluations: a Markdown table, a JSON file and a utility-vs-FQ scatter plot.

Input is independent of how the models were made: for every method, one or more runs, each an
open-unlearning `TOFU_EVAL.json` plus wall time and hyperparameters. References (Original, Retain) are
single runs. For a method with several runs (a learning-rate grid), one is selected by a stated rule.
"""

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scipy.stats import hmean

# Table columns: key, header, format. `retain_utility` ranks and selects, see SELECTION_RULE.
COLUMNS = (
    ("forget_quality", "FQ ↑", "{:.3g}"),
    ("retain_utility", "retain utility ↑", "{:.3f}"),
    ("model_utility", "stock MU", "{:.3f}"),
    ("forget_rouge", "forget ROUGE ↓", "{:.3f}"),
    ("extraction_strength", "ES ↓", "{:.3f}"),
    ("privleak", "privleak (→0)", "{:.1f}"),
    ("retain_rouge", "retain ROUGE", "{:.3f}"),
    ("retain_prob", "retain prob", "{:.3f}"),
    ("retain_truth_ratio", "retain TR", "{:.3f}"),
)
# The paper's Table 1 (utility and memorization) and Table 2 (MIA AUCs, forget vs holdout: 0.5 = cannot tell).
PAPER_TABLE_1 = (
    ("forget_quality", "FQ ↑", "{:.3g}"),
    ("model_utility", "MU ↑", "{:.3f}"),
    ("exact_memorization", "EM ↓", "{:.3f}"),
    ("forget_truth_ratio", "TR forget", "{:.3f}"),
    ("retain_truth_ratio", "TR retain", "{:.3f}"),
    ("ra_truth_ratio", "TR real authors", "{:.3f}"),
    ("wf_truth_ratio", "TR world facts", "{:.3f}"),
    ("fluency", "fluency ↑", "{:.3f}"),
)
PAPER_TABLE_2 = (
    ("mia_loss", "LOSS", "{:.3f}"),
    ("mia_zlib", "ZLib", "{:.3f}"),
    ("mia_min_k", "Min-K", "{:.3f}"),
    ("mia_min_k_plus_plus", "Min-K++", "{:.3f}"),
)
# TOFU_EVAL.json keys for each reported metric (all are `agg_value`s).
EVAL_KEYS = {
    "forget_quality": "forget_quality",
    "model_utility": "model_utility",
    "forget_rouge": "forget_Q_A_ROUGE",
    "extraction_strength": "extraction_strength",
    "privleak": "privleak",
    "retain_rouge": "retain_Q_A_ROUGE",
    "retain_prob": "retain_Q_A_Prob",
    "retain_truth_ratio": "retain_Truth_Ratio",
    "exact_memorization": "exact_memorization",
    "forget_truth_ratio": "forget_truth_ratio",
    "ra_truth_ratio": "ra_Truth_Ratio",
    "wf_truth_ratio": "wf_Truth_Ratio",
    "fluency": "forget_Q_A_gibberish",
    "mia_loss": "mia_loss",
    "mia_zlib": "mia_zlib",
    "mia_min_k": "mia_min_k",
    "mia_min_k_plus_plus": "mia_min_k_plus_plus",
}
# Shown instead of a dash where the evaluation has no fluency: its classifier comes from the hub.
FLUENCY_CLASSIFIER = "madhurjindal/autonlp-Gibberish-Detector-492513457"
NOT_OFFLINE = {"fluency": "needs hub"}
UTILITY_FLOOR = 0.8
FQ_FLOOR = 1e-30
SELECTION_RULE = (
    "per method, among its runs whose retain utility is at least "
    f"{UTILITY_FLOOR:.0%} of the Original's, the one with the highest forget quality; if none keeps "
    "that much utility, the run with the highest retain utility"
)
UTILITY_NOTE = (
    "retain utility = harmonic mean of retain ROUGE, retain probability and retain truth ratio (the "
    "retain half of the stock model utility). Stock MU is the harmonic mean of nine parts, six on "
    "real-author and world-fact questions that a model trained from scratch cannot answer: one part "
    "near 0 collapses it, so it is ≈ 0 (and noise) for these models; the table ranks and selects by "
    "retain utility."
)


@dataclass
class EvaluatedModel:
    """One evaluated model: its metrics, wall time of the step that produced it, its hyperparameters."""

    metrics: dict
    wall_time_s: float | None = None
    params: dict = field(default_factory=dict)
    eval_path: str | None = None


def metrics_from_eval(eval_json: str | Path) -> dict:
    """The reported metrics of one open-unlearning TOFU_EVAL.json (None where a metric is absent)."""
    logs = json.loads(Path(eval_json).read_text())
    metrics = {name: (logs.get(key) or {}).get("agg_value") for name, key in EVAL_KEYS.items()}
    metrics["retain_utility"] = retain_utility(metrics)
    return metrics


def retain_utility(metrics: Mapping) -> float | None:
    parts = [metrics[key] for key in ("retain_rouge", "retain_prob", "retain_truth_ratio")]
    if any(part is None for part in parts):
        return None
    return 0.0 if min(parts) <= 0 else float(hmean(parts))


def run_from_eval(eval_json: str | Path, wall_time_s=None, params=None) -> EvaluatedModel:
    return EvaluatedModel(metrics_from_eval(eval_json), wall_time_s, dict(params or {}), str(eval_json))


def select_run(runs: Sequence[EvaluatedModel], original_utility: float) -> EvaluatedModel:
    """Apply SELECTION_RULE to one method's runs."""
    floor = UTILITY_FLOOR * original_utility
    kept = [run for run in runs if (run.metrics["retain_utility"] or 0.0) >= floor]
    if kept:
        return max(kept, key=lambda run: run.metrics["forget_quality"] or 0.0)
    return max(runs, key=lambda run: run.metrics["retain_utility"] or 0.0)


def format_value(value, pattern: str, missing: str = "—") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return pattern.format(value)


def format_params(params: Mapping) -> str:
    return ", ".join(f"{key}={value}" for key, value in params.items())


def table(rows: Mapping[str, EvaluatedModel], columns=COLUMNS, first_header: str = "model") -> str:
    """A Markdown table of `rows` (label -> run); COLUMNS add wall time and hyperparameters."""
    headers = [first_header, *(header for _, header, _ in columns)]
    details = columns is COLUMNS
    if details:
        headers += ["wall time", "hyperparameters"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for name, run in rows.items():
        cells = [
            format_value(run.metrics.get(key), pattern, NOT_OFFLINE.get(key, "—"))
            for key, _, pattern in columns
        ]
        if details:
            cells += [
                "—" if run.wall_time_s is None else f"{run.wall_time_s:.0f} s",
                format_params(run.params),
            ]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines)


def plot(
    path: Path,
    references: Mapping[str, EvaluatedModel],
    grids: Mapping[str, Sequence[EvaluatedModel]],
    selected,
) -> None:
    """Retain utility (x) vs forget quality (y, log scale); every grid run faint, the selected one bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def point(run: EvaluatedModel) -> tuple[float, float]:
        # KS p-values of a collapsed model reach 1e-100 and below: draw them on a floor of the log axis.
        return run.metrics["retain_utility"] or 0.0, max(run.metrics["forget_quality"] or 0.0, FQ_FLOOR)

    figure, axes = plt.subplots(figsize=(7, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for colour, (method, runs) in zip(colours, grids.items(), strict=False):
        xs, ys = zip(*(point(run) for run in runs), strict=True)
        axes.scatter(xs, ys, color=colour, alpha=0.3, s=30)
        x, y = point(selected[method])
        axes.scatter([x], [y], color=colour, s=110, edgecolor="black", label=method, zorder=3)
    for marker, (name, run) in zip(("*", "P"), references.items(), strict=False):
        x, y = point(run)
        axes.scatter([x], [y], marker=marker, color="black", s=160, label=name, zorder=4)
    axes.set_yscale("log")
    axes.set_xlabel("retain utility (hmean of retain ROUGE, prob, truth ratio)")
    axes.set_ylabel(f"forget quality (KS p-value vs Retain, log; < {FQ_FLOOR:g} drawn at it)")
    axes.set_title("Retain utility vs forget quality (faint: other learning rates)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="best", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(
    out_dir: str | Path,
    references: Mapping[str, EvaluatedModel],
    grids: Mapping[str, Sequence[EvaluatedModel]],
    title: str,
    notes: Sequence[str] = (),
    extra: Mapping | None = None,
) -> dict[str, Path]:
    """Write summary.md, summary.json and mu_vs_fq.png to `out_dir`; return their paths.

    `references` must include "Original" (its retain utility anchors the selection rule);
    `grids` maps each method to its runs; `extra` is stored as-is in the JSON (e.g. stage timings).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    original_utility = references["Original"].metrics["retain_utility"] or 0.0
    selected = {method: select_run(runs, original_utility) for method, runs in grids.items()}
    ranked = dict(
        sorted(selected.items(), key=lambda item: item[1].metrics["forget_quality"] or 0.0, reverse=True)
    )
    all_runs = {
        f"{method} ({format_params(run.params)})": run for method, runs in grids.items() for run in runs
    }
    markdown = [
        f"# {title}",
        "",
        table({**references, **ranked}),
        "",
        f"Methods are sorted by forget quality (FQ). Selection: {SELECTION_RULE}.",
        "",
        UTILITY_NOTE,
        "",
        "Wall time: the run that made the model (finetuning or unlearning), without its evaluation.",
        *[f"\n{note}" for note in notes],
        "",
        "## The paper's Table 1: utility, memorization, truth ratios",
        "",
        table({**references, **ranked}, PAPER_TABLE_1),
        "",
        "MU: the stock model utility (see above). EM: exact memorization of the forget answers. TR: the "
        "stock truth ratio (TOFU's aggregation: forget closer to 1 is better, the others higher is better). "
        f"Fluency: the stock `forget_Q_A_gibberish` metric; its classifier ({FLUENCY_CLASSIFIER}) comes "
        "from the hub, so offline it reads 'needs hub'; add the metric to the evaluation where the model "
        "is available and the column fills in.",
        "",
        "## The paper's Table 2: membership inference AUCs, forget vs holdout",
        "",
        table({**references, **ranked}, PAPER_TABLE_2),
        "",
        "Each attack scores the forget and holdout rows; the AUC of telling them apart. 0.5: the model "
        "treats forgotten rows as never seen (Retain's level); near 1 (or 0): it still remembers them.",
        "",
        "## Every run",
        "",
        table(all_runs),
        "",
        "![retain utility vs forget quality](mu_vs_fq.png)",
        "",
    ]
    paths = {
        "summary.md": out_dir / "summary.md",
        "summary.json": out_dir / "summary.json",
        "plot": out_dir / "mu_vs_fq.png",
    }
    paths["summary.md"].write_text("\n".join(markdown), encoding="utf-8")
    summary = {
        "title": title,
        "selection_rule": SELECTION_RULE,
        "utility_note": UTILITY_NOTE,
        "references": {name: vars(run) for name, run in references.items()},
        "selected": {method: vars(run) for method, run in ranked.items()},
        "runs": {method: [vars(run) for run in runs] for method, runs in grids.items()},
        **dict(extra or {}),
    }
    paths["summary.json"].write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    plot(paths["plot"], references, grids, selected)
    return paths
