"""The method table is the only list: a new entry reaches the demo, the recipe and the bench."""

import argparse
import ast
import importlib.util
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from palu_lab import demo, miniature
from palu_lab.benchmarks.dataset_folders import TofuBenchmark
from palu_lab.benchmarks.muse_subset import MuseBenchmark
from palu_lab.trainer_config import trainer_config
from palu_trainer.experiments import methods, recipe
from palu_trainer.experiments.methods import METHODS, Method, side_by_side_methods
from palu_trainer.spans.agreement import Agreement

ROOT = Path(__file__).resolve().parents[2]


PAPER_TABLE = ("GradAscent", "GradDiff", "DPO", "NPO", "SimNPO", "PDU", "TPO", "PALU")


@pytest.fixture
def with_wga(monkeypatch):
    monkeypatch.setitem(METHODS, "WGA", Method("WGA"))


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "perf" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_demo_runs_a_new_table_entry(with_wga, tmp_path):
    assert side_by_side_methods() == (*PAPER_TABLE, "WGA")
    benchmark = TofuBenchmark(tmp_path, "forget10", "retain90", "holdout10", tmp_path / "s.jsonl", 32, "")
    stages = miniature.Stages(
        benchmark, miniature.TOFU_SIZES["fast"], tmp_path, tmp_path / "cache", miniature.Progress(1)
    )
    command = stages.unlearn_overrides("WGA", 1e-3, tmp_path / "original", tmp_path / "WGA_lr0.001")
    assert "experiment=unlearn/tofu/default" in command and "trainer=WGA" in command
    assert not any(part.startswith("span_annotations=") for part in command)
    palu = stages.unlearn_overrides("PALU", 1e-3, tmp_path / "original", tmp_path / "PALU_lr0.001")
    assert "experiment=unlearn/tofu/palu" in palu and f"span_annotations={tmp_path / 's.jsonl'}" in palu
    tpo = stages.unlearn_overrides("TPO", 1e-3, tmp_path / "original", tmp_path / "TPO_lr0.001")
    assert "experiment=unlearn/tofu/tpo" in tpo and f"span_annotations={tmp_path / 's.jsonl'}" in tpo
    dpo = stages.unlearn_overrides("DPO", 1e-3, tmp_path / "original", tmp_path / "DPO_lr0.001")
    assert "experiment=unlearn/tofu/idk_local" in dpo and f"idk_path={tmp_path / 'idk.jsonl'}" in dpo
    pdu = stages.unlearn_overrides("PDU", 1e-3, tmp_path / "original", tmp_path / "PDU_lr0.001")
    assert "trainer.method_args.retain_loss_eps=0.3" in pdu  # PDU has no default for it


def test_recipe_plans_a_new_table_entry(with_wga, capsys):
    recipe.main(["--methods", "side-by-side", "--dry-run", "--gpus", "1"])
    unlearn_lines = [line for line in capsys.readouterr().out.splitlines() if "unlearn.yaml" in line]
    assert [line.split(" trainer=")[1].split()[0] for line in unlearn_lines] == list(side_by_side_methods())
    assert "trainer.method_args.kl_weight=1.0" in unlearn_lines[-2] and "kl_weight" not in unlearn_lines[-1]
    dpo_line = unlearn_lines[list(side_by_side_methods()).index("DPO")]
    assert "experiment=unlearn/tofu/idk_local" in dpo_line and "idk_path=" in dpo_line


@pytest.mark.slow
@pytest.mark.stack  # the bench drives Trainer.training_step itself: transformers 5 changed what it needs
def test_bench_times_a_new_table_entry(with_wga, tmp_path):
    out = tmp_path / "bench.json"
    tiny = [
        "--vocab-size",
        "96",
        "--hidden-size",
        "32",
        "--layers",
        "1",
        "--batch-size",
        "2",
        "--prompt-length",
        "12",
    ]
    bench = load_bench()
    arguments = [*tiny, "--rounds", "2", "--steps-per-round", "1", "--top-k", "8", "--no-k-sweep"]
    bench.main([*arguments, "--memory-repeats", "0", "--out", str(out)])
    timed = json.loads(out.read_text())["configs"]["custom"]["methods"]
    expected = ["GradAscent", "GradDiff", "NPO", "SimNPO", "PDU", "TPO", "PALU, reference model"]
    expected += ["PALU, reference cache", "WGA"]  # DPO's forget rows are answer pairs: not benched
    assert list(timed) == expected
    assert all(len(result["round_step_s"]) == 2 and result["step_s"]["min"] > 0 for result in timed.values())
    assert timed["GradDiff"]["step_vs_GradDiff"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert timed["PALU, reference cache"]["host_cache_bytes"] > 0 == timed["WGA"]["host_cache_bytes"]
    # peak memory: a fresh process runs the new entry alone (one method: the whole table is `make bench`)
    config = json.loads(out.read_text())["configs"]["custom"]["config"]
    run = bench.bench_runs(8)["WGA"]
    args = argparse.Namespace(memory_steps=1, threads=1, out=str(out))
    assert bench.peak_memory("WGA", run, config, args) > 2**20


def method_lists_outside_the_table() -> list[str]:
    """Each tuple, list, set or dict literal outside methods.py that names two or more table methods."""
    sources = [
        *(ROOT / "src" / "palu_trainer").rglob("*.py"),
        *(ROOT / "lab").rglob("*.py"),
        *(ROOT / "perf").glob("*.py"),
    ]
    found = []
    for path in sources:
        if path.name in ("methods.py", "method_lists.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                continue
            elements = node.keys if isinstance(node, ast.Dict) else node.elts
            named = [
                item.value for item in elements if isinstance(item, ast.Constant) and item.value in METHODS
            ]
            if len(named) >= 2:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {named}")
    return found


def test_only_the_table_names_methods():
    """demo, recipe, the analyses and bench hold no method list of their own: they read methods.py."""
    assert method_lists_outside_the_table() == []


def test_report_notes_name_pdu_settings_and_the_local_idk_answers(tmp_path):
    benchmark = TofuBenchmark(tmp_path, "forget10", "retain90", "holdout10", tmp_path / "s.jsonl", 32, "")
    notes = demo.method_notes(side_by_side_methods(), benchmark)
    assert any(note.startswith("PDU: also ") and "retain_loss_eps=0.3" in note for note in notes)
    assert any(f"30 phrasings written for this project to {tmp_path / 'idk.jsonl'}" in note for note in notes)
    assert demo.method_notes(("NPO", "TPO", "PALU"), benchmark) == []


def test_muse_demo_runs_table_entries_on_muse(tmp_path):
    benchmark = MuseBenchmark(tmp_path, tmp_path / "s.jsonl", {}, "", Agreement(1, 0, 0))
    size = miniature.MUSE_SIZES["fast"]
    stages = miniature.MuseStages(benchmark, size, tmp_path, tmp_path / "cache", miniature.Progress(1))
    assert stages.env["MUSE_DIR"] == str(tmp_path)
    length = size.max_length
    command = stages.unlearn_overrides("GradAscent", 1e-3, tmp_path / "original", tmp_path / "GA")
    assert "experiment=unlearn/muse/default" in command and "trainer=GradAscent" in command
    assert f"data.forget.MUSE_forget.args.max_length={length}" in command
    assert not any(part.startswith("span_annotations=") for part in command)
    palu = stages.unlearn_overrides("PALU", 1e-3, tmp_path / "original", tmp_path / "PALU")
    assert "experiment=unlearn/muse/palu" in palu and f"span_annotations={tmp_path / 's.jsonl'}" in palu
    assert f"data.forget.MUSE_forget_spans.args.max_length={length}" in palu
    assert f"data.retain.MUSE_retain.args.max_length={length}" in palu


def test_every_method_gets_the_same_budget_and_its_grid_holds_its_configured_value():
    rates = (3e-4, 1e-3, 3e-3)
    grids = {name: methods.tuning_grid(name, rates, tune_knobs=True) for name in side_by_side_methods()}
    assert {len(grid) for grid in grids.values()} == {9}
    for name, grid in grids.items():
        knob = METHODS[name].knob
        overrides = {extra for _, _, extra in grid}
        assert len(overrides) == (3 if knob else 1), name
        if knob is None:  # GradAscent: nine learning rates over the same range instead
            assert [rate for rate, _, _ in grid] == sorted({rate for rate, _, _ in grid})
            assert grid[0][0] == 3e-4 and grid[-1][0] == 3e-3
            continue
        config = trainer_config(METHODS[name].trainer)
        configured = dict(override.split("=") for override in METHODS[name].trainer_overrides)
        value = configured.get(knob.key) or OmegaConf.select(config, knob.key.removeprefix("trainer."))
        assert float(value) in knob.values, (name, value, knob.values)
    assert methods.tuning_grid("NPO", rates, tune_knobs=False) == [(rate, {"lr": rate}, ()) for rate in rates]
