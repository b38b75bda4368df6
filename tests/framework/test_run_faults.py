"""palu-train end to end under faults that only show during training: divergence, a full disk and
preemption (SIGTERM). Each run stops non-zero, leaves no folder that looks finished, and says what next."""

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from palu_trainer.training.run_folder import FAILED_RUN_FILE
from palu_trainer.training.run_guard import hydra_quoted
from palu_trainer.training.run_lock import LOCK_FILE

from ..conftest import unavailable
from .test_bad_inputs import BIN, QUICK_RUN, run

STOCK_RUN = [
    arg.replace("experiment=unlearn/tofu/palu", "experiment=unlearn/tofu/default")
    for arg in QUICK_RUN
    if not arg.startswith("span_annotations=")
]
FINISHED_LOOKING = ("config.json", "model.safetensors")


def steps_logged(output: str) -> int:
    return len(re.findall(r"\{'loss': ", output))


def preempted_after(steps: int, argv, preemption, env, cwd=None) -> tuple[int, str]:
    """Run `argv`, send `preemption` once it has logged `steps` steps; its exit code and whole output."""
    process = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output, deadline = "", time.monotonic() + 600
    while steps_logged(output) < steps and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        output += line
    process.send_signal(preemption)
    rest, _ = process.communicate(timeout=120)
    return process.returncode, output + rest


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("method", ["PALU", "NPO"])
def test_a_diverged_run_stops_at_its_step_and_palu_eval_refuses_the_folder(
    method, tmp_path, tiny_model_dir, tofu_mirror
):
    command = QUICK_RUN if method == "PALU" else [*STOCK_RUN, f"trainer={method}"]
    out = tmp_path / "run"
    code, output = run(
        command,
        ["trainer.args.learning_rate=1e6", "trainer.args.logging_steps=1"],
        tofu_mirror,
        tiny_model_dir,
        out,
    )
    assert code == 1, output[-3000:]
    step = int(re.search(r"palu-train: training diverged at step (\d+)", output).group(1))
    assert steps_logged(output) < step  # stopped at that step: it never logged it
    assert "lower trainer.args.learning_rate (now 1e+06)" in output
    assert (out / FAILED_RUN_FILE).is_file()
    assert not any((out / name).exists() for name in FINISHED_LOOKING)

    evaluation = ["experiment=eval/tofu/default", "+runtime=cpu", "model=tiny-llama", "task_name=e"]
    code, output = run(evaluation, [], tofu_mirror, out, tmp_path / "eval", script="palu-eval")
    assert code == 1
    assert (
        f"pretrained_model_name_or_path={out} is a failed run's folder ({FAILED_RUN_FILE}: diverged at "
        f"step {step})" in output
    )


@pytest.fixture
def small_filesystem(tmp_path):
    """A 1.2 MB tmpfs (root only): smaller than the tiny model's final save (1.6 MB)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        unavailable(f"a small filesystem needs `mount -t tmpfs` (root): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.slow
@pytest.mark.stack
def test_a_full_disk_is_refused_before_the_first_step_and_a_failed_save_leaves_no_model(
    small_filesystem, tiny_model_dir, tofu_mirror
):
    out = small_filesystem / "run"
    code, output = run(QUICK_RUN, [], tofu_mirror, tiny_model_dir, out)
    assert code == 1, output[-3000:]
    assert re.search(
        r"palu-train: paths.output_dir=\S+: 1\.\d MiB free on its filesystem, but the run writes about "
        r"\d\.\d MiB there: the final model of",
        output,
    )
    assert steps_logged(output) == 0

    one_epoch = [
        "+allow_low_disk_space=true",
        "trainer.args.num_train_epochs=1",
        "trainer.args.logging_steps=1",
    ]
    code, output = run(QUICK_RUN, one_epoch, tofu_mirror, tiny_model_dir, out)
    assert code == 1, output[-3000:]
    assert steps_logged(output) == 10  # every step trained, then the save failed
    assert "palu-train: saving the final model to" in output and "No space left on device" in output
    assert not any((out / name).exists() for name in FINISHED_LOOKING)
    assert (out / FAILED_RUN_FILE).is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "preemption"),
    [
        pytest.param("PALU", signal.SIGTERM, marks=pytest.mark.stack),
        pytest.param("NPO", signal.SIGTERM, marks=pytest.mark.stack),  # NPO: model-only saves
        ("PALU", signal.SIGINT),  # SIGTERM's path once the guard's handler has it: on the default stack
    ],
)
def test_a_preemption_writes_a_resumable_checkpoint_and_the_printed_command_resumes_it(
    method, preemption, tmp_path, tiny_model_dir, tofu_mirror
):
    command = QUICK_RUN if method == "PALU" else [*STOCK_RUN, f"trainer={method}"]
    out = tmp_path / "run x=y,z"  # the printed command quotes it for Hydra and the shell
    overrides = ["+trainer.args.max_steps=60", "trainer.args.logging_steps=1"]
    models = [
        f"model.{args}.pretrained_model_name_or_path={tiny_model_dir}"
        for args in ("model_args", "tokenizer_args")
    ]
    env = {**os.environ, "TOFU_DIR": str(tofu_mirror), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    output_dir = f"paths.output_dir={hydra_quoted(str(out))}"
    argv = [str(BIN / "palu-train"), *command, output_dir, *models, *overrides]
    code, output = preempted_after(3, argv, preemption, env)
    assert code == 128 + preemption, output[-3000:]
    step = int(
        re.search(rf"palu-train: stopped by {preemption.name} after step (\d+) of 60", output).group(1)
    )
    assert "Traceback" not in output
    assert 3 <= step < 60
    checkpoint = out / f"checkpoint-{step}"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "trainer_state.json").is_file()
    assert not (out / "model.safetensors").exists()

    resume = shlex.split(output.split("Resume with:\n")[1].splitlines()[0])
    assert resume[0] == "palu-train"
    assert resume[-1] == f"+trainer.args.resume_from_checkpoint={hydra_quoted(str(checkpoint))}"
    resumed = subprocess.run(
        [str(BIN / "palu-train"), *resume[1:]], env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"resuming from {checkpoint}" in resumed.stdout + resumed.stderr
    assert steps_logged(resumed.stdout + resumed.stderr) == 60 - step
    assert (out / "model.safetensors").is_file() and not (out / FAILED_RUN_FILE).exists()


@pytest.mark.slow
@pytest.mark.stack
def test_a_new_run_into_a_killed_runs_folder_stops_and_starting_over_clears_its_checkpoints(
    tmp_path, tiny_model_dir, tofu_mirror
):
    """SIGKILL leaves the run's lock and checkpoints: the stale lock is no licence for a new run to train
    beside them (its rotation kept the dead run's checkpoint beside the new model); starting over on
    purpose deletes them, and the folder then holds only the new run's."""
    out = tmp_path / "run"
    saving = [
        "trainer.args.save_strategy=steps",
        "+trainer.args.save_steps=2",
        "trainer.args.save_only_model=false",
    ]
    models = [
        f"model.{args}.pretrained_model_name_or_path={tiny_model_dir}"
        for args in ("model_args", "tokenizer_args")
    ]
    env = {**os.environ, "TOFU_DIR": str(tofu_mirror), "OMP_NUM_THREADS": "1"}
    argv = [str(BIN / "palu-train"), *QUICK_RUN, f"paths.output_dir={out}", *models, *saving]
    killed = subprocess.Popen(
        [*argv, "+trainer.args.max_steps=60"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-2").is_dir() and time.monotonic() < deadline and killed.poll() is None:
        time.sleep(0.2)
    killed.kill()
    killed.wait()
    assert (out / "checkpoint-2").is_dir() and (out / LOCK_FILE).is_file()

    code, output = run(QUICK_RUN, saving, tofu_mirror, tiny_model_dir, out)
    assert code == 1, output[-3000:]
    assert f"palu-train: paths.output_dir={out} holds an earlier run's checkpoints (checkpoint-" in output
    assert (
        "+trainer.args.resume_from_checkpoint=true, or start over with +allow_overwriting_output_dir=true"
        in output
    )
    assert "Traceback" not in output

    code, output = run(
        QUICK_RUN,
        [*saving, "+trainer.args.max_steps=4", "+allow_overwriting_output_dir=true"],
        tofu_mirror,
        tiny_model_dir,
        out,
    )
    assert code == 0, output[-3000:]
    assert "removed an earlier run's checkpoints" in output
    kept = {
        path.name: json.loads((path / "trainer_state.json").read_text()) for path in out.glob("checkpoint-*")
    }
    assert sorted(kept) == ["checkpoint-2", "checkpoint-4"]
    assert all(state["max_steps"] == 4 for state in kept.values())  # the new run's, none of the killed one's
    assert (out / "model.safetensors").is_file() and not (out / LOCK_FILE).exists()


def decoy_checkout(decoy: Path) -> Path:
    """A folder that looks like an open-unlearning checkout, whose modules refuse to be imported."""
    for package in ("trainer", "data", "model"):
        (decoy / "src" / package).mkdir(parents=True)
        (decoy / "src" / package / "__init__.py").write_text("raise RuntimeError('the decoy was imported')\n")
    (decoy / "src" / "trainer" / "unlearn").mkdir()
    (decoy / "src" / "trainer" / "unlearn" / "base.py").write_text("")
    return decoy


@pytest.mark.slow
@pytest.mark.stack
def test_a_checkout_in_the_working_directory_does_not_override_the_chosen_one(
    tmp_path, tiny_model_dir, tofu_mirror
):
    """palu-train started in another open-unlearning checkout (its modules refuse to be imported) trains
    with the checkout `make setup` recorded, and logs which one it imported and why."""
    from palu_trainer.framework.checkout import CHECKOUT_RECORD, checkout_dir

    decoy = decoy_checkout(tmp_path / "decoy")
    env = {key: value for key, value in os.environ.items() if key != "OPEN_UNLEARNING_DIR"}
    models = [
        f"model.{args}.pretrained_model_name_or_path={tiny_model_dir}"
        for args in ("model_args", "tokenizer_args")
    ]
    result = subprocess.run(
        [str(BIN / "palu-train"), *QUICK_RUN, f"paths.output_dir={tmp_path / 'run'}", *models],
        cwd=decoy,
        env={**env, "TOFU_DIR": str(tofu_mirror), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert (
        f"open-unlearning imported from {checkout_dir()} (recorded by make setup in {CHECKOUT_RECORD})"
        in output
    )
    assert "decoy" not in output
