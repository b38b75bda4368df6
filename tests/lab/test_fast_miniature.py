"""The FAST miniature through its commands, in one file so that one pytest worker builds the session's FAST
results folder (conftest: Original and Retain, made before these tests) once: `make demo FAST=1` (the whole
pipeline through the framework's entry points, on synthetic data), `make ablation` (a two-point sweep) and
`make convergence` (a two-epoch curve).
"""

import json
import subprocess
import sys

import pytest

from palu_lab import ablation, convergence


@pytest.mark.slow(minutes=5)  # with Original and Retain
def test_fast_demo_produces_the_report_and_a_memorising_original(fast_results):
    command = [
        sys.executable,
        "-m",
        "palu_lab.demo",
        "--fast",
        "--results",
        str(fast_results),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    run_dir = fast_results / "synthetic-fast"
    for name in ("summary.md", "summary.json", "mu_vs_fq.png"):
        assert (run_dir / name).stat().st_size > 0
        assert str(run_dir / name) in result.stdout  # paths are printed at the end
    assert (run_dir / "mu_vs_fq.png").read_bytes().startswith(b"\x89PNG")
    summary = json.loads((run_dir / "summary.json").read_text())
    original = summary["references"]["Original"]["metrics"]
    retain = summary["references"]["Retain"]["metrics"]
    assert original["forget_rouge"] > 0.9, "Original did not memorise the forget set"
    assert retain["forget_rouge"] < 0.6, "Retain, never trained on the forget set, reproduces it"
    assert original["retain_rouge"] > 0.9 and retain["retain_rouge"] > 0.9
    assert original["forget_quality"] < 0.01  # a memorising model is told apart from Retain
    assert set(summary["selected"]) == {"NPO", "TPO", "PALU"}
    for run in summary["selected"].values():
        assert run["metrics"]["forget_quality"] is not None and run["wall_time_s"] > 0
    table = (run_dir / "summary.md").read_text()
    assert all(f"| {row} |" in table for row in ("Original", "Retain", "NPO", "TPO", "PALU"))
    # the paper's Tables 1 and 2: exact memorization and the four MIA AUCs, forget vs holdout
    assert original["exact_memorization"] > 0.9 > retain["exact_memorization"]
    for attack in ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus"):
        assert original[attack] > 0.9 and 0.2 < retain[attack] < 0.8, attack
    assert "## The paper's Table 2: membership inference AUCs" in table and "| needs hub |" in table


@pytest.mark.slow(minutes=2)
def test_two_point_sweep_writes_the_chart_table_and_numbers(fast_results):
    ablation.main([
        "--fast", "--results", str(fast_results), "--jobs", "2", "--axes", "k",
        "--point", "1=trainer.method_args.top_k=1",
        "--point", "all=trainer.method_args.top_k=all",
        "--point", "broken=trainer.method_args.target=no_such_target",
    ])  # fmt: skip
    run_dir = fast_results / "ablation-fast"
    summary = json.loads((run_dir / "ablation.json").read_text())
    points = summary["axes"]["k"]["points"]
    assert list(points) == ["1", "all", "broken"] and summary["axes"]["k"]["default"] == "1"
    for label in ("1", "all"):
        metrics = points[label]["metrics"]
        assert 0 < metrics["forget_quality"] <= 1 and 0 < metrics["retain_utility"] <= 1
        assert 0 <= metrics["exact_memorization"] <= 1 and 0 <= metrics["mia_min_k"] <= 1
        assert points[label]["wall_time_s"] > 0
        assert points[label]["params"]["overrides"] == f"trainer.method_args.top_k={label}"
    original = summary["references"]["Original"]["metrics"]
    # the local loss is a mean over the K logits: at K=|V| the pull on the answer's own (top) logit is 1/|V|
    # of K=1's, so K=1 forgets more of the answers in the same epochs, and costs more utility; both move
    # away from Original (FAST's few forget rows make FQ too coarse to rank them)
    rouge = {label: points[label]["metrics"]["forget_rouge"] for label in ("1", "all")}
    utility = {label: points[label]["metrics"]["retain_utility"] for label in ("1", "all")}
    assert rouge["1"] < rouge["all"] < original["forget_rouge"], rouge
    assert utility["1"] < utility["all"], utility
    assert (
        points["broken"]["metrics"] == {}
        and "no_such_target" in (run_dir / points["broken"]["params"]["error"]).read_text()
    )
    table = (run_dir / "k.md").read_text()
    assert "| k=1 | " in table and "| k=all | " in table
    assert "- broken: no result (logs/unlearn_PALU_target-no_such_target.log)" in table
    assert "## The paper's Table 2" in table
    assert (run_dir / "k.png").read_bytes().startswith(b"\x89PNG")
    assert (run_dir / "k.png").stat().st_size > 20_000


@pytest.mark.slow(minutes=1.5)
def test_two_epoch_convergence_evaluates_every_checkpoint_then_removes_it(fast_results):
    """One method: the curve's mechanics (a checkpoint per epoch, each evaluated, then removed) are the same
    for every method (`make convergence` draws PALU's and NPO's)."""
    convergence.main(
        ["--fast", "--results", str(fast_results), "--jobs", "2", "--epochs", "2", "--methods", "PALU"]
    )
    run_dir = fast_results / "convergence-fast"
    summary = json.loads((run_dir / "convergence.json").read_text())
    original = summary["references"]["Original"]["metrics"]
    assert list(summary["curves"]) == ["PALU"]
    for method, curve in summary["curves"].items():
        assert [run["params"]["epoch"] for run in curve] == [0, 1, 2]
        assert curve[0]["metrics"] == original
        assert all(0 < run["metrics"]["forget_quality"] <= 1 for run in curve)
        # each epoch's own checkpoint was evaluated: the forget answers fade epoch by epoch
        rouge = [run["metrics"]["forget_rouge"] for run in curve]
        assert rouge[0] > rouge[1] > rouge[2], (method, rouge)
        assert not list((run_dir / "unlearn" / f"{method}_convergence").glob("checkpoint-*"))
    assert (run_dir / "convergence.png").read_bytes().startswith(b"\x89PNG")
    assert "| PALU, epoch 2 |" in (run_dir / "convergence.md").read_text()
