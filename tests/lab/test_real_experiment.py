"""The real-model experiment's plan, budget, data subset, seed aggregation and reading (issue 21), without
training: `demo --model smollm2 --plan`, and the report's functions on fake evaluated runs."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from palu_lab import demo, miniature, real_model
from palu_lab.benchmarks.dataset_folders import TofuBenchmark, read_jsonl
from palu_lab.benchmarks.tofu_subset import make_tofu_subset
from palu_lab.method_lists import REAL_MODEL_METHODS
from palu_lab.miniature import TOFU_SIZES
from palu_lab.real_model import (
    PALU_GPT4O,
    PALU_REFERENCE_MODEL,
    REFERENCE_MODEL,
    Run,
    Spread,
    aggregate,
    budget,
    compare,
    fq_ladder,
    reading,
    seed_runs,
    tuning_runs,
)
from palu_trainer.experiments.report import EvaluatedModel
from palu_trainer.framework.checkout import PROJECT_ROOT
from palu_trainer.spans.format import read_annotations, validate_annotations

SIZE = TOFU_SIZES["smollm2"]
METHODS = REAL_MODEL_METHODS


def test_the_plan_prints_every_run_and_fits_the_budget(capsys, tmp_path):
    demo.main(["--model", "smollm2", "--data", "tofu", "--tofu-dir", str(tmp_path), "--jobs", "2", "--plan"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "SmolLM2-135M-Instruct, bf16" in lines[0]
    assert "(40 forget rows)" in out and "FQ takes only 41 values" in out
    tuning = [line.strip() for line in lines if line.strip().endswith("_seed0") and "<setting>" not in line]
    assert tuning == [f"{m}_lr{rate:g}_seed0" for m in METHODS for rate in SIZE.unlearn_learning_rates]
    for method in METHODS:
        assert f"  {method}_<setting>_seed1" in lines and f"  {method}_<setting>_seed2" in lines
    for seed in (0, 1, 2):
        assert f"  {PALU_GPT4O}: PALU-gpt4o-spans_<setting>_seed{seed}" in lines
        assert (
            f"  {PALU_REFERENCE_MODEL}: PALU-reference-model_<setting>_seed{seed} ({REFERENCE_MODEL})"
            in lines
        )
    total = next(line for line in lines if line.strip().startswith("total:"))
    assert int(total.split()[1]) <= 150
    assert not (tmp_path / "results").exists()  # the plan runs nothing


def test_the_budget_arithmetic():
    minutes = budget(METHODS, SIZE, jobs=2)
    # Original: 80 rows / batch 8 x 10 epochs = 100 steps, beside Retain's 50
    assert minutes["finetune Original and Retain"] == pytest.approx((100 * 8.0 + 45) / 60)
    per_run = 2.5 * 10 * 8.0 + 45 + SIZE.eval_seconds  # 10 steps: forget + retain batch, reference forward
    assert minutes["tuning on seed 0"] == pytest.approx(10 * per_run / 2 / 60)
    assert minutes["selected settings on the other seeds, extra PALU rows"] == pytest.approx(
        16 * per_run / 2 / 60
    )
    assert sum(minutes.values()) == pytest.approx(137, abs=1)  # the size comment's plan


def test_runs_and_seeds():
    tuning = tuning_runs(METHODS, SIZE)
    assert len(tuning) == len(METHODS) * len(SIZE.unlearn_learning_rates)
    assert {run.seed for run in tuning} == {0}
    selected = {method: next(run for run in tuning if run.method == method) for method in METHODS}
    more = seed_runs(selected, SIZE.seeds)
    assert len(more) == len(METHODS) * 2 + 6
    palu = selected["PALU"]
    assert [run.seed for run in more if run.row == PALU_GPT4O] == [0, 1, 2]
    assert all(run.spans == "gpt4o" and run.params == palu.params for run in more if run.row == PALU_GPT4O)
    reference = [run for run in more if run.row == PALU_REFERENCE_MODEL]
    assert [run.seed for run in reference] == [0, 1, 2]
    assert reference[1].overrides() == (REFERENCE_MODEL, "trainer.args.seed=1")
    assert reference[1].name == "PALU-reference-model_lr3e-05_seed1"
    assert len({run.name for run in [*tuning, *more]}) == len(tuning) + len(more)  # one folder each


def test_aggregate_gives_mean_and_min_max_over_seeds():
    runs = [
        EvaluatedModel({"forget_quality": 0.1, "model_utility": 0.40, "fluency": None}),
        EvaluatedModel({"forget_quality": 0.4, "model_utility": 0.44, "fluency": None}),
        EvaluatedModel({"forget_quality": 0.7, "model_utility": 0.36, "fluency": None}),
    ]
    spreads = aggregate(runs)
    assert spreads["forget_quality"] == Spread(pytest.approx(0.4), 0.1, 0.7, 3)
    assert spreads["model_utility"].mean == pytest.approx(0.4)
    assert (spreads["model_utility"].low, spreads["model_utility"].high) == (0.36, 0.44)
    assert spreads["fluency"] is None
    assert spreads["forget_quality"].format() == "0.4 [0.1–0.7]"
    assert aggregate(runs[:1])["forget_quality"].format() == "0.1"


def spreads(fq, mu):
    return {"forget_quality": Spread(*fq, 3), "model_utility": Spread(*mu, 3)}


def test_the_reading_is_computed_from_the_spreads():
    rows = {
        "PALU": spreads((0.5, 0.4, 0.6), (0.40, 0.38, 0.42)),
        "NPO": spreads((0.06, 0.01, 0.1), (0.41, 0.39, 0.43)),  # apart on FQ, same utility
        "SimNPO": spreads((0.45, 0.3, 0.55), (0.40, 0.37, 0.41)),  # overlapping FQ
        "TPO": spreads((0.1, 0.05, 0.2), (0.50, 0.48, 0.52)),  # PALU's utility lower
        PALU_GPT4O: spreads((0.3, 0.2, 0.35), (0.40, 0.39, 0.41)),
    }
    lines = reading(rows)
    assert lines[0].startswith(
        "PALU beats NPO on FQ at equal or higher utility on every seed; not SimNPO, TPO"
    )
    assert compare("PALU", "NPO", rows)[0] == "beats"
    assert compare("PALU", "SimNPO", rows)[0] == "ahead within the spread"
    assert compare("PALU", "TPO", rows)[0] == "beats at lower utility"
    assert compare("NPO", "PALU", rows)[0] == "behind"
    npo = lines[1]
    # mean difference 0.44 against the larger seed range, 0.2 (PALU's 0.4-0.6)
    assert "mean difference +0.44 = 2.2x the larger seed range (0.2)" in npo
    assert "equal within the seed ranges" in npo and npo.endswith("Reading: PALU beats NPO on every seed.")
    assert "lower by 0.100" in lines[3]
    assert lines[4].startswith(
        "Span quality: PALU (GPT-4o spans) vs PALU: FQ 0.3 [0.2–0.35] vs 0.5 [0.4–0.6]"
    )
    assert lines[4].endswith("Reading: PALU (GPT-4o spans) is behind PALU on every seed.")
    assert len(lines) == 5  # no reference-model row: no line on it


def test_the_report_writes_tables_and_the_plot_with_ranges(tmp_path):
    def run(fq, mu, seed):
        metrics = {"forget_quality": fq, "model_utility": mu, "exact_memorization": 0.5, "mia_loss": 0.6}
        return EvaluatedModel(metrics, 10.0, {"lr": 1e-4, "seed": seed})

    references = {"Original": run(1e-6, 0.45, 0), "Retain": run(1.0, 0.44, 0)}
    rows = {
        "PALU": [run(0.5, 0.40, 0), run(0.4, 0.41, 1), run(0.6, 0.39, 2)],
        "NPO": [run(0.05, 0.40, 0), run(0.01, 0.42, 1), run(0.1, 0.41, 2)],
    }
    paths = real_model.write_report(tmp_path, references, rows, {"PALU": rows["PALU"][:1]}, ["a note"], {})
    table = paths["summary.md"].read_text()
    assert "| PALU | 0.5 [0.4–0.6] | 0.400 [0.390–0.410] | 0.500 [0.500–0.500] |" in table
    assert "| Original | 1e-06 | 0.450 |" in table
    assert "- PALU beats NPO on FQ" in table and "a note" in table
    summary = json.loads(paths["summary.json"].read_text())
    assert summary["rows"]["NPO"]["forget_quality"]["low"] == 0.01
    assert paths["plot"].read_bytes().startswith(b"\x89PNG")


def test_fq_ladder():
    ladder = fq_ladder(40)
    assert len(ladder) == 41 and ladder[0] == 1.0
    assert all(high >= low for high, low in zip(ladder, ladder[1:], strict=False))
    assert ladder[4] == pytest.approx(0.99, abs=0.005) and ladder[8] == pytest.approx(0.405, abs=0.005)


def test_the_subset_has_the_layouts_rows_and_both_span_sets(tofu_dir, shared_dir, tmp_path):
    gpt4o = shared_dir / "data" / "tofu_spans_gpt4o" / "forget05.jsonl"
    project = PROJECT_ROOT / "span_annotations" / "tofu_forget05.jsonl"
    layout = SIZE.layout
    benchmark = make_tofu_subset(tofu_dir, project, tmp_path, layout, {"gpt4o": gpt4o})
    rows = {name: read_jsonl(tmp_path / f"{name}.json") for name in ("full", "forget05", "holdout05")}
    forget05 = read_jsonl(tofu_dir / "forget05.json")
    assert rows["forget05"] == forget05[:40]  # authors 190 and 191
    assert len(rows["full"]) == 80 and rows["full"][40:] == rows["forget05"]
    assert len(rows["holdout05"]) == 20
    for name in ("retain_perturbed", "real_authors_perturbed", "world_facts_perturbed"):
        assert len(read_jsonl(tmp_path / f"{name}.json")) == layout.eval_rows
    answers = [row["answer"] for row in rows["forget05"]]
    for path in (benchmark.span_annotations, tmp_path / "span_annotations" / "gpt4o.jsonl"):
        validate_annotations(read_annotations(path), answers, str(path))
    ours = read_annotations(benchmark.span_annotations)
    assert ours == read_annotations(project)[:40]  # the first 40 rows of the project's file, as they are
    smoke = TOFU_SIZES["smollm2-fast"].layout
    make_tofu_subset(tofu_dir, gpt4o, tmp_path / "smoke", smoke)
    assert read_jsonl(tmp_path / "smoke" / "forget05.json") == forget05[:2]


@pytest.mark.parametrize("run", [Run("PALU", "PALU", 2, 1e-4, {"lr": 1e-4})])
def test_run_names(run):
    assert run.name == "PALU_lr0.0001_seed2"


class FakeMiniature:
    """Original and Retain without finetuning: what `real_model.run` reads of a miniature."""

    notes = ["Data: fake."]

    def references(self):
        return {
            "Original": EvaluatedModel({"forget_quality": 1e-5, "model_utility": 0.45}),
            "Retain": EvaluatedModel({"forget_quality": 1.0, "model_utility": 0.44}),
        }


def test_run_selects_on_seed_0_then_runs_the_other_seeds_and_the_extra_rows(monkeypatch, tmp_path):
    """`real_model.run` on fake evaluations: a higher learning rate forgets more and loses too much MU."""
    quality = {"GradDiff": 0.01, "NPO": 0.05, "SimNPO": 0.1, "TPO": 0.2, "PALU": 0.5}
    made = []

    def fake_unlearn(mini, run):
        made.append(run)
        fq = quality[run.method] * (1.5 if run.learning_rate > 5e-5 else 1.0) + 0.01 * run.seed
        fq -= 0.3 if run.row == PALU_GPT4O else 0.0
        mu = 0.2 if run.learning_rate > 5e-5 else 0.40 + 0.01 * run.seed
        return EvaluatedModel(
            {"forget_quality": fq, "model_utility": mu}, 1.0, {**run.params, "seed": run.seed}
        )

    monkeypatch.setattr(real_model, "tofu_miniature", lambda args, progress, pool: FakeMiniature())
    monkeypatch.setattr(real_model, "unlearn_and_evaluate", fake_unlearn)
    arguments = [
        "--model",
        "smollm2",
        "--data",
        "tofu",
        "--tofu-dir",
        str(tmp_path),
        "--results",
        str(tmp_path),
    ]
    demo.main(arguments)
    summary = json.loads((tmp_path / "smollm2-tofu" / "summary.json").read_text())
    assert summary["selected"] == {method: f"{method}_lr3e-05_seed0" for method in METHODS}
    assert len(made) == 10 + 16 and len(set(made)) == len(made)
    rows = summary["rows"]
    assert set(rows) == {"Original", "Retain", *METHODS, PALU_GPT4O, PALU_REFERENCE_MODEL}
    palu = rows["PALU"]["forget_quality"]
    assert (palu["mean"], palu["low"], palu["high"], palu["seeds"]) == (pytest.approx(0.51), 0.5, 0.52, 3)
    assert rows[PALU_REFERENCE_MODEL]["forget_quality"]["seeds"] == 3
    assert summary["reading"][0].startswith("PALU beats NPO, SimNPO, TPO on FQ")
    assert any(line.startswith("Span quality:") and "is behind PALU" in line for line in summary["reading"])
    assert (tmp_path / "smollm2-tofu" / "mu_vs_fq.png").is_file()


def test_unlearning_runs_are_cached_by_content_and_their_command_lines(monkeypatch, tmp_path):
    """A stopped experiment continues: a finished run is not made again; a seed, a span file or a model
    override makes another; a run stopped halfway (no marker) is made again from the start."""
    spans = tmp_path / "data" / "span_annotations" / "forget05.jsonl"
    spans.parent.mkdir(parents=True)
    spans.write_text("{}\n")
    (tmp_path / "data" / "full.json").write_text("{}\n")
    other = spans.parent / "gpt4o.jsonl"
    other.write_text("{}\n{}\n")
    benchmark = TofuBenchmark(tmp_path / "data", "forget05", "retain_subset", "holdout05", spans, 32, "")
    stages = miniature.Stages(benchmark, SIZE, tmp_path, tmp_path / "cache", miniature.Progress(1))
    original = tmp_path / "original"
    original.mkdir()
    (original / "model.safetensors").write_bytes(b"weights")
    made = []

    def fake_framework(entry, overrides, log_path, env):
        out_dir = Path(next(part for part in overrides if part.startswith("paths.output_dir=")).split("=")[1])
        out_dir.mkdir(parents=True)
        made.append(overrides)
        return 2.0

    monkeypatch.setattr(miniature, "run_framework", fake_framework)
    seed0 = Run("PALU", "PALU", 0, 1e-4, {"lr": 1e-4})
    first, seconds = stages.unlearn_cached("PALU", 1e-4, original, seed0.overrides(), seed0.name)
    assert seconds == 2.0 and len(made) == 1
    assert "model=SmolLM2-135M-Instruct" in made[0] and "trainer.args.bf16=true" in made[0]
    assert "trainer.args.seed=0" in made[0] and f"span_annotations={spans}" in made[0]
    assert stages.unlearn_cached("PALU", 1e-4, original, seed0.overrides(), seed0.name) == (first, 2.0)
    assert len(made) == 1  # cached
    seed1 = replace(seed0, seed=1)
    assert stages.unlearn_cached("PALU", 1e-4, original, seed1.overrides(), seed1.name)[0] != first
    gpt4o, _ = stages.unlearn_cached("PALU", 1e-4, original, seed0.overrides(), "g", spans=other)
    assert f"span_annotations={other}" in made[-1] and gpt4o != first and len(made) == 3
    (first / "demo_stage.json").unlink()  # stopped before it finished
    stages.unlearn_cached("PALU", 1e-4, original, seed0.overrides(), seed0.name)
    assert len(made) == 4
