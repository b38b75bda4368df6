"""`make demo BENCH=muse FAST=1`: the MUSE-News miniature through the framework's entry points (a file of
its own, so that pytest-xdist runs it beside the TOFU demo rather than after it)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow(minutes=5)
def test_fast_muse_demo_unlearns_a_model_that_memorised_news_articles(tmp_path, muse_news_dir):
    command = [
        *(sys.executable, "-m", "palu_lab.demo", "--bench", "muse", "--fast"),
        *("--muse-dir", str(muse_news_dir), "--results", str(tmp_path)),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    run_dir = tmp_path / "muse-fast"
    for name in ("summary.md", "summary.json", "knowmem_vs_verbmem.png"):
        assert str(run_dir / name) in result.stdout and (run_dir / name).stat().st_size > 0
    assert (run_dir / "knowmem_vs_verbmem.png").read_bytes().startswith(b"\x89PNG")
    summary = json.loads((run_dir / "summary.json").read_text())
    original = summary["references"]["Original"]["metrics"]
    retain = summary["references"]["Retain"]["metrics"]
    assert original["forget_verbmem"] > 0.5, "Original did not memorise the forget excerpts"
    assert retain["forget_verbmem"] < 0.3, "Retain, never trained on the forget excerpts, reproduces them"
    assert original["forget_knowmem"] > retain["forget_knowmem"]
    assert original["privleak"] < -50  # its min-k% MIA tells forget from holdout excerpts
    assert set(summary["selected"]) == {"NPO", "PALU"}
    for run in summary["selected"].values():
        assert run["metrics"]["forget_verbmem"] is not None and run["wall_time_s"] > 0
    assert summary["annotator_synthetic_news"]["f1"] > 0.85
    table = (run_dir / "summary.md").read_text()
    assert all(f"| {row} |" in table for row in ("Original", "Retain", "NPO", "PALU"))
    assert "VerbMem forget" in table and "KnowMem retain" in table
