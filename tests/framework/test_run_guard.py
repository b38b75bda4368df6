"""What palu-train checks on a built trainer before its first step (`run_plan`) and guards during the run
(`run_guard`): divergence, failed saves. In-process on the tiny model; end to end in test_run_faults.py."""

import json
import math
import shutil
import signal
from pathlib import Path

import pytest
import torch

from palu_trainer.training.run_folder import FAILED_RUN_FILE, failed_run_problem
from palu_trainer.training.run_guard import RunGuard, RunStopped
from palu_trainer.training.run_plan import (
    disk_estimate,
    disk_space_problem,
    empty_epoch_problem,
    learning_rates,
    optimizer_steps,
    zero_learning_rate_problem,
)


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """RunGuard installs its SIGTERM and SIGINT handlers in this (pytest's) process: put pytest's back."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def guarded(trainer):
    """PALU's trainer guards itself (so does TPO's): its own methods call the guard, one callback of its
    own; no wrapper replaces a method on the instance."""
    assert isinstance(trainer.run_guard, RunGuard)
    guards = [callback for callback in trainer.callback_handler.callbacks if isinstance(callback, RunGuard)]
    assert guards == [trainer.run_guard]
    assert not {"training_step", "save_model", "_save_checkpoint", "train"} & set(vars(trainer))
    return trainer


def nan_at_step(trainer, step: int, term: str):
    """Make PALU's `term` (local | kl | retain) non-finite from optimizer step `step` on."""
    from palu_trainer.method.objective import PALUObjective

    losses = {"local": "forget_terms", "retain": "retain_nll"}
    original = getattr(PALUObjective, losses[term])

    def poisoned(*args, **kwargs):
        result = original(*args, **kwargs)
        if trainer.state.global_step + 1 < step:
            return result
        if term == "local":
            local, kl = result
            return local * math.nan, kl
        return result * math.nan

    return losses[term], poisoned


def test_a_nan_term_stops_the_run_at_its_step_naming_the_term(make_trainer, monkeypatch):
    trainer = guarded(make_trainer(max_steps=5, top_k=64))
    name, poisoned = nan_at_step(trainer, 3, "local")
    monkeypatch.setattr(f"palu_trainer.method.objective.PALUObjective.{name}", poisoned)
    with pytest.raises(RunStopped) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert trainer.state.global_step == 3
    assert (
        "training diverged at step 3: the loss is nan (local non-finite) at step 3; terms: local=nan"
        in message
    )
    assert "lower trainer.args.learning_rate (now 0.01)" in message
    record = json.loads((Path(trainer.args.output_dir) / FAILED_RUN_FILE).read_text())
    assert record["reason"] == "diverged" and record["step"] == 3
    assert not list(Path(trainer.args.output_dir).glob("model*.safetensors"))
    assert "is a failed run's folder" in failed_run_problem("model.model_args.x", trainer.args.output_dir)


def test_a_nan_gradient_with_a_finite_loss_stops_the_run(make_trainer):
    trainer = guarded(make_trainer(max_steps=4, top_k=64))
    weight = trainer.model.get_input_embeddings().weight
    weight.register_hook(lambda grad: grad * math.inf if trainer.state.global_step == 1 else grad)
    with pytest.raises(RunStopped, match=r"diverged at step 2: the gradient norm is nan \(every micro-batch"):
        trainer.train()


def test_non_finite_weights_are_never_saved(make_trainer, tmp_path):
    trainer = guarded(make_trainer(max_steps=1, top_k=64, training_arguments={"max_grad_norm": 0}))
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = math.inf
    with pytest.raises(
        RunStopped, match=r"diverged at step 0 before saving: 1 weight tensor\(s\) hold nan or inf"
    ):
        trainer.save_model(str(tmp_path / "final"))
    assert not (tmp_path / "final").exists()
    assert "clip gradients (trainer.args.max_grad_norm=1.0; clipping is off)" in str(
        json.loads((Path(trainer.args.output_dir) / FAILED_RUN_FILE).read_text())["next"]
    )


def test_a_failed_final_save_leaves_no_finished_looking_folder(make_trainer, tmp_path, monkeypatch):
    trainer = guarded(make_trainer(max_steps=1, top_k=64))
    folder = tmp_path / "final"

    def fill_the_disk(*args, **kwargs):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(trainer, "_save", fill_the_disk)
    with pytest.raises(
        RunStopped, match="saving the final model to .* failed after training: .*No space left"
    ):
        trainer.save_model(str(folder))
    assert sorted(path.name for path in folder.iterdir()) == []
    assert (
        json.loads((Path(trainer.args.output_dir) / FAILED_RUN_FILE).read_text())["reason"]
        == "final save failed"
    )


def test_optimizer_steps_and_learning_rates_match_the_trainers_run(make_trainer):
    trainer = make_trainer(
        max_steps=-1,
        top_k=64,
        training_arguments={"num_train_epochs": 2, "per_device_train_batch_size": 1, "warmup_ratio": 0.5},
    )
    rates = learning_rates(trainer, optimizer_steps(trainer))
    trainer.train()
    assert trainer.state.global_step == optimizer_steps(trainer) == 6  # 3 forget rows, 2 epochs
    logged = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    # transformers 4.51 logs the rate each step used; 4.45 the rate after the scheduler's step
    assert rates[0] == 0 and logged in (pytest.approx(rates), pytest.approx(rates[1:] + [0.0]))


def test_one_step_under_warm_up_and_an_empty_epoch_are_refused(make_trainer):
    warm = make_trainer(max_steps=1, top_k=64, training_arguments={"warmup_ratio": 0.1})
    assert (
        "every one of the run's 1 optimizer step(s) has learning rate 0 (lr_scheduler_type=linear, 1 warm-up"
        in zero_learning_rate_problem(warm)
    )
    assert (
        zero_learning_rate_problem(
            make_trainer(max_steps=2, top_k=64, training_arguments={"warmup_ratio": 0.1})
        )
        is None
    )
    dropped = make_trainer(
        top_k=64, training_arguments={"dataloader_drop_last": True, "per_device_train_batch_size": 4}
    )
    assert "the training set has 3 rows and trainer.args.dataloader_drop_last=true" in empty_epoch_problem(
        dropped
    )
    assert empty_epoch_problem(make_trainer(top_k=64)) is None


def test_the_disk_estimate_matches_what_the_run_writes(make_trainer, monkeypatch):
    trainer = make_trainer(
        max_steps=3,
        top_k=64,
        training_arguments={"save_strategy": "steps", "save_steps": 1, "save_total_limit": 1},
    )
    estimate = disk_estimate(trainer)
    assert estimate["checkpoints"] == 2  # a new checkpoint is written before the old one is rotated out
    trainer.train()
    trainer.save_model()
    output = Path(trainer.args.output_dir)
    model_bytes = (output / "model.safetensors").stat().st_size
    checkpoint_bytes = sum(
        path.stat().st_size for path in (output / "checkpoint-3").rglob("*") if path.is_file()
    )
    assert estimate["model"] == pytest.approx(model_bytes, rel=0.01)
    assert estimate["checkpoint"] == pytest.approx(checkpoint_bytes, rel=0.05)

    shutil.rmtree(output / "checkpoint-3")  # a new run's estimate: no checkpoint on disk yet
    free = {"free": estimate["total"] - 1}
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("usage", (), free))
    problem = disk_space_problem(trainer)
    assert "but the run writes about" in problem and "2 checkpoint(s) of" in problem
    free["free"] = estimate["total"]
    assert disk_space_problem(trainer) is None


@pytest.mark.parametrize("role", ["starting model", "reference model"])
def test_non_finite_starting_weights_stop_before_the_first_step_naming_the_tensors(make_trainer, role):
    trainer = guarded(make_trainer(max_steps=2, top_k=64, reference_cache=False))
    model = trainer.model if role == "starting model" else trainer.ref_model
    with torch.no_grad():
        for _, parameter in list(model.named_parameters())[3:5]:
            parameter.view(-1)[0] = math.nan
    first = [name for name, _ in model.named_parameters()][3]
    with pytest.raises(RunStopped) as stopped:
        trainer.train()
    assert stopped.value.exit_code == 1 and trainer.state.global_step == 0
    assert f"the {role} (" in str(stopped.value)
    assert (
        f"holds non-finite weights before the first step: 2 tensor(s) with nan or inf, the first {first}"
        in str(stopped.value)
    )
    assert not (Path(trainer.args.output_dir) / FAILED_RUN_FILE).exists()  # nothing ran: nothing failed


def test_a_second_ctrl_c_stops_at_once(make_trainer):
    guard = guarded(make_trainer(max_steps=1, top_k=64)).run_guard
    guard._on_preemption(signal.SIGINT, None)
    assert guard.preempted_by == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        guard._on_preemption(signal.SIGINT, None)


def test_a_crash_in_training_is_told_in_one_line_and_a_later_sigterm_exits_as_python_sees(
    make_trainer, monkeypatch, capsys
):
    """A rank whose peer died raises from a collective; its launcher SIGTERMs it at about that time. The
    guard prints the one line and marks the folder while no signal can end the process; after that SIGTERM
    is an exit Python sees (atexit unlocks the folder and frees the shared memory), no longer a checkpoint."""
    from palu_trainer.training import run_guard

    trainer = guarded(make_trainer(max_steps=2, top_k=64))

    def peer_gone(*args, **kwargs):
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")

    def launcher_stops_this_rank_meanwhile(output_dir, error):
        signal.raise_signal(signal.SIGTERM)
        return mark_crashed(output_dir, error)

    mark_crashed = run_guard.mark_crashed
    monkeypatch.setattr(run_guard, "mark_crashed", launcher_stops_this_rank_meanwhile)
    with pytest.raises(RunStopped) as stopped:
        trainer.run_guard.train(peer_gone)
    assert stopped.value.exit_code == 1 and trainer.run_guard.preempted_by is None
    assert "another process of this run stopped ([gloo] Connection closed by peer" in str(stopped.value)
    assert "another process of this run stopped" in capsys.readouterr().err
    record = json.loads((Path(trainer.args.output_dir) / FAILED_RUN_FILE).read_text())
    assert record["reason"] == "crashed"
    with pytest.raises(SystemExit) as exited:
        signal.raise_signal(signal.SIGTERM)
    assert exited.value.code == 128 + signal.SIGTERM


@pytest.mark.parametrize(
    "folder",
    ["/runs/plain-name_1.0/checkpoint-4", "/runs/a b/checkpoint-4", "/runs/x=y,z[1]/c", "/runs/it's $HOME/c"],
)
def test_the_printed_resume_override_reads_back_as_the_checkpoint_through_the_shell_and_hydra(folder):
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from palu_trainer.training.run_guard import hydra_quoted

    typed = shlex.join(["palu-train", f"+trainer.args.resume_from_checkpoint={hydra_quoted(folder)}"])
    (override,) = OverridesParser.create().parse_overrides(shlex.split(typed)[1:])
    assert override.value() == folder


def test_checkpoints_already_in_the_folder_are_not_counted_again_when_resuming(make_trainer):
    """After a full disk was cleared, the resumed run needs room for what it has yet to write, not a whole
    run's: the checkpoints on disk already hold theirs."""
    from palu_trainer.training.run_plan import SAVE_MARGIN

    trainer = make_trainer(
        max_steps=3,
        top_k=64,
        training_arguments={"save_strategy": "steps", "save_steps": 1, "save_total_limit": 1},
    )
    fresh = disk_estimate(trainer)
    for step in (1, 2):
        (Path(trainer.args.output_dir) / f"checkpoint-{step}").mkdir(parents=True)
    resumed = disk_estimate(trainer)
    assert fresh["checkpoints"] == resumed["checkpoints"] == 2
    assert fresh["total"] == int(SAVE_MARGIN * (fresh["model"] + 2 * fresh["checkpoint"]))
    assert resumed["total"] == int(SAVE_MARGIN * resumed["model"])
