"""The report: metrics read from TOFU_EVAL.json, the selection rule, table, JSON and plot."""

import json

import pytest

from palu_trainer.experiments import report


def eval_json(tmp_path, name, forget_quality, retain_value, forget_rouge=0.5):
    logs = {
        "forget_quality": {"agg_value": forget_quality},
        "model_utility": {"agg_value": 0.0},
        "forget_Q_A_ROUGE": {"agg_value": forget_rouge},
        "extraction_strength": {"agg_value": 0.3},
        "privleak": {"agg_value": -12.5},
        "retain_Q_A_ROUGE": {"agg_value": retain_value},
        "retain_Q_A_Prob": {"agg_value": retain_value},
        "retain_Truth_Ratio": {"agg_value": retain_value},
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(logs))
    return path


def test_metrics_and_retain_utility_come_from_the_eval_file(tmp_path):
    path = eval_json(tmp_path, "m", 0.2, 0.5)
    metrics = report.metrics_from_eval(path)
    assert metrics["forget_quality"] == 0.2 and metrics["privleak"] == -12.5
    assert metrics["retain_utility"] == pytest.approx(0.5)  # harmonic mean of three equal parts
    assert report.retain_utility({"retain_rouge": 0.0, "retain_prob": 1, "retain_truth_ratio": 1}) == 0.0


def test_selection_prefers_forget_quality_among_runs_that_keep_utility(tmp_path):
    keeps_low_fq = report.run_from_eval(eval_json(tmp_path, "a", 0.01, 0.9))
    keeps_high_fq = report.run_from_eval(eval_json(tmp_path, "b", 0.3, 0.8))
    collapses = report.run_from_eval(eval_json(tmp_path, "c", 0.9, 0.1))
    assert report.select_run([keeps_low_fq, keeps_high_fq, collapses], original_utility=1.0) is keeps_high_fq
    # nobody keeps 80% of 1.0 among these two: the one with more utility wins
    assert report.select_run([collapses, keeps_low_fq], original_utility=2.0) is keeps_low_fq


def test_write_report_makes_table_json_and_png(tmp_path):
    references = {
        "Original": report.run_from_eval(eval_json(tmp_path, "o", 1e-6, 0.9, 1.0), 100.0),
        "Retain": report.run_from_eval(eval_json(tmp_path, "r", None, 0.9, 0.3), 90.0),
    }
    grids = {
        "NPO": [report.run_from_eval(eval_json(tmp_path, "n", 0.05, 0.85), 10.0, {"lr": 1e-3})],
        "PALU": [report.run_from_eval(eval_json(tmp_path, "p", 0.5, 0.88), 12.0, {"lr": 1e-3})],
    }
    paths = report.write_report(
        tmp_path / "out", references, grids, "title", extra={"stage_times_s": {"x": 1}}
    )
    table = paths["summary.md"].read_text()
    assert table.index("| PALU |") < table.index("| NPO |")  # sorted by forget quality
    assert "| Retain | — |" in table  # a missing metric is a dash
    summary = json.loads(paths["summary.json"].read_text())
    assert summary["selected"]["PALU"]["params"] == {"lr": 1e-3} and summary["stage_times_s"] == {"x": 1}
    assert paths["plot"].read_bytes().startswith(b"\x89PNG")


def test_the_papers_tables_read_their_metrics_and_name_what_needs_the_hub(tmp_path):
    path = eval_json(tmp_path, "m", 0.2, 0.5)
    logs = json.loads(path.read_text())
    paper_keys = {"exact_memorization": 0.97, "forget_truth_ratio": 0.6, "ra_Truth_Ratio": 0.4,
                  "wf_Truth_Ratio": 0.45, "mia_loss": 0.99, "mia_zlib": 0.98, "mia_min_k": 0.97,
                  "mia_min_k_plus_plus": 0.71}  # fmt: skip
    path.write_text(json.dumps({**logs, **{key: {"agg_value": value} for key, value in paper_keys.items()}}))
    run = report.run_from_eval(path)
    assert run.metrics["exact_memorization"] == 0.97 and run.metrics["mia_min_k_plus_plus"] == 0.71
    table_1 = report.table({"PALU": run}, report.PAPER_TABLE_1)
    assert "| PALU | 0.2 | 0.000 | 0.970 | 0.600 | 0.500 | 0.400 | 0.450 | needs hub |" in table_1
    assert "| PALU | 0.990 | 0.980 | 0.970 | 0.710 |" in report.table({"PALU": run}, report.PAPER_TABLE_2)
    logs["forget_Q_A_gibberish"] = {"agg_value": 0.93}  # with the classifier available, the column fills in
    path.write_text(json.dumps(logs))
    assert "| 0.930 |" in report.table({"PALU": report.run_from_eval(path)}, report.PAPER_TABLE_1)
