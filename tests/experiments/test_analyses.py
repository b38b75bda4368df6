"""`make ablation` and `make convergence` on the FAST miniature: a two-point sweep and a two-epoch curve."""

import json

from palu_trainer.experiments import ablation, convergence


def test_two_point_sweep_writes_the_chart_table_and_numbers(fast_results):
    ablation.main([
        "--fast", "--results", str(fast_results), "--jobs", "2", "--axes", "k",
        "--point", "1=trainer.method_args.top_k=1",
        "--point", "64=trainer.method_args.top_k=64",
        "--point", "broken=trainer.method_args.target=no_such_target",
    ])  # fmt: skip
    run_dir = fast_results / "ablation-fast"
    summary = json.loads((run_dir / "ablation.json").read_text())
    points = summary["axes"]["k"]["points"]
    assert list(points) == ["1", "64", "broken"] and summary["axes"]["k"]["default"] == "1"
    for label in ("1", "64"):
        metrics = points[label]["metrics"]
        assert 0 < metrics["forget_quality"] <= 1 and 0 < metrics["retain_utility"] <= 1
        assert 0 <= metrics["exact_memorization"] <= 1 and points[label]["wall_time_s"] > 0
        assert points[label]["params"]["overrides"] == f"trainer.method_args.top_k={label}"
    # flattening 64 of the reference's top logits moves the model further than flattening one
    assert points["1"]["metrics"]["forget_rouge"] != points["64"]["metrics"]["forget_rouge"]
    assert points["broken"]["metrics"] == {} and "error" in points["broken"]["params"]
    assert "no_such_target" in (run_dir / points["broken"]["params"]["error"]).read_text()
    original = summary["references"]["Original"]["metrics"]
    assert original["forget_quality"] < points["64"]["metrics"]["forget_quality"]
    table = (run_dir / "k.md").read_text()
    assert (
        "| k=1 | " in table
        and "| k=64 | " in table
        and "- broken: no result (logs/unlearn_PALU_k_broken.log)" in table
    )
    assert (run_dir / "k.png").read_bytes().startswith(b"\x89PNG")

    # --render rebuilds the outputs from the evaluations on disk, without training
    points_again = [
        "--point",
        "64=trainer.method_args.top_k=64",
        "--point",
        "128=trainer.method_args.top_k=128",
    ]
    ablation.main(["--fast", "--results", str(fast_results), "--render", "--axes", "k", *points_again])
    rendered = json.loads((run_dir / "ablation.json").read_text())["axes"]["k"]["points"]
    assert rendered["64"]["metrics"] == points["64"]["metrics"] and rendered["64"]["wall_time_s"] is None
    assert rendered["128"]["metrics"] == {} and "not evaluated" in rendered["128"]["params"]["error"]


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
