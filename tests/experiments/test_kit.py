"""`palu-recipe kit DIR`: PALU's and TPO's folders in open-unlearning's contribution format, whose results are
the README's measured table, and whose run.sh trains and evaluates through the framework's own scripts."""

import json
import os
import re
import subprocess
import sys

import pytest

from palu_trainer.experiments.kit import contributions, measured_results, write_kit
from palu_trainer.framework.checkout import PROJECT_ROOT, checkout_dir

from ..framework.test_bad_inputs import SPANS
from ..framework.test_framework_entry_point import OTHER_TOFU_METRICS


@pytest.fixture
def framework_copy(tmp_path):
    """A checkout to write into and run in: the framework's src/ and configs/ linked, its own saves/."""
    copy = tmp_path / "open-unlearning"
    copy.mkdir()
    for part in ("src", "configs"):
        (copy / part).symlink_to(checkout_dir() / part)
    return copy


def test_the_kit_has_the_frameworks_sections_and_the_measured_table(framework_copy):
    written = write_kit(framework_copy)
    assert [path.relative_to(framework_copy).as_posix() for path in written] == [
        f"community/methods/{name}/{file}" for name in ("PALU", "TPO") for file in ("README.md", "run.sh")
    ]
    table = measured_results(PROJECT_ROOT / "README.md")
    for contribution in contributions():
        readme = (framework_copy / "community" / "methods" / contribution.name / "README.md").read_text()
        assert re.findall(r"^# (\w+)", readme, re.M) == [contribution.name, "Setup", "Results", "Citation"]
        assert contribution.authors in readme and all(link in readme for link in contribution.links)
        assert "ships as a pip-installable plugin" in readme and table in readme
        assert "| PALU | lr 3e-5, λ 2, epoch 2 | 1 |" in readme and "SmolLM2-135M-Instruct" in readme
        assert "--render` at 6bd1572" in readme and "](docs/" not in readme
        script = (framework_copy / "community" / "methods" / contribution.name / "run.sh").read_text()
        assert (
            "# Hyper parameter tuning" in script.replace("#" * 10, "") or "Hyper parameter tuning" in script
        )
        assert "Final best parameters" in script and "python src/train.py" in script
        assert "python src/eval.py" in script and f"experiment={contribution.experiment}" in script
        assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    learning_rates = re.search(r"lrs=\(\$\{LRS:-(.*)\}\)", script).group(1)
    assert learning_rates == "1e-5 2e-5 5e-5"  # the paper's grid, also for TPO


def test_the_kit_refuses_a_folder_that_is_not_a_framework_checkout(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "palu_trainer.experiments.recipe", "kit", str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 1
    assert (
        f"palu-recipe kit: {tmp_path} is not an open-unlearning checkout (no src/train.py)" in result.stderr
    )


@pytest.mark.slow(minutes=2)
@pytest.mark.stack
def test_the_kits_run_sh_trains_and_evaluates_on_the_cpu(framework_copy, tiny_model_dir, tofu_mirror):
    write_kit(framework_copy)
    data = [
        f"data.{part}.args.hf_args.path={tofu_mirror}"
        for part in ("forget.TOFU_QA_forget_spans", "retain.TOFU_QA_retain")
    ]
    train = [
        "+runtime=cpu", "holdout_split=holdout01", f"span_annotations={SPANS / 'tofu_forget01.jsonl'}",
        "+trainer.args.max_steps=2", "trainer.args.do_eval=false", "trainer.args.eval_on_start=false",
        "trainer.args.eval_strategy=no", "trainer.args.report_to=none", "~eval", "~eval.tofu", *data,
    ]  # fmt: skip
    dataset = "eval.tofu.metrics.forget_Q_A_Prob.datasets.TOFU_QA_forget.args.hf_args.path"
    evaluation = [
        "+runtime=cpu",
        *(f"~eval.tofu.metrics.{m}" for m in OTHER_TOFU_METRICS),
        f"{dataset}={tofu_mirror}",
    ]
    env = {
        **{key: value for key, value in os.environ.items() if key != "TOFU_DIR"},
        "MODELS": "tiny-llama", "MODEL_PATH": str(tiny_model_dir), "SPLITS": "forget01 retain99",
        "LRS": "1e-5", "KNOBS": "1", "PER_DEVICE_TRAIN_BATCH_SIZE": "4", "GRADIENT_ACCUMULATION_STEPS": "1",
        "TRAIN_ARGS": " ".join(train), "EVAL_ARGS": " ".join(evaluation), "OMP_NUM_THREADS": "1",
        "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",  # `python` in run.sh
    }  # fmt: skip
    result = subprocess.run(
        ["bash", "community/methods/PALU/run.sh"], cwd=framework_copy, env=env, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    run = framework_copy / "saves" / "unlearn" / "tofu_tiny-llama_forget01_PALU_lr1e-5_kl_weight1"
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and (run / "model.safetensors").is_file()
    summary = json.loads((run / "evals" / "TOFU_SUMMARY.json").read_text())
    assert set(summary) == {"forget_Q_A_Prob"} and 0 < summary["forget_Q_A_Prob"] < 1
