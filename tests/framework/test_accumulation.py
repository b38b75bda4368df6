"""One accumulation semantics on every tested stack (docs/method.md, "Gradient accumulation"): an epoch's
micro-batches in windows of `gradient_accumulation_steps`, the last one partial, each window one step whose
loss is the mean over the micro-batches it holds."""

import pytest
import transformers

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.trainers.accumulation import (
    EpochWindowAccumulation,
    EpochWindows,
    loop_sums_accumulated_losses,
)
from palu_trainer.framework.trainers.guarded import GuardedTrainer
from palu_trainer.framework.trainers.palu import PALUTrainer

ensure_importable()
from data.collators import DataCollatorForSupervisedDataset  # noqa: E402
from trainer.unlearn.npo import NPO  # noqa: E402

pytestmark = pytest.mark.stack


def test_an_epochs_windows_are_whole_but_the_last():
    windows = EpochWindows(micro_batches=10, accumulation=4)
    assert windows.steps == 3
    assert [windows.size(step) for step in range(7)] == [4, 4, 2, 4, 4, 2, 4]
    assert EpochWindows(micro_batches=3, accumulation=8).steps == 1
    assert EpochWindows(micro_batches=8, accumulation=4).size(1) == 4


def step_losses(make_trainer, trainer_class, accumulation: int, **method_args) -> list[tuple[float, float]]:
    """(epoch, loss) of each logged step of 2 epochs of 3 micro-batches of one row, at a learning rate too
    small to move the loss, so that a window's loss can be compared with its micro-batches' own."""
    trainer = make_trainer(
        trainer_class=trainer_class,
        max_steps=-1,
        gradient_accumulation_steps=accumulation,
        training_arguments={"num_train_epochs": 2, "per_device_train_batch_size": 1, "learning_rate": 1e-12},
        **method_args,
    )
    trainer.train()
    return [(entry["epoch"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("method", ["PALU", "NPO"])
def test_each_step_is_the_mean_of_its_windows_micro_batches_and_windows_end_with_the_epoch(
    make_trainer, method
):
    """3 micro-batches an epoch at accumulation 2: the windows (1, 2) and (3) of each epoch, 4 steps in 2
    epochs. transformers 4.45 alone would run the second window across the epoch's end (3 steps); 4.51
    alone would stop after the first epoch and halve the partial window's loss."""
    trainer_class, method_args = (
        (PALUTrainer, {"top_k": 64, "reference_cache": False})
        if method == "PALU"
        else (
            type("NPO", (GuardedTrainer, NPO), {}),
            {"collator": lambda tokenizer, index: DataCollatorForSupervisedDataset(tokenizer)},
        )
    )
    micro_batches = step_losses(make_trainer, trainer_class, 1, **method_args)
    windows = step_losses(make_trainer, trainer_class, 2, **method_args)
    assert len(micro_batches) == 6
    losses = [loss for _, loss in micro_batches]
    means = [(losses[0] + losses[1]) / 2, losses[2], (losses[3] + losses[4]) / 2, losses[5]]
    assert [epoch for epoch, _ in windows] == pytest.approx([2 / 3, 1, 5 / 3, 2])
    assert [loss for _, loss in windows] == pytest.approx(means, rel=1e-3, abs=1e-3)


def test_a_stock_trainer_that_sums_says_so_in_one_line_and_the_plugins_runs_average(make_trainer, caplog):
    """The framework's own stock experiment keeps the framework's behaviour, with one line where this
    transformers sums (4.51); palu-train and the plugin's experiments build the guarded trainer."""
    from palu_trainer.framework.patches import guarding_stock_trainers, noting_summed_accumulation

    registry = {"NPO": NPO}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("trainer.TRAINER_REGISTRY", registry)
        noting_summed_accumulation()
        noted = registry["NPO"]
        collator = {"collator": lambda tokenizer, index: DataCollatorForSupervisedDataset(tokenizer)}
        with caplog.at_level("WARNING"):
            make_trainer(trainer_class=noted, gradient_accumulation_steps=2, **collator)
        guarding_stock_trainers()
    lines = [r.getMessage() for r in caplog.records if "sums its loss" in r.getMessage()]
    assert lines == (["NPO sums its loss over each window of gradient_accumulation_steps=2 micro-batches on "
                      f"transformers {transformers.__version__} instead of averaging it; palu-train and "
                      "palu-trainer's experiments (experiment=unlearn/tofu/npo, simnpo, graddiff) average it"]
                     if loop_sums_accumulated_losses() else [])  # fmt: skip
    assert (noted is NPO) != loop_sums_accumulated_losses()
    guarded = registry["NPO"].__mro__
    assert guarded[1:4] == (
        GuardedTrainer,
        EpochWindowAccumulation,
        NPO,
    )  # the stock class, not the noting one


def test_a_run_resumed_mid_epoch_steps_on_as_the_uninterrupted_run(make_trainer, tmp_path):
    """Resumed from the checkpoint of step 3 (the first window of epoch 2), the run makes step 4 of the
    partial window only, on the micro-batch that the run that never stopped ends with: the same forget row
    (its token roles) and the same model (its KL term). The retain row is drawn at random, and the
    uninterrupted run's loader drew it before the checkpoint was saved, so the retain loss may differ."""
    from palu_trainer.framework.patches import allowing_checkpoint_globals

    arguments = {
        "num_train_epochs": 2,
        "per_device_train_batch_size": 1,
        "save_strategy": "steps",
        "save_steps": 1,
    }
    arguments |= {"save_only_model": False}
    method = {"top_k": 64, "reference_cache": False, "max_steps": -1, "gradient_accumulation_steps": 2}
    uninterrupted = make_trainer(training_arguments=arguments, **method)
    uninterrupted.train()
    allowing_checkpoint_globals()  # what palu-train and the framework's scripts allow to resume
    resumed = make_trainer(training_arguments=arguments | {"output_dir": str(tmp_path / "resumed")}, **method)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    (last,) = [entry for entry in resumed.state.log_history if "loss" in entry and entry["step"] > 3]
    expected = [entry for entry in uninterrupted.state.log_history if "loss" in entry][-1]
    assert (last["step"], last["epoch"]) == (expected["step"], expected["epoch"]) == (4, 2.0)
    roles = ("n_initiating", "n_common", "n_redundant")
    assert [last[key] for key in roles] == [expected[key] for key in roles]
    assert last["kl_loss"] == pytest.approx(expected["kl_loss"], rel=1e-3)
