"""Paper-style summary of TOFU or MUSE evaluations, however the models were made: a Markdown table, a JSON
file and a plot of utility (x) against forgetting (y), from open-unlearning's `TOFU_EVAL.json` (or
`MUSE_EVAL.json`) files, wall times and hyperparameters. A `Scorecard` (TOFU, the default, or MUSE) names
those metrics and picks one of a method's several runs (a learning-rate grid)."""

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scipy.stats import hmean

# Table columns: key, header, format. `retain_utility` ranks and selects (TOFU's selection_rule).
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
# The stock TOFU metrics that the paper's tables add to the framework's default evaluation (which leaves them
# commented out in configs/eval/tofu.yaml); fluency's classifier comes from the hub.
PAPER_METRICS = ("exact_memorization", "mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus")
FLUENCY_METRIC = "forget_Q_A_gibberish"
FLUENCY_CLASSIFIER = "madhurjindal/autonlp-Gibberish-Detector-492513457"
# TOFU_EVAL.json keys for each reported metric (all are `agg_value`s): the metric's own name unless renamed.
EVAL_KEYS = {
    **{name: name for name in ("forget_quality", "model_utility", "extraction_strength", "privleak")},
    **{name: name for name in ("forget_truth_ratio", *PAPER_METRICS)},
    "forget_rouge": "forget_Q_A_ROUGE",
    "retain_rouge": "retain_Q_A_ROUGE",
    "retain_prob": "retain_Q_A_Prob",
    "retain_truth_ratio": "retain_Truth_Ratio",
    "ra_truth_ratio": "ra_Truth_Ratio",
    "wf_truth_ratio": "wf_Truth_Ratio",
    "fluency": FLUENCY_METRIC,
}
# The paper's Table 1 (utility, memorization, truth ratios) and Table 2 (MIA AUCs, forget vs holdout).
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
UTILITY_FLOOR = 0.8
FQ_FLOOR = 1e-30


@dataclass
class EvaluatedModel:
    """One evaluated model: its metrics, wall time of the step that produced it, its hyperparameters."""

    metrics: dict
    wall_time_s: float | None = None
    params: dict = field(default_factory=dict)
    eval_path: str | None = None


def retain_utility(metrics: Mapping) -> float | None:
    parts = [metrics[key] for key in ("retain_rouge", "retain_prob", "retain_truth_ratio")]
    if any(part is None for part in parts):
        return None
    return 0.0 if min(parts) <= 0 else float(hmean(parts))


@dataclass(frozen=True)
class Scorecard:
    """What a benchmark's report reads, selects by and plots.

    utility (x axis) must keep UTILITY_FLOOR of the Original's; forgetting (y axis) ranks and selects,
    higher better when `forgetting_ascends` (TOFU's FQ), lower otherwise (MUSE's VerbMem).
    """

    columns: tuple
    eval_keys: dict[str, str]
    derived: dict[str, Callable[[dict], float | None]]
    utility: str
    forgetting: str
    forgetting_ascends: bool
    ranked_by: str
    selection_rule: str
    utility_note: str
    x_label: str
    y_label: str
    title: str
    plot_file: str
    log_y: bool
    paper_tables: tuple = ()  # (heading, columns, note) of the paper's further tables
    adds_paper_metrics: bool = False  # the evaluation adds PAPER_METRICS (and fluency) to the stock metrics
    # What Retain scores by definition rather than as evaluated (TOFU's FQ: a KS test against itself)
    retain_by_definition: dict = field(default_factory=dict)

    def metric_overrides(self, cuda: bool) -> list[str]:
        """Hydra overrides adding the paper's metrics to the stock evaluation; fluency only where its
        classifier is cached (it runs on CUDA unless `cuda` is false)."""
        if not self.adds_paper_metrics:
            return []
        overrides = [f"+eval/tofu_metrics@eval.tofu.metrics.{name}={name}" for name in PAPER_METRICS]
        if fluency_classifier_available():
            overrides.append(f"+eval/tofu_metrics@eval.tofu.metrics.{FLUENCY_METRIC}={FLUENCY_METRIC}")
            if not cuda:
                overrides.append(f"eval.tofu.metrics.{FLUENCY_METRIC}.device=cpu")
        return overrides

    def paper_sections(self, rows: Mapping[str, EvaluatedModel]) -> list[str]:
        """The report's Markdown sections with the paper's further tables of `rows`."""
        lines = []
        for heading, columns, note in self.paper_tables:
            lines += [f"## {heading}", "", table(rows, columns, details=False), "", note, ""]
        return lines

    def forgetting_score(self, run: EvaluatedModel) -> float:
        value = run.metrics[self.forgetting]
        if value is None:
            return -math.inf
        return value if self.forgetting_ascends else -value


TOFU = Scorecard(
    columns=COLUMNS,
    eval_keys=EVAL_KEYS,
    derived={"retain_utility": retain_utility},
    utility="retain_utility",
    forgetting="forget_quality",
    forgetting_ascends=True,
    ranked_by="forget quality (FQ)",
    selection_rule=(
        f"per method, among its runs whose retain utility is at least {UTILITY_FLOOR:.0%} of the Original's, "
        "the one with the highest forget quality; if none keeps that much utility, the run with the highest "
        "retain utility"
    ),
    utility_note=(
        "retain utility = harmonic mean of retain ROUGE, retain probability and retain truth ratio (the "
        "retain half of the stock model utility); the table ranks and selects by retain utility."
    ),
    x_label="retain utility (hmean of retain ROUGE, prob, truth ratio)",
    y_label=f"forget quality (KS p-value vs Retain, log; < {FQ_FLOOR:g} drawn at it)",
    title="Retain utility vs forget quality (faint: other learning rates)",
    plot_file="mu_vs_fq.png",
    log_y=True,
    adds_paper_metrics=True,
    retain_by_definition={"forget_quality": 1.0},
    paper_tables=(
        (
            "The paper's Table 1: utility, memorization, truth ratios",
            PAPER_TABLE_1,
            "MU: the stock model utility (see above). EM: exact memorization of the forget answers. TR: the "
            "stock truth ratio (forget: closer to 1 is better; the others: higher is better). Fluency: the "
            f"stock `{FLUENCY_METRIC}` metric, whose classifier ({FLUENCY_CLASSIFIER}) comes from the hub: "
            "'needs hub' offline; where it is in the Hugging Face cache the evaluation adds the metric and "
            "the column fills in.",
        ),
        (
            "The paper's Table 2: membership inference AUCs, forget vs holdout",
            PAPER_TABLE_2,
            "Each attack scores the forget and holdout rows; the AUC of telling them apart. 0.5: the model "
            "treats the forgotten rows as never seen, like Retain; near 1: it still remembers them.",
        ),
    ),
)
MUSE = Scorecard(
    columns=(
        ("forget_verbmem", "VerbMem forget ↓", "{:.3f}"),
        ("forget_knowmem", "KnowMem forget ↓", "{:.3f}"),
        ("retain_knowmem", "KnowMem retain ↑", "{:.3f}"),
        ("privleak", "PrivLeak (→0)", "{:.1f}"),
        ("extraction_strength", "ES ↓", "{:.3f}"),
    ),
    eval_keys={
        **{name: f"{name}_ROUGE" for name in ("forget_verbmem", "forget_knowmem", "retain_knowmem")},
        **{name: name for name in ("privleak", "extraction_strength")},
    },
    derived={},
    utility="retain_knowmem",
    forgetting="forget_verbmem",
    forgetting_ascends=False,
    ranked_by="VerbMem on forget, lowest first",
    selection_rule=(
        f"per method, among its runs whose KnowMem on retain is at least {UTILITY_FLOOR:.0%} of the "
        "Original's, the one with the lowest VerbMem on forget; if none keeps that much, the run with the "
        "highest KnowMem on retain"
    ),
    utility_note=(
        "VerbMem: ROUGE-L F1 of the continuation generated from a forget excerpt; KnowMem: ROUGE-L F1 of "
        "answers to questions on forget / retain articles (few-shot); PrivLeak: min-k% MIA AUC on "
        "forget vs holdout excerpts relative to Retain's, in % (0 = like Retain, -100 = fully exposed)."
    ),
    x_label="KnowMem on retain (ROUGE-L F1) ↑",
    y_label="VerbMem on forget (ROUGE-L F1) ↓",
    title="KnowMem-retain vs VerbMem-forget (faint: other learning rates)",
    plot_file="knowmem_vs_verbmem.png",
    log_y=False,
)


def metrics_from_eval(eval_json: str | Path, scorecard: Scorecard = TOFU) -> dict:
    """The reported metrics of one open-unlearning eval file (None where a metric is absent)."""
    logs = json.loads(Path(eval_json).read_text())
    metrics = {name: (logs.get(key) or {}).get("agg_value") for name, key in scorecard.eval_keys.items()}
    for name, derive in scorecard.derived.items():
        metrics[name] = derive(metrics)
    return metrics


def run_from_eval(
    eval_json: str | Path, wall_time_s=None, params=None, scorecard: Scorecard = TOFU
) -> EvaluatedModel:
    metrics = metrics_from_eval(eval_json, scorecard)
    return EvaluatedModel(metrics, wall_time_s, dict(params or {}), str(eval_json))


def references(
    original: EvaluatedModel, retain: EvaluatedModel, scorecard: Scorecard
) -> dict[str, EvaluatedModel]:
    """The report's reference rows, Retain with what it scores by definition."""
    retain.metrics.update(scorecard.retain_by_definition)
    return {"Original": original, "Retain": retain}


def select_run(
    runs: Sequence[EvaluatedModel], original_utility: float, scorecard: Scorecard = TOFU
) -> EvaluatedModel:
    """Apply the scorecard's selection rule to one method's runs."""
    floor = UTILITY_FLOOR * original_utility
    kept = [run for run in runs if (run.metrics[scorecard.utility] or 0.0) >= floor]
    if kept:
        return max(kept, key=scorecard.forgetting_score)
    return max(runs, key=lambda run: run.metrics[scorecard.utility] or 0.0)


def fluency_classifier_available() -> bool:
    """Whether the fluency classifier is in the Hugging Face cache (nothing is downloaded to find out)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(FLUENCY_CLASSIFIER, "config.json"), str)


def format_value(value, pattern: str, missing: str = "—") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return pattern.format(value)


def format_params(params: Mapping) -> str:
    return ", ".join(f"{key}={value}" for key, value in params.items())


def table(
    rows: Mapping[str, EvaluatedModel],
    columns: Sequence = COLUMNS,
    first_header: str = "model",
    details: bool = True,
) -> str:
    """A Markdown table of `rows` (label -> run); `details`: wall time and hyperparameters columns too."""
    headers = [first_header, *(header for _, header, _ in columns)]
    headers += ["wall time", "hyperparameters"] if details else []
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for name, run in rows.items():
        cells = [  # fluency is absent offline, and says why instead of a bare dash
            format_value(run.metrics.get(key), pattern, "needs hub" if key == "fluency" else "—")
            for key, _, pattern in columns
        ]
        if details:
            wall = "—" if run.wall_time_s is None else f"{run.wall_time_s:.0f} s"
            cells += [wall, format_params(run.params)]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines)


def plot(
    path: Path,
    references: Mapping[str, EvaluatedModel],
    grids: Mapping[str, Sequence[EvaluatedModel]],
    selected,
    scorecard: Scorecard = TOFU,
) -> None:
    """Utility (x) vs forgetting (y; TOFU: retain utility vs FQ, log scale); every grid run faint, the
    selected one bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def point(run: EvaluatedModel) -> tuple[float, float]:
        # KS p-values of a collapsed model reach 1e-100 and below: draw them on a floor of the log axis.
        y = run.metrics[scorecard.forgetting] or 0.0
        return run.metrics[scorecard.utility] or 0.0, max(y, FQ_FLOOR) if scorecard.log_y else y

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
    save_plot(figure, axes, path, scorecard)


def save_plot(figure, axes, path: Path, scorecard: Scorecard, legend_size: int = 9) -> None:
    """Label `axes` as the scorecard says (log y for TOFU's FQ), save `figure` to `path` and close it."""
    import matplotlib.pyplot as plt

    if scorecard.log_y:
        axes.set_yscale("log")
    axes.set_xlabel(scorecard.x_label)
    axes.set_ylabel(scorecard.y_label)
    axes.set_title(scorecard.title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="best", fontsize=legend_size)
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
    scorecard: Scorecard = TOFU,
) -> dict[str, Path]:
    """Write summary.md, summary.json and the plot (TOFU: mu_vs_fq.png) to `out_dir`; return their paths.
    `references` must include "Original" (its utility anchors the selection rule); `grids`: method -> runs;
    `extra` is stored as-is in the JSON (e.g. stage timings)."""
    original_utility = references["Original"].metrics[scorecard.utility] or 0.0
    selected = {method: select_run(runs, original_utility, scorecard) for method, runs in grids.items()}
    ranked = dict(
        sorted(selected.items(), key=lambda item: scorecard.forgetting_score(item[1]), reverse=True)
    )
    all_runs = {
        f"{method} ({format_params(run.params)})": run for method, runs in grids.items() for run in runs
    }
    markdown = [
        f"# {title}",
        "",
        table({**references, **ranked}, scorecard.columns),
        "",
        f"Methods are sorted by {scorecard.ranked_by}. Selection: {scorecard.selection_rule}.",
        "",
        scorecard.utility_note,
        "",
        "Wall time: the run that made the model (finetuning or unlearning), without its evaluation.",
        *[f"\n{note}" for note in notes],
        "",
        *scorecard.paper_sections({**references, **ranked}),
        "## Every run",
        "",
        table(all_runs, scorecard.columns),
        "",
        f"![{scorecard.title}]({scorecard.plot_file})",
        "",
    ]
    summary = {
        "title": title,
        "selection_rule": scorecard.selection_rule,
        "utility_note": scorecard.utility_note,
        "references": {name: vars(run) for name, run in references.items()},
        "selected": {method: vars(run) for method, run in ranked.items()},
        "runs": {method: [vars(run) for run in runs] for method, runs in grids.items()},
        **dict(extra or {}),
    }
    paths = save_summary(Path(out_dir), markdown, summary, scorecard)
    plot(paths["plot"], references, grids, selected, scorecard)
    return paths


def save_summary(out_dir: Path, markdown: Sequence[str], summary: Mapping, scorecard: Scorecard) -> dict:
    """Write summary.md (`markdown` lines) and summary.json to `out_dir`; their paths and the plot's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in ("summary.md", "summary.json")}
    paths["plot"] = out_dir / scorecard.plot_file
    paths["summary.md"].write_text("\n".join(markdown), encoding="utf-8")
    paths["summary.json"].write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    return paths
