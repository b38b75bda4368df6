"""`make gpu-check`: its CPU variant end to end, the stop without CUDA, the exit status of a failed run."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from palu_lab import gpu_check
from palu_trainer.training.run_stats import RunStatsCallback

ROOT = Path(__file__).resolve().parents[2]
CPU_RUNS = ("PALU cache on", *gpu_check.LORA_RUNS)


def test_without_cuda_make_gpu_check_stops_before_anything_runs_and_points_to_cpu(tofu_dir, tmp_path):
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        ["make", "-s", "-C", str(ROOT), f"PY={sys.executable}", "gpu-check", f"TOFU_DIR={tofu_dir}"],
        env=environment,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    assert "no CUDA GPU visible: make gpu-check needs one" in result.stderr
    assert "`make gpu-check CPU=1` runs the same pipeline on CPU" in result.stderr
    assert "gpu-check plan" not in result.stdout  # nothing planned, nothing built


def test_missing_tofu_configs_are_named(tmp_path):
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: forget01\n  data_files: forget01.json\n---\n"
    )
    problems = gpu_check.requirement_problems(tmp_path, cpu=True, gpus=0)
    assert problems == [
        f"TOFU: {tmp_path} lacks the configs full, retain99, forget01_perturbed, retain_perturbed, "
        "real_authors_perturbed, world_facts_perturbed"
    ]


def test_a_failed_run_makes_the_check_fail(tofu_dir, tmp_path, monkeypatch, capsys):
    """Every launch exits 1: each run and the evaluation are reported, and the check exits 1."""
    monkeypatch.setattr(gpu_check, "make_model", lambda *args: 0)
    monkeypatch.setattr(gpu_check.logged_runs, "run_logged", lambda command, log, env: (1, 0.5))
    monkeypatch.setattr(gpu_check.logged_runs, "log_tail", lambda path: "(log)")
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--cpu", "--tofu-dir", str(tofu_dir), "--out", str(tmp_path)])
    assert stop.value.code == 1
    out = capsys.readouterr().out
    assert out.count("FAILED (exit status 1)") == 6
    assert (
        "gpu-check FAILED (PALU cache on, PALU cache off, TPO, NPO, PALU LoRA 8B, NPO LoRA 8B, palu-eval)"
        in out
    )
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["eval"] == {"error": "PALU cache on failed: nothing to evaluate"}


def test_a_run_with_a_nan_loss_or_missing_steps_is_a_failure(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    history = [
        {"loss": 1.0, "step": 1},
        {"loss": float("nan"), "step": 2},
        {"train_steps_per_second": 2.0, "step": 2},
    ]
    (run_dir / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert gpu_check.training_result("x", run_dir, steps=2)["error"] == "non-finite loss: [1.0, nan]"
    assert gpu_check.training_result("x", run_dir, steps=3)["error"] == "2 logged losses, 3 steps asked for"
    assert gpu_check.training_result("x", tmp_path / "absent", steps=2)["error"].startswith("no ")


def test_the_run_stats_callback_writes_step_times_and_peak_memory(tmp_path):
    callback = RunStatsCallback(str(tmp_path / "out"))
    callback.on_train_begin(None, None, None)
    for _ in range(3):
        callback.on_step_end(None, None, None)
    callback.on_train_end(None, None, None)
    (stats,) = gpu_check.read_run_stats(tmp_path / "out")
    assert stats["steps"] == 3 and stats["rank"] == 0
    assert stats["step_end_seconds"] == sorted(stats["step_end_seconds"])
    assert stats["peak_rss_bytes"] > 10 * 2**20
    assert stats["peak_gpu_memory_bytes"] is None  # no CUDA here


@pytest.mark.slow(minutes=5)
def test_gpu_check_on_cpu_trains_its_cache_and_lora_runs_then_evaluates(tofu_dir, tmp_path):
    """The whole pipeline on CPU (fp32, small body at |V| = 32000, 3 steps): the runs that only this script
    makes (PALU with its cache, then evaluated, and the two LoRA runs); PALU without the cache, TPO and NPO
    go through the same code with the overrides that test_integration.py runs per method."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "palu_lab.gpu_check", "--cpu"]
    command += ["--tofu-dir", str(tofu_dir), "--out", str(tmp_path), "--methods", *CPU_RUNS]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    out = result.stdout
    # the plan (every command) comes before the first launch
    assert out.index("gpu-check plan:") < out.index("# PALU cache on\n") < out.index("== PALU cache on")
    assert out.count("palu-train --config-name=unlearn.yaml") == 3 and "palu-eval experiment=" in out
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["failures"] == []
    assert list(summary["runs"]) == list(CPU_RUNS)
    for label, run in summary["runs"].items():
        assert run["steps"] == 3 and len(run["losses"]) == 3, label
        assert all(math.isfinite(loss) for loss in run["losses"]), label
        assert run["steps_per_second"] > 0 and run["steps_per_second_after_first"] > 0, label
        assert run["peak_rss_bytes"] > 100 * 2**20, label
        assert f"{label:<16}     3 " in out and out.split(f"\n{label:<16}")[1].split("\n")[0].endswith("ok")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["vocab_size"] == 32000 and config["tie_word_embeddings"] is False
    # untied input and output embeddings (32000 x 64 each), 2 layers of attention 4 x 64^2, MLP 3 x 64 x 256
    assert summary["parameters"] == 2 * 32000 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64
    # PALU with the cache builds it and keeps no reference model; without it, no cache is built
    logs = {
        label: (tmp_path / "logs" / f"{gpu_check.slug(label)}.log").read_text() for label in summary["runs"]
    }
    assert "reference cache: 40 forget rows" in logs["PALU cache on"]
    assert "K=5000 of |V|=32000" in logs["PALU cache on"]  # the paper's K at Llama-2's vocabulary
    evaluation = summary["eval"]["metrics"]
    assert set(evaluation) >= {"model_utility", "forget_Q_A_ROUGE", "forget_Q_A_Prob", "forget_truth_ratio"}
    assert 0 < evaluation["forget_Q_A_Prob"] < 1e-3  # a random model at |V| = 32000
    # LoRA (on the small body on CPU): the cache and a reference without a second copy, merged weights saved
    assert "reference cache: 40 forget rows" in logs["PALU LoRA 8B"] and "LoRA r=16" in logs["PALU LoRA 8B"]
    assert "reference: the model with its LoRA adapters disabled (no second copy)" in logs["NPO LoRA 8B"]
    for label in gpu_check.LORA_RUNS:
        assert (tmp_path / "runs" / gpu_check.slug(label) / "adapter" / "adapter_model.safetensors").is_file()
    assert "gpu-check passed: 3 runs and palu-eval" in out


def test_the_model_is_initialised_on_the_device_asked_and_every_shard_is_counted(
    tofu_dir, tmp_path, monkeypatch
):
    """The 8B case initialises on the GPU (minutes on the CPU) and is saved in shards
    (model-0000k-of-0000n.safetensors): the parameter count reads every one."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from palu_lab.tiny import make_tiny_model, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(["a tiny text"] * 4, 300)
    assert next(make_tiny_model(tokenizer, device="meta").parameters()).device.type == "meta"
    save = PreTrainedModel.save_pretrained
    monkeypatch.setattr(
        PreTrainedModel, "save_pretrained", lambda self, to, **kw: save(self, to, max_shard_size="2MB", **kw)
    )
    parameters = gpu_check.make_model(tofu_dir, tmp_path / "model", gpu_check.CPU_SIZE)
    assert len(list((tmp_path / "model").glob("*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert parameters == sum(parameter.numel() for parameter in model.parameters()) > 4_000_000
