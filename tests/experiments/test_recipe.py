"""`make tofu` / `make compare`: the plan they print, and the fast failure on a machine without GPUs."""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.errors import GatedRepoError

from palu_trainer.experiments import recipe, requirements
from palu_trainer.experiments.methods import side_by_side_methods
from palu_trainer.experiments.recipe import (
    MuseRecipeSettings,
    RecipeSettings,
    method_runs,
    plan,
    write_comparison,
)
from palu_trainer.experiments.recipe import main as recipe_main
from palu_trainer.experiments.requirements import choose_attention, hub_problem, missing_requirements
from palu_trainer.framework.checkout import checkout_dir

ROOT = Path(__file__).resolve().parents[2]


def make(*args, **env):
    """Runs a make target as on a machine without GPUs (the fail-fast path), also where a GPU is present."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", **env}
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
    # the framework's Llama-2 config loads its tokenizer from the gated meta-llama repository
    assert (
        "tokenizer meta-llama/Llama-2-7b-chat-hf: not in the Hugging Face cache and HF_HUB_OFFLINE=1; "
        "online, run `huggingface-cli login`"
    ) in result.stderr
    assert "retain model logs saves/eval/tofu_Llama-2-7b-chat-hf_retain95/TOFU_EVAL.json" in result.stderr
    assert "`make demo`" in result.stderr
    # no flash-attn without CUDA: sdpa, said before the plan and passed to every run
    assert "asks for flash_attention_2, but no CUDA device: every run uses" in result.stderr
    launches = [
        line for line in result.stdout.splitlines() if "/palu-train " in line or "/palu-eval " in line
    ]
    assert len(launches) == 2 and all(
        "model.model_args.attn_implementation=sdpa" in line for line in launches
    )


def test_make_compare_plans_every_method_of_the_table(tmp_path):
    configs = "".join(
        f"- config_name: {name}\n  data_files: {name}.json\n" for name in ("forget10", "retain90")
    )
    (tmp_path / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    result = make("compare", "FORGET=10", f"TOFU_DIR={tmp_path}", f"IDK_ANSWERS={tmp_path}/idk.jsonl")
    assert result.returncode != 0
    assert f"TOFU_DIR={tmp_path} lacks the configs holdout10" in result.stderr
    unlearn_lines = [line for line in result.stdout.splitlines() if "--config-name=unlearn.yaml" in line]
    planned = [line.split(" trainer=")[1].split()[0] for line in unlearn_lines]
    paper_table = ["GradAscent", "GradDiff", "DPO", "NPO", "SimNPO", "PDU", "TPO", "PALU"]
    assert planned == paper_table == list(side_by_side_methods())
    assert all("forget_split=forget10" in line for line in unlearn_lines)
    assert f"{tmp_path}/idk.jsonl not found (DPO's" in result.stderr


def test_several_gpus_use_accelerate_with_the_framework_zero3_config(tmp_path):
    settings = RecipeSettings(forget="01", model="Llama-3.2-1B-Instruct", gpus=2, model_dir="/models/llama")
    (unlearn_title, unlearn), _ = plan([("PALU", settings)], tmp_path / "accelerate.yaml")
    assert unlearn[1:4] == ["launch", "--config_file", str(tmp_path / "accelerate.yaml")]
    assert "trainer.args.gradient_accumulation_steps=4" in unlearn  # 4 per device x 2 GPUs x 4 = 32
    assert "model.model_args.pretrained_model_name_or_path=/models/llama" in unlearn


def test_missing_tofu_configs_and_model_dir_are_named(tmp_path):
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: forget01\n  data_files: forget01.json\n---\n"
    )
    settings = RecipeSettings(
        forget="01", model="Llama-2-7b-chat-hf", gpus=1, model_dir=str(tmp_path / "absent")
    )
    problems = missing_requirements(settings, {"TOFU_DIR": str(tmp_path)})
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
    settings = RecipeSettings(forget="05", model="Llama-2-7b-chat-hf", gpus=2)
    fake_eval(Path(settings.original_logs_path), 1e-20, 0.95)
    fake_eval(Path(settings.retain_logs_path), 1.0, 0.9)
    for method, quality in (("NPO", 1e-3), ("SimNPO", 1e-4), ("PALU", 1e-2)):
        fake_eval(settings.eval_path(method), quality, 0.85)
    runs = method_runs(settings, ["NPO", "SimNPO", "PALU"], tune=False)
    paths = write_comparison(runs, {settings.task_name("PALU"): 120.0}, tmp_path / "report")
    summary = json.loads(paths["summary.json"].read_text())
    assert list(summary["selected"]) == ["PALU", "NPO", "SimNPO"]  # ranked by forget quality
    assert summary["selected"]["PALU"]["params"] == {"lr": "1e-5", "lambda": "1.0"}
    table = paths["summary.md"].read_text()
    assert "| PALU | 0.01 |" in table and "| 120 s |" in table
    assert paths["plot"].stat().st_size > 10_000


def test_make_muse_prints_the_muse_plan_then_fails_fast(tmp_path):
    result = make("muse", "SPLIT=News")
    assert result.returncode == 2
    assert (
        "palu-train --config-name=unlearn.yaml experiment=unlearn/muse/palu trainer=PALU model=Llama-2-7b-hf "
        "data_split=News task_name=muse_Llama-2-7b-hf_News_PALU_lr1e-5_lambda1.0 "
        "model.model_args.pretrained_model_name_or_path=muse-bench/MUSE-News_target"
    ) in result.stdout
    assert "palu-eval experiment=eval/muse/default model=Llama-2-7b-hf data_split=News" in result.stdout
    assert "CUDA GPU(s) needed, 0 visible" in result.stderr
    assert "model muse-bench/MUSE-News_target" in result.stderr
    assert "dataset muse-bench/MUSE-News: not cached" in result.stderr and "set MUSE_DIR" in result.stderr
    assert "retain model logs saves/eval/muse_Llama-2-7b-hf_News_retrain/MUSE_EVAL.json" in result.stderr


def test_make_compare_bench_muse_plans_every_method_and_names_missing_mirror_splits(muse_news_dir):
    result = make("compare", "BENCH=muse", f"MUSE_DIR={muse_news_dir}")
    assert result.returncode == 2
    # the local copy has no retain articles and no raw holdout: named before anything runs
    assert f"MUSE_DIR={muse_news_dir} lacks raw/retain1" in result.stderr
    unlearn_lines = [line for line in result.stdout.splitlines() if "--config-name=unlearn.yaml" in line]
    planned = [line.split(" trainer=")[1].split()[0] for line in unlearn_lines]
    assert planned == list(side_by_side_methods(bench="muse"))
    assert "TPO" not in planned and "DPO" not in planned and "PALU" in planned  # no MUSE setup for those here
    experiments = [line.split(" experiment=")[1].split()[0] for line in unlearn_lines]
    assert experiments == ["unlearn/muse/palu" if m == "PALU" else "unlearn/muse/default" for m in planned]
    assert all("data_split=News" in line for line in unlearn_lines)


def test_compare_tune_plans_the_equal_budget_grid(capsys):
    recipe_main(["--methods", "NPO", "PALU", "GradAscent", "--tune", "--dry-run", "--gpus", "1"])
    out = capsys.readouterr().out
    assert "NPO, PALU, GradAscent (lr x knob grid): 27 runs" in out
    unlearn_lines = [line for line in out.splitlines() if "unlearn.yaml" in line]
    tasks = [line.split(" task_name=")[1].split()[0] for line in unlearn_lines]
    assert len(set(tasks)) == 27
    npo = [line for line in unlearn_lines if " trainer=NPO " in line]
    assert sum("trainer.args.learning_rate=2e-05" in line for line in npo) == 3
    assert {line.split("trainer.method_args.beta=")[1].split()[0] for line in npo} == {"0.05", "0.1", "0.5"}
    # PALU's knob is its λ: set once, through the key the recipe already passes
    palu = [line for line in unlearn_lines if " trainer=PALU " in line]
    assert all(line.count("trainer.method_args.kl_weight=") == 1 for line in palu)
    assert {line.split("trainer.method_args.kl_weight=")[1].split()[0] for line in palu} == {"1", "2", "5"}
    # GradAscent has no knob: nine learning rates over the paper's range instead
    ascent = [line for line in unlearn_lines if " trainer=GradAscent " in line]
    rates = sorted(float(line.split("trainer.args.learning_rate=")[1].split()[0]) for line in ascent)
    assert len(set(rates)) == 9 and rates[0] == 1e-5 and rates[-1] == 5e-5


def test_make_tofu_ablation_plans_every_point_then_fails_fast_without_gpus():
    result = make("tofu-ablation", "AXIS=strategy", "FORGET=05")
    assert result.returncode == 2
    assert "PALU ablation, strategy: which tokens of each span initiate: 6 runs" in result.stdout
    unlearn_lines = [line for line in result.stdout.splitlines() if "unlearn.yaml" in line]
    assert len(unlearn_lines) == 6 and all(" trainer=PALU " in line for line in unlearn_lines)
    assert unlearn_lines[3].endswith("initiating_strategy=ratio initiating_ratio=0.25")
    assert (
        "task_name=tofu_Llama-2-7b-chat-hf_forget05_PALU_lr1e-5_lambda1.0_strategyfirst-25-"
        in unlearn_lines[3]
    )
    evals = [line for line in result.stdout.splitlines() if "palu-eval" in line]
    assert all(
        "+eval/tofu_metrics@eval.tofu.metrics.mia_min_k_plus_plus=mia_min_k_plus_plus" in e for e in evals
    )
    assert "CUDA GPU(s) needed, 0 visible" in result.stderr


def framework_script_path(script: str, option: str, **values) -> str:
    """`option`'s value on the framework's own command lines in scripts/<script>, its shell variables set."""
    text = (checkout_dir() / "scripts" / script).read_text()
    (value,) = {match for match in re.findall(rf"{re.escape(option)}=(\S+)", text)}
    return re.sub(r"\$\{(\w+)\}", lambda match: values[match.group(1)], value)


def test_retain_and_original_logs_are_where_the_framework_scripts_write_them():
    settings = RecipeSettings(forget="05", model="Llama-3.2-1B-Instruct", gpus=1)
    values = {"model": settings.model, "forget_split": "forget05", "retain_split": "retain95"}
    # tofu_finetune.sh evaluates the full model into saves/eval/tofu_<model>_full/evals_<forget split>
    full_dir = [
        line.split("paths.output_dir=")[1].split()[0]
        for line in (checkout_dir() / "scripts" / "tofu_finetune.sh").read_text().splitlines()
        if "paths.output_dir=" in line
    ]
    assert full_dir == ["saves/eval/tofu_${model}_full/evals_${forget_split}"]
    assert (
        settings.original_logs_path
        == "saves/eval/tofu_Llama-3.2-1B-Instruct_full/evals_forget05/TOFU_EVAL.json"
    )
    # ... and the retain model with task_name=tofu_<model>_<retain>, into eval's default
    # saves/eval/<task_name>; its unlearning script reads that file as retain_logs_path
    assert settings.retain_logs_path == framework_script_path("tofu_unlearn.sh", "retain_logs_path", **values)
    muse = MuseRecipeSettings(forget="News", model="Llama-2-7b-hf", gpus=1)
    muse_values = {"model": "Llama-2-7b-hf", "data_split": "News"}
    assert muse.retain_logs_path == framework_script_path(
        "muse_unlearn.sh", "retain_logs_path", **muse_values
    )
    assert (
        RecipeSettings("05", "m", 1, original_logs="/logs/full.json").original_logs_path == "/logs/full.json"
    )


def test_logs_in_the_framework_checkout_are_found_there(tmp_path, monkeypatch):
    """`setup_data.py --eval_logs`, run in the framework checkout, writes saves/eval there."""
    monkeypatch.chdir(tmp_path)
    checkout = tmp_path / "checkout"
    monkeypatch.setenv("OPEN_UNLEARNING_DIR", str(checkout))
    settings = RecipeSettings(forget="01", model="Llama-2-7b-chat-hf", gpus=1)
    assert (
        settings.original_logs_path == "saves/eval/tofu_Llama-2-7b-chat-hf_full/evals_forget01/TOFU_EVAL.json"
    )
    fake_eval(checkout / settings.original_logs_path, 1e-20, 0.95)
    assert settings.original_logs_path == str(
        checkout / "saves/eval/tofu_Llama-2-7b-chat-hf_full/evals_forget01/TOFU_EVAL.json"
    )
    fake_eval(tmp_path / "saves/eval/tofu_Llama-2-7b-chat-hf_full/evals_forget01/TOFU_EVAL.json", 1e-20, 0.95)
    assert (
        settings.original_logs_path == "saves/eval/tofu_Llama-2-7b-chat-hf_full/evals_forget01/TOFU_EVAL.json"
    )


def test_make_compare_names_the_original_logs_and_takes_original_logs(tmp_path):
    result = make("compare", "FORGET=01")
    assert result.returncode == 2
    assert (
        "Original model logs saves/eval/tofu_Llama-2-7b-chat-hf_full/evals_forget01/TOFU_EVAL.json not found"
    ) in result.stderr
    assert "`python setup_data.py --eval_logs`" in result.stderr and "ORIGINAL_LOGS" in result.stderr
    fake_eval(tmp_path / "full.json", 1e-20, 0.95)
    result = make("compare", "FORGET=01", f"ORIGINAL_LOGS={tmp_path / 'full.json'}")
    assert result.returncode == 2  # still no GPU here, but the Original logs are found
    assert "Original model logs" not in result.stderr and "CUDA GPU(s) needed" in result.stderr


@pytest.mark.parametrize(
    ("flash", "requested", "expected"),
    [
        (None, "auto", None),  # flash-attn imports: the config's own flash_attention_2
        ("the flash-attn package is not installed", "auto", "sdpa"),
        ("the flash-attn package is not installed", "eager", "eager"),
        (None, "sdpa", "sdpa"),
    ],
)
def test_attention_follows_the_config_unless_flash_attn_cannot_run(monkeypatch, flash, requested, expected):
    monkeypatch.setattr(requirements, "flash_attention_problem", lambda: flash)
    attention, warnings, problems = choose_attention("Llama-2-7b-chat-hf", requested)
    assert attention == expected and problems == []
    if expected == "sdpa" and requested == "auto":
        (warning,) = warnings
        assert warning.startswith(
            "model config Llama-2-7b-chat-hf asks for flash_attention_2, but the flash-attn package is not "
            "installed: every run uses model.model_args.attn_implementation=sdpa instead"
        )
        assert "`make flash-attn`" in warning and "pip install flash-attn --no-build-isolation" in warning
    else:
        assert warnings == []


def test_flash_attention_asked_for_but_absent_stops_the_recipe(monkeypatch, capsys):
    monkeypatch.setattr(
        requirements, "flash_attention_problem", lambda: "the flash-attn package is not installed"
    )
    # no hub request: huggingface-hub 0.36 (the 4.51 stack) retries an unreachable hub for ~45 s
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as stop:
        recipe_main(["--forget", "01", "--attn", "flash_attention_2", "--gpus", "1"])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert (
        "attn_implementation=flash_attention_2 asked for, but the flash-attn package is not installed: run "
    ) in captured.err
    assert "`make flash-attn`" in captured.err and "or ATTN=sdpa" in captured.err
    assert captured.out.count("model.model_args.attn_implementation=flash_attention_2") == 2  # in the plan


def test_flash_attention_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    assert requirements.flash_attention_problem() == "no CUDA device"


@pytest.fixture
def no_cache(monkeypatch):
    """Nothing in the Hugging Face cache, datasets found; the hub's answer for models is set per test."""
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *args, **kwargs: None)
    monkeypatch.setattr(recipe, "dataset_on_hub_or_cached", lambda repo_id: True)


def gated(message: str) -> GatedRepoError:
    """The hub's answer for a gated repository; huggingface-hub 1.x requires the response it came with."""
    response = inspect.signature(GatedRepoError.__init__).parameters["response"]
    if response.default is not inspect.Parameter.empty:
        return GatedRepoError(message)
    import httpx

    return GatedRepoError(
        message, response=httpx.Response(403, request=httpx.Request("GET", "https://huggingface.co"))
    )


def hub_answers(monkeypatch, error):
    def metadata(url, timeout):
        if error:
            raise error
        return object()

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", metadata)


def test_a_gated_tokenizer_without_access_says_to_log_in(monkeypatch, no_cache):
    hub_answers(monkeypatch, gated("Access to model meta-llama/Llama-2-7b-chat-hf is restricted"))
    problem = hub_problem("meta-llama/Llama-2-7b-chat-hf", "tokenizer", "tokenizer_config.json", {})
    assert problem == (
        "tokenizer meta-llama/Llama-2-7b-chat-hf is gated and this machine's token has no access: run "
        "`huggingface-cli login` with a token of an account that has access (if gated, accept its licence at "
        "https://huggingface.co/meta-llama/Llama-2-7b-chat-hf); or set MODEL_DIR to local weights saved with "
        "their tokenizer"
    )


def test_hub_checks_offline_fail_at_once_and_online_ask_for_one_file(monkeypatch, no_cache):
    hub_answers(monkeypatch, AssertionError("HF_HUB_OFFLINE=1 must not reach the hub"))
    offline = hub_problem(
        "meta-llama/Llama-2-7b-hf", "tokenizer", "tokenizer_config.json", {"HF_HUB_OFFLINE": "1"}
    )
    assert offline.startswith(
        "tokenizer meta-llama/Llama-2-7b-hf: not in the Hugging Face cache and HF_HUB_OFFLINE=1"
    )
    assert "`huggingface-cli login`" in offline
    hub_answers(monkeypatch, ConnectionError("Failed to resolve 'huggingface.co'"))
    unreachable = hub_problem("open-unlearning/tofu_Llama-2-7b-chat-hf_full", "model", "config.json", {})
    assert "hub is unreachable (ConnectionError)" in unreachable
    requested = []
    monkeypatch.setattr(
        huggingface_hub, "get_hf_file_metadata", lambda url, timeout: requested.append(url) or object()
    )
    assert hub_problem("meta-llama/Llama-2-7b-hf", "tokenizer", "tokenizer_config.json", {}) is None
    assert requested == ["https://huggingface.co/meta-llama/Llama-2-7b-hf/resolve/main/tokenizer_config.json"]


def test_the_recipe_checks_the_model_configs_tokenizer(monkeypatch, no_cache):
    asked = []

    def metadata(url, timeout):
        asked.append(url.split("/resolve/")[0].removeprefix("https://huggingface.co/"))
        if asked[-1].startswith("meta-llama/"):
            raise gated("restricted")
        return object()

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", metadata)
    settings = MuseRecipeSettings(forget="News", model="Llama-2-7b-hf", gpus=0)
    problems = missing_requirements(settings, {"MUSE_DIR": ""})
    assert asked[:2] == ["muse-bench/MUSE-News_target", "meta-llama/Llama-2-7b-hf"]
    assert any(p.startswith("tokenizer meta-llama/Llama-2-7b-hf is gated") for p in problems)
    assert not any(p.startswith("model muse-bench/MUSE-News_target") for p in problems)


def test_model_dir_needs_its_tokenizer(tmp_path, no_cache):
    (tmp_path / "config.json").write_text("{}")
    settings = RecipeSettings(forget="01", model="Llama-2-7b-chat-hf", gpus=0, model_dir=str(tmp_path))
    problems = missing_requirements(settings, {"TOFU_DIR": ""})
    assert any(p.startswith(f"MODEL_DIR={tmp_path} has no tokenizer") for p in problems)
    assert not any("has no config.json" in p for p in problems)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert not any("MODEL_DIR" in p for p in missing_requirements(settings, {"TOFU_DIR": ""}))
