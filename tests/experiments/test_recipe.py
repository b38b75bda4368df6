"""`make tofu` / `make compare`: the plan they print, and the fast failure on a machine without GPUs."""

import json
import os
import subprocess
import sys
from pathlib import Path

from palu_trainer.experiments.methods import side_by_side_methods
from palu_trainer.experiments.recipe import RecipeSettings, missing_requirements, plan, write_comparison

ROOT = Path(__file__).resolve().parents[2]


def make(*args, **env):
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    python = f"PY={sys.executable}"
    return subprocess.run(
        ["make", "-s", "-C", str(ROOT), python, *args], env=environment, capture_output=True, text=True
    )


def test_make_tofu_prints_its_plan_then_fails_fast_without_gpus():
    result = make("tofu", "FORGET=05")
    assert result.returncode != 0
    assert "palu-train --config-name=unlearn.yaml experiment=unlearn/tofu/palu trainer=PALU" in result.stdout
    assert "forget_split=forget05 retain_split=retain95 holdout_split=holdout05" in result.stdout
    assert "palu-eval experiment=eval/tofu/default" in result.stdout
    assert "CUDA GPU(s) needed, 0 visible" in result.stderr
    assert "model open-unlearning/tofu_Llama-2-7b-chat-hf_full" in result.stderr
    assert "retain model logs saves/eval/tofu_Llama-2-7b-chat-hf_retain95/TOFU_EVAL.json" in result.stderr
    assert "`make demo`" in result.stderr


def test_make_compare_plans_every_method_of_the_table(tmp_path):
    configs = "".join(
        f"- config_name: {name}\n  data_files: {name}.json\n" for name in ("forget10", "retain90")
    )
    (tmp_path / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    result = make("compare", "FORGET=10", f"TOFU_DIR={tmp_path}")
    assert result.returncode != 0
    assert f"TOFU_DIR={tmp_path} lacks the configs holdout10" in result.stderr
    unlearn_lines = [line for line in result.stdout.splitlines() if "--config-name=unlearn.yaml" in line]
    planned = [line.split(" trainer=")[1].split()[0] for line in unlearn_lines]
    assert planned == ["GradDiff", "NPO", "SimNPO", "PALU"] == list(side_by_side_methods())
    assert all("forget_split=forget10" in line for line in unlearn_lines)


def test_several_gpus_use_accelerate_with_the_framework_zero3_config(tmp_path):
    run = RecipeSettings(forget="01", model="Llama-3.2-1B-Instruct", gpus=2, model_dir="/models/llama")
    (unlearn_title, unlearn), _ = plan(run, ["PALU"], tmp_path / "accelerate.yaml")
    assert unlearn[1:4] == ["launch", "--config_file", str(tmp_path / "accelerate.yaml")]
    assert "trainer.args.gradient_accumulation_steps=4" in unlearn  # 4 per device x 2 GPUs x 4 = 32
    assert "model.model_args.pretrained_model_name_or_path=/models/llama" in unlearn


def test_missing_tofu_configs_and_model_dir_are_named(tmp_path):
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: forget01\n  data_files: forget01.json\n---\n"
    )
    run = RecipeSettings(forget="01", model="Llama-2-7b-chat-hf", gpus=1, model_dir=str(tmp_path / "absent"))
    problems = missing_requirements(run, {"TOFU_DIR": str(tmp_path)})
    assert any("lacks the configs retain99, holdout01" in problem for problem in problems)
    assert any("MODEL_DIR=" in problem and "no config.json" in problem for problem in problems)


def fake_eval(path: Path, forget_quality: float, retain_rouge: float) -> None:
    metrics = {
        "forget_quality": forget_quality,
        "model_utility": 0.5,
        "forget_Q_A_ROUGE": 0.4,
        "extraction_strength": 0.1,
        "privleak": -5.0,
        "retain_Q_A_ROUGE": retain_rouge,
        "retain_Q_A_Prob": 0.9,
        "retain_Truth_Ratio": 0.6,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({key: {"agg_value": value} for key, value in metrics.items()}))


def test_compare_renders_one_table_from_the_framework_evaluations(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = RecipeSettings(forget="05", model="Llama-2-7b-chat-hf", gpus=2)
    fake_eval(Path(run.original_logs_path), 1e-20, 0.95)
    fake_eval(Path(run.retain_logs_path), 1.0, 0.9)
    for method, quality in (("NPO", 1e-3), ("SimNPO", 1e-4), ("PALU", 1e-2)):
        fake_eval(run.eval_path(method), quality, 0.85)
    paths = write_comparison(run, ["NPO", "SimNPO", "PALU"], {"PALU": 120.0}, tmp_path / "report")
    summary = json.loads(paths["summary.json"].read_text())
    assert list(summary["selected"]) == ["PALU", "NPO", "SimNPO"]  # ranked by forget quality
    assert summary["selected"]["PALU"]["params"] == {"lr": "1e-5", "lambda": "1.0"}
    table = paths["summary.md"].read_text()
    assert "| PALU | 0.01 |" in table and "| 120 s |" in table
    assert paths["plot"].stat().st_size > 10_000


def test_make_tofu_ablation_plans_every_point_of_the_axis_then_fails_fast():
    result = make("tofu-ablation", "FORGET=05", "AXIS=strategy")
    assert result.returncode != 0 and "CUDA GPU(s) needed, 0 visible" in result.stderr
    unlearn_lines = [line for line in result.stdout.splitlines() if "--config-name=unlearn.yaml" in line]
    assert len(unlearn_lines) == 6 and all("trainer=PALU" in line for line in unlearn_lines)
    assert unlearn_lines[1].endswith("initiating_strategy=random_n num_initiating_tokens=3")
    assert (
        "task_name=tofu_Llama-2-7b-chat-hf_forget05_PALU_lr1e-5_lambda1.0_strategy-first-25pct"
        in (unlearn_lines[3])
    )
