"""The training loops of transformers 4.45 and 4.51 made to step at the end of each epoch's accumulation
windows with the mean of the window's losses (`trainers.accumulation`). Both read
`gradient_accumulation_steps` inside `Trainer._inner_training_loop` to decide whether a micro-batch ends a
step:
- 4.45 counts an epoch's steps as `len(loader) // gradient_accumulation_steps` and steps when its count of
  micro-batches since the run began is a multiple of `gradient_accumulation_steps`;
- 4.51 steps when its count of the epoch's micro-batches is, or at the epoch's length, but a resumed run
  counts from the first micro-batch after the ones it skips, so an epoch's partial window never steps.
Both divide each micro-batch's loss by `gradient_accumulation_steps`, a partial window's too."""

import contextlib
import functools
import sys

from transformers import TrainerCallback


class WindowEnds(TrainerCallback):
    """Puts back `gradient_accumulation_steps` after the loop's step decision (`stepping_at_window_end`,
    `ending_partial_window`) and sets the epoch to the share of the epoch's micro-batches trained; first among
    the callbacks, so that the others see the run's own value."""

    def __init__(self, trainer, decides_after_each_micro_batch: bool):
        self.trainer = trainer
        self.decides_after_each_micro_batch = decides_after_each_micro_batch

    def on_substep_end(self, args, state, control, **kwargs):
        if self.decides_after_each_micro_batch:
            args.gradient_accumulation_steps = self.trainer.epoch_windows.accumulation

    def on_step_end(self, args, state, control, **kwargs):
        windows = self.trainer.epoch_windows
        args.gradient_accumulation_steps = windows.accumulation
        epoch, window = divmod(state.global_step - 1, windows.steps)
        trained = min((window + 1) * windows.accumulation, windows.micro_batches)
        state.epoch = epoch + trained / windows.micro_batches


def restoring_accumulation_steps(trainer, decides_after_each_micro_batch: bool) -> None:
    """`WindowEnds` first among `trainer`'s callbacks (once)."""
    callbacks = trainer.callback_handler.callbacks
    if not any(isinstance(callback, WindowEnds) for callback in callbacks):
        callbacks.insert(0, WindowEnds(trainer, decides_after_each_micro_batch))


def counting_whole_windows(trainer, loader):
    """`loader`, whose length counts its epoch's last, partial window as a whole one (4.45): the run's
    steps, and the epoch and step that a resumed run starts from, come out as one step per window.
    accelerate's own count of micro-batches, which decides DDP's gradient sync and whether the optimizer
    steps at all, ends its windows with the epoch too (4.45 lets it run across epochs)."""
    trainer.accelerator.gradient_state.plugin_kwargs["sync_with_dataloader"] = True
    windows = trainer.epoch_windows
    counted = windows.steps * windows.accumulation
    loader_class = type(loader)
    counting = type(loader_class.__name__, (loader_class,), {"__len__": lambda self: counted})
    object.__dict__["__class__"].__set__(loader, counting)  # accelerate's loaders read `__class__` only
    return loader


def ending_partial_window(trainer, micro_batches_before: int, window: int) -> None:
    """Make 4.51's step decisions in an epoch's partial window of `window` micro-batches, after
    `micro_batches_before` of the epoch (counted as its loop counts them), come out true at its last one
    only: `(count % gradient_accumulation_steps == 0)`; `WindowEnds` puts the value back after the step."""
    trainer.args.gradient_accumulation_steps = micro_batches_before + window


def stepping_at_window_end(trainer, window_ends: bool) -> None:
    """Make the loop's next step decision (`count % gradient_accumulation_steps == 0`, count >= 1) come
    out as `window_ends`; `WindowEnds` puts the value back right after."""
    trainer.args.gradient_accumulation_steps = 1 if window_ends else sys.maxsize


@contextlib.contextmanager
def scaling_the_loss(trainer, factor: float):
    """`trainer.compute_loss` multiplies its loss by `factor` inside the block: a partial window's
    micro-batches weigh 1 / its size where the loop divides them by `gradient_accumulation_steps`."""
    compute_loss = type(trainer).compute_loss.__get__(trainer)

    @functools.wraps(compute_loss)
    def compute_scaled_loss(*args, **kwargs):
        return compute_loss(*args, **kwargs) * factor

    trainer.compute_loss = compute_scaled_loss
    try:
        yield
    finally:
        del trainer.compute_loss
