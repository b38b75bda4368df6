"""`make demo FAST=1`: the whole pipeline through the framework's entry points, on synthetic data."""

import json
import subprocess
import sys


def test_fast_demo_produces_the_report_and_a_memorising_original(fast_results):
    command = [
        sys.executable,
        "-m",
        "palu_trainer.experiments.demo",
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
    assert set(summary["selected"]) == {"NPO", "PALU"}
    for run in summary["selected"].values():
        assert run["metrics"]["forget_quality"] is not None and run["wall_time_s"] > 0
    table = (run_dir / "summary.md").read_text()
    assert all(f"| {row} |" in table for row in ("Original", "Retain", "NPO", "PALU"))
    # the paper's Table 1 and 2 columns, from the metrics the tiny eval config adds to the stock ones
    for key in ("exact_memorization", "forget_truth_ratio", "mia_loss", "mia_zlib", "mia_min_k_plus_plus"):
        assert 0 <= original[key] <= 1, key
    assert original["exact_memorization"] > 0.9 > retain["exact_memorization"]
    assert original["mia_loss"] > 0.9, "Original tells its forget rows from never-seen holdout rows"
    assert "| Original | " in table.split("Table 2")[1] and "needs hub" in table
    assert "Tuning budget, the same for every method: NPO 1 runs: lr [0.001]; PALU 1 runs" in table
