"""The framework's own entry point, `python src/train.py` in its checkout, with the plugin installed and
nothing of the framework edited: PALU registers itself (the Hydra search-path plugin), trains as under
palu-train, and its trainer carries the run guard (divergence, SIGTERM) and resuming with it. Another Hydra
app in the same environment imports nothing of PALU's."""

import functools
import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from palu_trainer.framework.checkout import checkout_dir
from palu_trainer.framework.checks import OVERWRITE_FLAG
from palu_trainer.framework.provenance import ALLOW_OTHER_OPTIONS, RUN_OPTIONS_FILE
from palu_trainer.training.run_folder import FAILED_RUN_FILE, STAGING_DIR
from palu_trainer.training.run_guard import hydra_quoted
from palu_trainer.training.run_lock import LOCK_FILE

from ..conftest import unavailable
from .test_bad_inputs import BIN, QUICK_RUN, SPANS
from .test_run_faults import FINISHED_LOOKING, STOCK_RUN, decoy_checkout, preempted_after, steps_logged


def framework_command(
    tofu_mirror, model_dir, out_dir, overrides, run=QUICK_RUN, forget="TOFU_QA_forget_spans"
) -> list[str]:
    """`run` (QUICK_RUN: PALU) with the data paths set on the command line (no TOFU_DIR: only palu-train
    reads it) and the stock evaluator left out (its data would come from the hub)."""
    paths = [
        f"data.forget.{forget}.args.hf_args.path={tofu_mirror}",
        f"data.retain.TOFU_QA_retain.args.hf_args.path={tofu_mirror}",
    ]
    models = [
        f"model.{args}.pretrained_model_name_or_path={model_dir}" for args in ("model_args", "tokenizer_args")
    ]
    output = f"paths.output_dir={hydra_quoted(str(out_dir))}"
    return [*run, *paths, *models, "~eval", "~eval.tofu", output, *overrides]


def environment() -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TOFU_DIR"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_framework_train(
    arguments, timeout=600, python=sys.executable, env=None, preexec_fn=None
) -> subprocess.CompletedProcess:
    """The framework's src/train.py in its checkout, run by `python` (this environment's, or one with only
    the built wheel installed)."""
    return subprocess.run(
        [python, "src/train.py", *arguments], cwd=checkout_dir(), env=env or environment(),
        capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn,
    )  # fmt: skip


def train_through(
    entry_point: str, arguments, address_space: int | None = None, **environ
) -> subprocess.CompletedProcess:
    """palu-train, or the framework's own src/train.py, on the same arguments (`environ` added), in at most
    `address_space` bytes of virtual memory if given."""
    env = {**environment(), **environ}
    limit = None
    if address_space:
        limit = functools.partial(resource.setrlimit, resource.RLIMIT_AS, (address_space, address_space))
    if entry_point == "src/train.py":
        return run_framework_train(arguments, env=env, preexec_fn=limit)
    return subprocess.run(
        [str(BIN / "palu-train"), *arguments], env=env, capture_output=True, text=True, timeout=600,
        preexec_fn=limit,
    )  # fmt: skip


def program(entry_point: str) -> str:
    """The name a stop's message starts with."""
    return "train.py" if entry_point == "src/train.py" else "palu-train"


def stopped(entry_point: str, arguments, **limits) -> str:
    """The output of a run through `entry_point` that must stop before its end with exit 1."""
    result = train_through(entry_point, arguments, **limits)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    return output


def trained(entry_point: str, arguments) -> str:
    result = train_through(entry_point, arguments)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


def saving_every_two_steps(max_steps: int) -> list[str]:
    return [
        f"+trainer.args.max_steps={max_steps}",
        "trainer.args.save_strategy=steps",
        "+trainer.args.save_steps=2",
    ]


def losses(out_dir) -> list[tuple]:
    history = json.loads((out_dir / "trainer_state.json").read_text())["log_history"]
    keys = ("loss", "grad_norm", "local_loss", "kl_loss", "retain_loss")
    return [tuple(entry.get(key) for key in keys) for entry in history if "loss" in entry]


@pytest.mark.slow(minutes=2)
@pytest.mark.stack
def test_palu_and_tpo_train_through_the_frameworks_own_train_py_as_through_palu_train(
    tmp_path, tiny_model_dir, tofu_mirror
):
    steps = ["+trainer.args.max_steps=3", "trainer.args.logging_steps=1"]
    framework = framework_command(tofu_mirror, tiny_model_dir, tmp_path / "framework", steps)
    result = run_framework_train(framework)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "PALUTrainer Trainer loaded" in result.stdout + result.stderr
    wrapped = train_through(
        "palu-train", framework_command(tofu_mirror, tiny_model_dir, tmp_path / "palu-train", steps)
    )
    assert wrapped.returncode == 0, (wrapped.stdout + wrapped.stderr)[-4000:]
    through_framework = losses(tmp_path / "framework")
    assert len(through_framework) == 3 and all(value > 0 for value in through_framework[0][:3])
    assert through_framework == losses(tmp_path / "palu-train")
    assert (tmp_path / "framework" / "model.safetensors").is_file()

    tpo = [arg.replace("experiment=unlearn/tofu/palu", "experiment=unlearn/tofu/tpo") for arg in framework]
    tpo = [arg.replace("/framework", "/tpo") for arg in tpo]
    result = run_framework_train(tpo)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    history = json.loads((tmp_path / "tpo" / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "loss" in entry] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.stack
def test_a_diverged_run_through_train_py_exits_non_zero_with_the_message_and_saves_no_model(
    tmp_path, tiny_model_dir, tofu_mirror
):
    out = tmp_path / "run"
    overrides = [
        "+trainer.args.max_steps=6",
        "trainer.args.learning_rate=1e6",
        "trainer.args.logging_steps=1",
    ]
    result = run_framework_train(framework_command(tofu_mirror, tiny_model_dir, out, overrides))
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert re.search(r"train\.py: training diverged at step \d+", output)
    assert "lower trainer.args.learning_rate (now 1e+06)" in output
    assert "Traceback" not in output and "Error executing job" not in output
    assert (out / FAILED_RUN_FILE).is_file()
    assert not any((out / name).exists() for name in FINISHED_LOOKING)


@pytest.mark.slow(minutes=1.5)
# SIGINT takes SIGTERM's path once the guard's handler has it: the stacks' checkpoint and resume are SIGTERM's
@pytest.mark.parametrize("preemption", [pytest.param(signal.SIGTERM, marks=pytest.mark.stack), signal.SIGINT])
def test_a_preemption_through_train_py_leaves_a_checkpoint_that_train_py_resumes(
    preemption, tmp_path, tiny_model_dir, tofu_mirror
):
    out = tmp_path / "run x=y,z"  # the printed command quotes it for Hydra and the shell
    arguments = framework_command(
        tofu_mirror, tiny_model_dir, out, ["+trainer.args.max_steps=60", "trainer.args.logging_steps=1"]
    )
    code, output = preempted_after(
        3, [sys.executable, "src/train.py", *arguments], preemption, environment(), cwd=checkout_dir()
    )
    assert code == 128 + preemption, output[-3000:]
    step = int(re.search(rf"train\.py: stopped by {preemption.name} after step (\d+) of 60", output).group(1))
    assert "Traceback" not in output
    checkpoint = out / f"checkpoint-{step}"
    assert (checkpoint / "optimizer.pt").is_file() and not (out / "model.safetensors").exists()

    resume = shlex.split(output.split("Resume with:\n")[1].splitlines()[0])
    assert resume[:2] == ["python", "src/train.py"]
    assert resume[-1] == f"+trainer.args.resume_from_checkpoint={hydra_quoted(str(checkpoint))}"
    resumed = run_framework_train(resume[2:])
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert steps_logged(resumed.stdout + resumed.stderr) == 60 - step
    assert (out / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def nan_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with nan in two of its weight tensors, as a broken file or a diverged save leaves it."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("nan-model")
    for path in tiny_model_dir.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    weights = load_file(out / "model.safetensors")
    for name in sorted(weights)[:2]:
        weights[name].view(-1)[0] = float("nan")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("entry_point", ["palu-train", "src/train.py"])
def test_a_starting_model_with_nan_weights_is_named_before_the_first_step(
    entry_point, tmp_path, nan_model_dir, tofu_mirror
):
    arguments = framework_command(tofu_mirror, nan_model_dir, tmp_path / "run", ["+trainer.args.max_steps=3"])
    result = train_through(entry_point, arguments)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert re.search(
        r"(palu-train|train\.py): the starting model \(.*\) holds non-finite weights before the first step: "
        r"2 tensor\(s\) with nan or inf, the first ",
        output,
    )
    assert "training diverged" not in output and "Traceback" not in output
    assert steps_logged(output) == 0


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("entry_point", ["palu-train", "src/train.py"])
def test_palu_on_the_stock_forget_set_stops_with_the_message_alone(
    entry_point, tmp_path, tiny_model_dir, tofu_mirror
):
    """palu-train refuses it before loading (a config check); under train.py, which runs no check before
    loading, the trainer stops when it is built."""
    arguments = framework_command(
        tofu_mirror, tiny_model_dir, tmp_path / "run", ["trainer=PALU"], STOCK_RUN, "TOFU_QA_forget"
    )
    result = train_through(entry_point, arguments)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    expected = {
        "palu-train": "palu-train: trainer=PALU reads span roles in the forget batches",
        "src/train.py": "train.py: PALU needs token roles in the forget batches",
    }[entry_point]
    assert expected in output and "Traceback" not in output, output[-3000:]
    assert "unlearn/tofu/palu" in output.split(expected)[1].splitlines()[0]


def test_another_hydra_app_imports_nothing_of_palus(tmp_path):
    """The search-path plugin runs in every Hydra app of the environment: outside the framework it only
    adds a config folder."""
    (tmp_path / "app.yaml").write_text("value: 1\n")
    (tmp_path / "app.py").write_text(
        "import sys, hydra\n"
        "@hydra.main(version_base=None, config_path='.', config_name='app')\n"
        "def main(cfg):\n"
        "    heavy = [m for m in ('torch', 'transformers', 'trainer', 'palu_trainer.framework.datasets')"
        " if m in sys.modules]\n"
        "    print('value', cfg.value, 'imported', heavy)\n"
        "main()\n"
    )
    result = subprocess.run(
        [sys.executable, "app.py", "hydra.run.dir=."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "value 1 imported []" in result.stdout


# The stock TOFU evaluator's metrics but forget_Q_A_Prob, whose data the test sets locally.
OTHER_TOFU_METRICS = (
    "forget_truth_ratio", "forget_quality", "forget_Q_A_ROUGE", "model_utility", "privleak",
    "extraction_strength",
)  # fmt: skip


def assert_eval_py_evaluates(model_dir, out_dir, tofu_mirror, python=sys.executable) -> None:
    """The framework's src/eval.py, with the stock TOFU evaluator cut to forget_Q_A_Prob on the local
    forget01, evaluates `model_dir` into `out_dir`."""
    model = [
        f"model.{args}.pretrained_model_name_or_path={model_dir}" for args in ("model_args", "tokenizer_args")
    ]
    dataset = "eval.tofu.metrics.forget_Q_A_Prob.datasets.TOFU_QA_forget.args.hf_args.path"
    arguments = [
        "experiment=eval/tofu/tiny",
        "+runtime=cpu",
        "forget_split=forget01",
        "task_name=eval",
        *(f"~eval.tofu.metrics.{metric}" for metric in OTHER_TOFU_METRICS),
        f"{dataset}={tofu_mirror}",
        *model,
        f"paths.output_dir={out_dir}",
    ]
    evaluation = subprocess.run(
        [python, "src/eval.py", *arguments], cwd=checkout_dir(), env=environment(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert evaluation.returncode == 0, (evaluation.stdout + evaluation.stderr)[-4000:]
    summary = json.loads((out_dir / "TOFU_SUMMARY.json").read_text())
    assert set(summary) == {"forget_Q_A_Prob"} and 0 < summary["forget_Q_A_Prob"] < 1


@pytest.mark.slow(minutes=2)
@pytest.mark.stack
def test_palu_with_lora_trains_through_train_py_as_through_palu_train_and_eval_py_evaluates_it(
    tmp_path, tiny_model_dir, tofu_mirror
):
    steps = ["+peft=lora", "peft.r=4", "+trainer.args.max_steps=3", "trainer.args.logging_steps=1"]
    out = tmp_path / "framework"
    result = run_framework_train(framework_command(tofu_mirror, tiny_model_dir, out, steps))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    wrapped = train_through(
        "palu-train", framework_command(tofu_mirror, tiny_model_dir, tmp_path / "palu-train", steps)
    )
    assert wrapped.returncode == 0, (wrapped.stdout + wrapped.stderr)[-4000:]
    assert len(losses(out)) == 3 and losses(out) == losses(tmp_path / "palu-train")
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["base_model_name_or_path"] == str(tiny_model_dir)
    assert (out / "model.safetensors").is_file()

    assert_eval_py_evaluates(out, tmp_path / "eval", tofu_mirror)


@pytest.mark.slow
@pytest.mark.parametrize("entry_point", ["src/train.py", "palu-train"])
def test_lora_target_modules_that_match_nothing_stop_before_training_through_both_entry_points(
    entry_point, tmp_path, tiny_model_dir, tofu_mirror
):
    overrides = ["+peft=lora", "peft.target_modules=[qkv]", "+trainer.args.max_steps=1"]
    output = stopped(entry_point, framework_command(tofu_mirror, tiny_model_dir, tmp_path / "run", overrides))
    assert f"{program(entry_point)}: peft.target_modules=['qkv'] matches no module of llama" in output
    assert "Traceback" not in output and not (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_bad_config_stops_train_py_with_the_plugins_message(tmp_path, tiny_model_dir, tofu_mirror):
    overrides = ["+peft=lora", "peft.r=0"]
    output = stopped(
        "src/train.py", framework_command(tofu_mirror, tiny_model_dir, tmp_path / "run", overrides)
    )
    assert "train.py: peft.r=0: must be an integer >= 1 (the adapters' rank)" in output
    assert "Traceback" not in output and "PALUTrainer Trainer loaded" not in output


@pytest.mark.slow(minutes=1.5)
@pytest.mark.stack
@pytest.mark.parametrize("entry_point", ["src/train.py", "palu-train"])
def test_a_folder_with_a_finished_model_or_a_failed_mark_is_not_overwritten_unless_asked(
    entry_point, tmp_path, tiny_model_dir, tofu_mirror
):
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.safetensors").write_text("the finished model")
    steps = ["+trainer.args.max_steps=2"]
    output = stopped(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, steps))
    assert (
        f"{program(entry_point)}: paths.output_dir={out} already holds a finished model (model.safetensors)"
        in output
    )
    assert f"add {OVERWRITE_FLAG} to replace it" in output and "Traceback" not in output
    assert "PALUTrainer Trainer loaded" not in output
    assert (out / "model.safetensors").read_text() == "the finished model"

    (out / "model.safetensors").unlink()
    (out / FAILED_RUN_FILE).write_text(json.dumps({"reason": "diverged", "step": 3}))
    output = stopped(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, steps))
    assert f"already holds a failed run's marker ({FAILED_RUN_FILE})" in output

    (out / "model.safetensors").write_text("the finished model")
    trained(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, [*steps, OVERWRITE_FLAG]))
    assert (out / "model.safetensors").stat().st_size > 10_000 and not (out / FAILED_RUN_FILE).exists()


@pytest.mark.slow(minutes=2)
@pytest.mark.parametrize("entry_point", ["src/train.py", "palu-train"])
def test_a_resume_under_other_options_or_from_a_damaged_checkpoint_stops_and_resume_true_skips_it(
    entry_point, tmp_path, tiny_model_dir, tofu_mirror
):
    out = tmp_path / "run"
    trained(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, saving_every_two_steps(4)))
    recorded = json.loads((out / "checkpoint-4" / RUN_OPTIONS_FILE).read_text())
    assert recorded["trainer"] == "PALUTrainer" and recorded["trainer.method_args.top_k"] == 0.15625

    resumed = ["+trainer.args.max_steps=6", "+trainer.args.resume_from_checkpoint=true"]
    other = [*resumed, "trainer.method_args.top_k=0.5", "trainer.method_args.kl_weight=2"]
    output = stopped(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, other))
    assert (
        f"{program(entry_point)}: resume_from_checkpoint={out}/checkpoint-4 was trained under other options "
        "(trainer.method_args.kl_weight: 1.0 then, 2 now; trainer.method_args.top_k: 0.15625 then, 0.5 now)"
    ) in output
    assert f"+{ALLOW_OTHER_OPTIONS}=true" in output and "PALUTrainer Trainer loaded" not in output

    weights = out / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a save killed while writing it
    named = [f"+trainer.args.resume_from_checkpoint={out / 'checkpoint-4'}", "+trainer.args.max_steps=6"]
    output = stopped(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, named))
    assert (
        f"{program(entry_point)}: resume_from_checkpoint={out}/checkpoint-4: model.safetensors is damaged ("
        in output
    )
    assert f"the newest complete checkpoint is {out}/checkpoint-2" in output and "Traceback" not in output

    output = trained(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, resumed))
    assert "resume_from_checkpoint=true: skipped checkpoint-4: model.safetensors is damaged (" in output
    assert f"resuming from {out}/checkpoint-2" in output
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6  # 2 resumed, 4 more


KILL_DURING_THE_SECOND_SAVE = """
import os, signal
import transformers

saving_rng_state = transformers.Trainer._save_rng_state


def killed_at_step_4(self, output_dir):  # after the weights and optimizer state, before trainer_state.json
    if self.state.global_step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return saving_rng_state(self, output_dir)


transformers.Trainer._save_rng_state = killed_at_step_4
"""


@pytest.mark.slow(minutes=1.5)
@pytest.mark.stack
@pytest.mark.parametrize("entry_point", ["src/train.py", "palu-train"])
def test_a_kill_during_a_checkpoint_save_leaves_no_half_checkpoint_and_resume_true_takes_the_last_whole(
    entry_point, tmp_path, tiny_model_dir, tofu_mirror, monkeypatch
):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_DURING_THE_SECOND_SAVE)
    out = tmp_path / "run"
    saving = saving_every_two_steps(6)
    with monkeypatch.context() as patch:
        patch.setenv("PYTHONPATH", str(hook), prepend=os.pathsep)
        killed = train_through(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, saving))
    assert killed.returncode == -signal.SIGKILL, (killed.stdout + killed.stderr)[-3000:]
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2"]
    staged = out / STAGING_DIR / "checkpoint-4"
    assert (staged / "optimizer.pt").is_file() and not (staged / "trainer_state.json").exists()

    resume = [*saving, "+trainer.args.resume_from_checkpoint=true"]
    trained(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, resume))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6
    assert sorted(path.name for path in out.glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert not (out / STAGING_DIR).exists()


@pytest.mark.slow(minutes=1.5)
@pytest.mark.stack
def test_two_runs_into_one_folder_through_both_entry_points(tmp_path, tiny_model_dir, tofu_mirror):
    out = tmp_path / "run"
    long_run = framework_command(tofu_mirror, tiny_model_dir, out, ["+trainer.args.max_steps=5000"])
    first = subprocess.Popen(
        [sys.executable, "src/train.py", *long_run],
        cwd=checkout_dir(), env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (out / LOCK_FILE).is_file() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        second = train_through("palu-train", framework_command(tofu_mirror, tiny_model_dir, out, []))
        assert first.poll() is None  # the first run still trains
        output = second.stdout + second.stderr
        assert second.returncode == 1, output[-3000:]
        assert (
            f"palu-train: paths.output_dir={out} is in use by another run (process {first.pid} on" in output
        )
        assert "PALUTrainer Trainer loaded" not in output
    finally:
        first.kill()
        first.wait()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == first.pid  # killed: its lock stays
    again = train_through(
        "src/train.py", framework_command(tofu_mirror, tiny_model_dir, out, ["+trainer.args.max_steps=2"])
    )
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    assert f"took over {out / LOCK_FILE} from a run that is gone (process {first.pid} on" in output
    assert (out / "model.safetensors").is_file() and not (out / LOCK_FILE).exists()


def planted_checkpoint(out, step: int = 2) -> Path:
    """A resumable-looking checkpoint of an earlier run in `out`."""
    import torch

    checkpoint = out / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": 1.0}))
    torch.save({"state": {}, "param_groups": []}, checkpoint / "optimizer.pt")
    return checkpoint


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.slow
@pytest.mark.parametrize("entry_point", ["src/train.py", "palu-train"])
def test_the_fifth_sweeps_refusals_through_both_entry_points(
    tmp_path, tiny_model_dir, tofu_mirror, entry_point
):
    """Each stops before loading, in one line: an offline hub id and a mistyped path (palu-train before it
    imports torch, transformers or the framework); a new run beside an earlier run's checkpoints; a resume
    from a checkpoint holding a pickle payload (never loaded); a resume from a checkpoint that started from
    another model."""
    import torch

    out = tmp_path / "run"
    prefix = f"{program(entry_point)}: "
    for model, said in (
        (
            "nobody/no-such-model",
            "is not a local folder, not in the Hugging Face cache, and the hub cannot be reached",
        ),
        ("saves/unlearn/typo", "no such folder (a hub id is owner/name)"),
    ):
        arguments = framework_command(tofu_mirror, model, out, [])
        # palu-train lists its imports (src/train.py imports the framework before any code of the plugin runs)
        imports = {"PYTHONPROFILEIMPORTTIME": "1"} if entry_point == "palu-train" else {}
        result = train_through(entry_point, arguments, HF_HUB_OFFLINE="1", **imports)
        lines = (result.stdout + result.stderr).splitlines()
        imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
        said_lines = [line for line in lines if line.startswith(prefix)]
        assert result.returncode == 1 and len(said_lines) == 1, lines[-40:]
        assert said_lines[0].startswith(f"{prefix}model.model_args.pretrained_model_name_or_path={model}")
        assert said in said_lines[0] and not any("Traceback" in line for line in lines)
        if entry_point == "palu-train":
            assert [line for line in lines if not line.startswith("import time:")] == said_lines, lines
            assert not {"torch", "transformers", "trainer", "data"} & imported

    checkpoint = planted_checkpoint(out)
    output = stopped(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, []))
    assert (
        f"{prefix}paths.output_dir={out} holds an earlier run's checkpoints (checkpoint-2) and no final model"
        in output
    )

    resume = ["+trainer.args.resume_from_checkpoint=true"]
    marker = tmp_path / "payload-ran"
    torch.save({"state": {}, "param_groups": [Payload(marker)]}, checkpoint / "optimizer.pt")
    output = stopped(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, resume))
    assert "optimizer.pt names posix.system, which no checkpoint of a run needs" in output, output[-3000:]
    assert not marker.exists() and "Traceback" not in output

    torch.save({"state": {}, "param_groups": []}, checkpoint / "optimizer.pt")
    (checkpoint / RUN_OPTIONS_FILE).write_text(
        json.dumps({"model": "/elsewhere/other-model", "model weights": "0" * 40, "trainer": "PALUTrainer"})
    )
    output = stopped(entry_point, framework_command(tofu_mirror, tiny_model_dir, out, resume))
    assert f"resume_from_checkpoint={checkpoint} started from another model, /elsewhere/other-model" in output
    assert f"than this run's {tiny_model_dir} (weights sha1 " in output


@pytest.mark.slow
@pytest.mark.parametrize("entry_point", ["src/train.py", "palu-train"])
def test_a_crash_in_training_ends_in_one_line_and_marks_the_folder_failed(
    tmp_path, tiny_model_dir, tofu_mirror, entry_point
):
    """The datasets cache on a read-only filesystem: the run stops in one line naming the file and the fix,
    marks its folder failed (palu-eval refuses it) and leaves no lock."""
    cache = tmp_path / "read-only"
    cache.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(cache)], capture_output=True, text=True
    )
    if mounted.returncode:
        unavailable(f"a read-only filesystem needs `mount -t tmpfs` (root): {mounted.stderr.strip()}")
    try:
        out = tmp_path / "run"
        arguments = framework_command(tofu_mirror, tiny_model_dir, out, [])
        result = train_through(entry_point, arguments, HF_DATASETS_CACHE=str(cache))
    finally:
        subprocess.run(["umount", str(cache)], check=True)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert re.search(
        rf"{program(entry_point)}: {cache}\S* cannot be used: Read-only file system\. Give this user access",
        output,
    ), output[-3000:]
    assert "Traceback" not in output
    assert json.loads((out / FAILED_RUN_FILE).read_text())["reason"] == "crashed"
    assert not (out / LOCK_FILE).exists()


def test_a_users_own_experiment_yaml_without_the_plugins_callback_gets_the_one_line_messages(
    tmp_path, tiny_model_dir, tofu_mirror
):
    """The plugin's experiment copied as users write their own, without its `hydra.callbacks` block: no
    config check runs, and the trainer's own checks stop a typo in a PALU option and a retain split that
    holds the forget rows with the same one line, before training."""
    from palu_trainer.framework.checkout import CONFIG_DIR

    own = tmp_path / "configs" / "experiment" / "unlearn" / "tofu" / "my_palu.yaml"
    own.parent.mkdir(parents=True)
    own.write_text(
        (CONFIG_DIR / "experiment" / "unlearn" / "tofu" / "palu.yaml").read_text().split("\nhydra:")[0]
    )
    run = [f"--config-dir={tmp_path / 'configs'}"] + [
        "experiment=unlearn/tofu/my_palu" if arg == "experiment=unlearn/tofu/palu" else arg
        for arg in QUICK_RUN
    ]
    typo = framework_command(
        tofu_mirror, tiny_model_dir, tmp_path / "a", ["+trainer.method_args.kl_wieght=2"], run=run
    )
    output = stopped("src/train.py", typo)
    assert (
        "train.py: trainer.method_args.kl_wieght is not an option of PALUTrainer: did you mean kl_weight?"
        in output
    )
    assert "Traceback" not in output and "TypeError" not in output
    overlap = framework_command(tofu_mirror, tiny_model_dir, tmp_path / "b", ["retain_split=full"], run=run)
    output = stopped("src/train.py", overlap)
    assert re.search(r"train\.py: the data share \d+ of the \d+ forget rows", output), output[-3000:]
    assert "Traceback" not in output


@pytest.fixture(scope="module")
def wide_vocabulary_model_dir(tmp_path_factory, tofu_rows) -> Path:
    """A tiny model (hidden size 8) with Gemma-3's |V| (262,144, a tokenizer padded with unused tokens): a
    batch of forget05's 200 rows needs logits of several GB, more than the 4 GiB of address space its run
    is given (a tiny run needs under 3)."""
    from palu_lab.tiny import make_tiny_model, train_bpe_tokenizer

    directory = tmp_path_factory.mktemp("wide-vocabulary")
    texts = (row["question"] + "\n" + row["answer"] for row in tofu_rows)
    tokenizer = train_bpe_tokenizer(texts, padded_vocab_size=262_144)
    make_tiny_model(tokenizer, hidden_size=8, num_heads=2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("entry_point", ["src/train.py", "palu-train"])
def test_memory_exhaustion_ends_in_one_line_naming_the_settings_that_lower_memory(
    tmp_path, wide_vocabulary_model_dir, tofu_mirror, entry_point
):
    """The allocator's refusal in the first step: one line with the settings that lower memory, the folder
    marked failed (palu-eval refuses it) and unlocked."""
    replaced = ("forget_split", "retain_split", "holdout_split", "span_annotations", "trainer.args.per_")
    run = [arg for arg in QUICK_RUN if not arg.startswith(replaced)]
    out = tmp_path / "run"
    whole_batch = [
        *("forget_split=forget05", "retain_split=retain95", "holdout_split=holdout05"),
        f"span_annotations={SPANS / 'tofu_forget05.jsonl'}",
        "trainer.args.per_device_train_batch_size=200",
        "trainer.method_args.reference_cache=false",
    ]
    arguments = framework_command(tofu_mirror, wide_vocabulary_model_dir, out, whole_batch, run=run)
    output = stopped(entry_point, arguments, address_space=4 * 2**30)
    assert re.search(
        rf"{program(entry_point)}: the run ran out of memory \(.*can't allocate memory.*\): lower "
        r"trainer\.args\.per_device_train_batch_size",
        output,
    ), output[-3000:]
    assert "Traceback" not in output
    assert json.loads((out / FAILED_RUN_FILE).read_text())["reason"] == "crashed"
    assert not (out / LOCK_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize("entry_point", ["src/train.py", "palu-train"])
def test_extreme_span_files_stop_in_one_bounded_line(tmp_path, tiny_model_dir, tofu_mirror, entry_point):
    """A 50 MB span value and JSON nested past the recursion limit: each stops before loading in one line
    that names the file and row, with an excerpt of the value rather than all of it."""
    first, *rest = (SPANS / "tofu_forget01.jsonl").read_text().splitlines(keepends=True)
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({**json.loads(first), "spans": "x" * 50_000_000}) + "\n" + "".join(rest))
    deep = tmp_path / "deep.jsonl"
    nested = json.dumps({**json.loads(first), "spans": []}).replace("[]", "[" * 100_000 + "]" * 100_000)
    deep.write_text(nested + "\n" + "".join(rest))
    run = [arg for arg in QUICK_RUN if not arg.startswith("span_annotations=")]
    for spans, said in ((huge, "(50,000,002 characters)"), (deep, "line 1: JSON nested too deeply")):
        arguments = framework_command(
            tofu_mirror, tiny_model_dir, tmp_path / spans.stem, [f"span_annotations={spans}"], run=run
        )
        output = stopped(entry_point, arguments)
        lines = [line for line in output.splitlines() if line.startswith(f"{program(entry_point)}: ")]
        assert len(lines) == 1 and str(spans) in lines[0] and said in lines[0], output[-3000:]
        assert len(output) < 20_000 and "Traceback" not in output


@pytest.mark.slow
def test_train_py_started_in_another_checkout_imports_its_own_and_says_so(
    tmp_path, tiny_model_dir, tofu_mirror
):
    """The framework's src/train.py run from a folder that holds another checkout: the plugin's code
    imports the running script's checkout, and the log names it."""
    decoy = decoy_checkout(tmp_path / "decoy")
    env = {key: value for key, value in environment().items() if key != "OPEN_UNLEARNING_DIR"}
    result = subprocess.run(
        [sys.executable, str(checkout_dir() / "src" / "train.py"),
         *framework_command(tofu_mirror, tiny_model_dir, tmp_path / "run", [])],
        cwd=decoy, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert f"open-unlearning imported from {checkout_dir()} (the running framework script's)" in output
    assert "decoy" not in output
