"""`make ablation` and `make convergence` on the FAST miniature: a two-point sweep and a two-epoch curve.

Both use the session's FAST results folder (conftest), whose Original and Retain are made before them.
"""

import json

import pytest

from palu_trainer.experiments import ablation, convergence


@pytest.mark.slow
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


@pytest.mark.slow
def test_two_epoch_convergence_evaluates_every_checkpoint_then_removes_it(fast_results):
    convergence.main(["--fast", "--results", str(fast_results), "--jobs", "2", "--epochs", "2"])
    run_dir = fast_results / "convergence-fast"
    summary = json.loads((run_dir / "convergence.json").read_text())
    original = summary["references"]["Original"]["metrics"]
    assert list(summary["curves"]) == ["PALU", "NPO"]
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
