"""The plugin as users install it: a wheel built from the repo, installed into a fresh environment outside the
repo, runs palu-train, palu-eval and palu-annotate from another directory with the configs and span files it
carries (no clone of this repo on the path).

The fresh environment reaches the framework's requirements (torch, transformers, ...) through a .pth line to
this environment's site-packages, whose own .pth files (this repo's editable install) are not processed
there: only the wheel provides palu_trainer and the Hydra search-path plugin.
"""

import json
import math
import os
import re
import shlex
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from palu_trainer.framework.checkout import checkout_dir

from .conftest import EVAL_ROWS, make_tofu_mirror, read_jsonl
from .framework.test_framework_entry_point import (
    assert_eval_py_evaluates,
    framework_command,
    run_framework_train,
)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # the wheel's contents, on the default stack; its install runs on every stack


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
    ]
    subprocess.run([*command, str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    (built,) = out.glob("palu_trainer-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A new venv with the wheel installed; the framework's requirements reached through a .pth line."""
    env = tmp_path_factory.mktemp("env")
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    python = env / "bin" / "python"
    packages = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(packages) / "framework_requirements.pth").write_text(site.getsitepackages()[0] + "\n")
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, text=True, timeout=300)
    return env


def test_the_wheel_carries_the_configs_and_span_files_and_no_link(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"palu_trainer/resources/{path.relative_to(ROOT)}"
        for folder, pattern in (("configs", "**/*.yaml"), ("span_annotations", "*.jsonl"))
        for path in (ROOT / folder).glob(pattern)
    }
    assert len(expected) > 20 and expected <= names, sorted(expected - names)
    assert "palu_trainer/resources/configs/trainer/PALU.yaml" in names
    assert "hydra_plugins/palu_trainer_searchpath/searchpath.py" in names
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("palu_trainer/resources/span_annotations/tofu_forget01.jsonl")
    assert shipped == (ROOT / "span_annotations" / "tofu_forget01.jsonl").read_bytes()


def test_the_wheel_holds_the_plugin_and_not_the_lab(wheel):
    """The lab (lab/palu_lab: the miniature, the real-model experiments, the synthetic benchmarks) stays out
    of what users install; the line count of the wheel's Python is printed for the layout's budget."""
    with zipfile.ZipFile(wheel) as archive:
        python = {name: archive.read(name).decode() for name in archive.namelist() if name.endswith(".py")}
    lab_modules = {path.stem for path in (ROOT / "lab" / "palu_lab").rglob("*.py")} - {"__init__"}
    assert {name.split("/")[0] for name in python} == {"palu_trainer", "hydra_plugins"}
    assert [name for name in python if Path(name).stem in lab_modules] == []
    assert "palu_trainer/method/objective.py" in python and "palu_trainer/experiments/recipe.py" in python
    print(
        f"wheel: {len(python)} Python files, {sum(len(text.splitlines()) for text in python.values())} lines"
    )


@pytest.mark.slow(minutes=4.5)  # with building and installing the wheel
@pytest.mark.stack  # into each stack's environment (issue 61): other framework and transformers
def test_palu_train_eval_and_annotate_from_the_installed_wheel(
    installed, tmp_path, tiny_model_dir, small_tofu_mirror, tofu_dir
):
    """PALU with the span file the wheel carries (its default), its evaluation, and a span file check."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        "PATH": f"{installed / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "OPEN_UNLEARNING_DIR": str(checkout_dir()),
        "OMP_NUM_THREADS": "1",
    }

    def run(*command):
        result = subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        return result.stdout + result.stderr

    where = run(
        "python",
        "-c",
        "import palu_trainer, hydra_plugins.palu_trainer_searchpath as plugin\n"
        "print(palu_trainer.__file__, plugin.__file__)",
    )
    assert where.count(str(installed)) == 2 and str(ROOT) not in where
    model = [
        f"model.{args}.pretrained_model_name_or_path={tiny_model_dir}"
        for args in ("model_args", "tokenizer_args")
    ]
    splits = ["forget_split=forget01", "holdout_split=holdout01", "+runtime=cpu", "model=tiny-llama"]
    training = [
        "--config-name=unlearn.yaml",
        "experiment=unlearn/tofu/palu",
        "retain_split=retain99",
        "task_name=wheel",
        *splits,
    ]
    composed = run("palu-train", *training, "--cfg", "job", "--resolve")
    shipped = f"{where.split()[0].rsplit('/', 1)[0]}/resources/span_annotations/tofu_forget01.jsonl"
    assert f"span_annotations: {shipped}" in composed
    # the whole forget01 for the shipped span file (made for its 40 rows), the small sets for the evaluation
    retain = read_jsonl(tofu_dir / "retain99.json")
    env["TOFU_DIR"] = str(make_tofu_mirror(tmp_path / "tofu", tofu_dir, {"holdout01": retain[:40]}))
    run(
        "palu-train",
        *training,
        *model,
        "++trainer.args.max_steps=2",
        "trainer.args.per_device_train_batch_size=4",
        "trainer.args.gradient_accumulation_steps=1",
        "trainer.args.logging_steps=1",
        "trainer.args.eval_on_start=false",  # the stock trainer's evaluation before step 1: palu-eval's below
        "trainer.args.eval_strategy=no",
        "trainer.args.report_to=none",
        f"paths.output_dir={tmp_path / 'run'}",
    )
    env["TOFU_DIR"] = str(small_tofu_mirror)
    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    steps = [entry for entry in history if "local_loss" in entry]
    assert len(steps) == 2 and all(
        math.isfinite(entry["loss"]) and entry["n_initiating"] > 0 for entry in steps
    )
    run(
        "palu-eval",
        "experiment=eval/tofu/tiny",
        *splits,
        *[
            f"model.{args}.pretrained_model_name_or_path={tmp_path / 'run'}"
            for args in ("model_args", "tokenizer_args")
        ],
        "max_new_tokens=8",
        "task_name=wheel_eval",
        f"paths.output_dir={tmp_path / 'eval'}",
    )
    summary = json.loads((tmp_path / "eval" / "TOFU_SUMMARY.json").read_text())
    assert math.isfinite(summary["model_utility"]) and 0 < summary["forget_Q_A_Prob"] < 1
    rows = tmp_path / "forget01_rows.json"
    rows.write_text("".join((tofu_dir / "forget01.json").read_text().splitlines(keepends=True)[:EVAL_ROWS]))
    spans = tmp_path / "spans.jsonl"
    run("palu-annotate", "annotate", "--dataset", str(rows), "--out", str(spans))
    checked = run("palu-annotate", "validate", "--dataset", str(rows), str(spans))
    assert len(spans.read_text().splitlines()) == EVAL_ROWS
    assert f"{spans}: {EVAL_ROWS} rows match the dataset" in checked


@pytest.mark.slow(minutes=3)
@pytest.mark.stack
def test_the_frameworks_own_train_py_trains_palu_tpo_and_lora_from_the_wheel_and_eval_py_evaluates(
    installed, tmp_path, tiny_model_dir, tofu_mirror
):
    """Issue 60: in the framework's checkout at the stack's commit, unedited, its own src/train.py run by the
    environment that has only the built wheel trains PALU, TPO and PALU with LoRA; src/eval.py evaluates."""
    edited = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout_dir(), capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    assert edited == ""
    python = str(installed / "bin" / "python")
    where = subprocess.run(
        [python, "-c", "import palu_trainer; print(palu_trainer.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(str(installed))
    steps = ["+trainer.args.max_steps=2", "trainer.args.logging_steps=1"]
    runs = {"palu": ("palu", []), "tpo": ("tpo", []), "lora": ("palu", ["+peft=lora", "peft.r=4"])}
    for name, (method, options) in runs.items():
        command = framework_command(tofu_mirror, tiny_model_dir, tmp_path / name, [*steps, *options])
        command = [arg.replace("unlearn/tofu/palu", f"unlearn/tofu/{method}") for arg in command]
        result = run_framework_train(command, python=python)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        history = json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
        assert [entry["step"] for entry in history if "loss" in entry] == [1, 2]
        assert (tmp_path / name / "model.safetensors").is_file()
    assert (tmp_path / "lora" / "adapter" / "adapter_config.json").is_file()
    assert_eval_py_evaluates(tmp_path / "lora", tmp_path / "eval", tofu_mirror, python=python)


@pytest.fixture(scope="module")
def kit_tofu_mirror(tmp_path_factory, tofu_dir) -> Path:
    """TOFU with forget01 and retain99 whole (the kit trains on them with the shipped spans) and the sets
    only the evaluator reads cut to EVAL_ROWS rows (retain99 rows stand in for holdout01)."""
    evaluation_only = (
        "forget01_perturbed",
        "retain_perturbed",
        "real_authors_perturbed",
        "world_facts_perturbed",
    )
    replaced = {name: read_jsonl(tofu_dir / f"{name}.json")[:EVAL_ROWS] for name in evaluation_only}
    replaced["holdout01"] = read_jsonl(tofu_dir / "retain99.json")[:40]
    return make_tofu_mirror(tmp_path_factory.mktemp("kit-tofu"), tofu_dir, replaced)


@pytest.mark.slow(minutes=2)
def test_the_kit_made_from_the_installed_wheel_runs_offline_on_the_cpu_as_generated(
    installed, tmp_path, tiny_model_dir, kit_tofu_mirror
):
    """Issue 81: `palu-recipe kit` of the environment that has only the wheel writes the kit into a framework
    checkout, and its run.sh, unedited, trains and evaluates there with no hub and no GPU, given only the
    variables it declares (the model, TOFU_DIR, a one-point grid, a 2-step budget)."""
    usage = subprocess.run(
        [str(installed / "bin" / "palu-recipe"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "palu-recipe kit DIR" in usage
    checkout = tmp_path / "open-unlearning"
    checkout.mkdir()
    for part in ("src", "configs"):
        (checkout / part).symlink_to(checkout_dir() / part)
    made = subprocess.run(
        [str(installed / "bin" / "palu-recipe"), "kit", str(checkout)], cwd=tmp_path, capture_output=True,
        text=True,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    env = {
        **{key: value for key, value in os.environ.items() if key not in ("TOFU_DIR", "PYTHONPATH")},
        "HF_HUB_OFFLINE": "1", "TOFU_DIR": str(kit_tofu_mirror), "MODELS": "tiny-llama",
        "MODEL_PATH": str(tiny_model_dir), "SPLITS": "forget01 retain99", "LRS": "1e-5", "KNOBS": "1",
        "TRAIN_ARGS": "+trainer.args.max_steps=2", "OMP_NUM_THREADS": "1",
        "PATH": f"{installed / 'bin'}{os.pathsep}{os.environ['PATH']}",  # `python` in run.sh: the wheel's
    }  # fmt: skip
    result = subprocess.run(
        ["bash", "community/methods/PALU/run.sh"], cwd=checkout, env=env, capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    run = checkout / "saves" / "unlearn" / "tofu_tiny-llama_forget01_PALU_lr1e-5_kl_weight1"
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and (run / "model.safetensors").is_file()
    summary = json.loads((run / "evals" / "TOFU_SUMMARY.json").read_text())
    assert 0 < summary["forget_Q_A_Prob"] < 1 and 0 <= summary["model_utility"] < 1, summary
    assert "local dataset mirror: " in output  # the evaluators' hub paths pointed at TOFU_DIR


def own_environment_block(**values) -> str:
    """docs/setup.md's block for one's own environment, its variable lines set to `values`."""
    text = (ROOT / "docs" / "setup.md").read_text()
    block = text.split("<!-- own-environment -->\n```bash\n")[1].split("```\n<!-- /own-environment -->")[0]
    for name, value in values.items():
        block, count = re.subn(rf"^{name}=.*$", f"{name}={shlex.quote(str(value))}", block, flags=re.M)
        assert count == 1, name
    return block


def checkout_commit() -> str:
    return subprocess.run(
        ["git", "-C", str(checkout_dir()), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


UPSTREAM_MAIN = "4ad738a"  # open-unlearning's main as make setup STACK=4.51 clones it


@pytest.mark.stack
@pytest.mark.skipif(
    checkout_commit() != UPSTREAM_MAIN,
    reason=f"runs on the stack of open-unlearning's main ({UPSTREAM_MAIN}: make test-stack STACK=4.51, CI), "
    "which a user who sets up an environment today clones; its install takes two minutes",
)
@pytest.mark.slow(minutes=2)
def test_the_own_environment_block_of_setup_md_installs_a_working_environment_as_written(
    wheel, tmp_path, tiny_model_dir, tofu_mirror
):
    """Issue 81: the block, with only its variable lines set (upstream main's checkout, the built wheel,
    this machine's torch), makes a fresh venv in which palu-train trains PALU offline."""
    import torch

    venv = tmp_path / "venv"
    block = own_environment_block(
        OPEN_UNLEARNING_DIR=checkout_dir(),
        PALU_TRAINER=wheel,
        TORCH=f"torch=={torch.__version__}",
        VENV=venv,
    )
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    # pip's --no-compile (PIP_NO_COMPILE would read as --compile): no bytecode for the whole of torch and the
    # framework's requirements, of which the runs below import a part
    env["PIP_COMPILE"] = "0"
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=1500,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "palu-train" in result.stdout and "experiment=unlearn/tofu/palu" in result.stdout  # its --help
    run = tmp_path / "run"
    trained = subprocess.run(
        [str(venv / "bin" / "palu-train"),
         *framework_command(tofu_mirror, tiny_model_dir, run, ["+trainer.args.max_steps=2"])],
        cwd=tmp_path, env={**env, "OPEN_UNLEARNING_DIR": str(checkout_dir()), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-4000:]
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 2
