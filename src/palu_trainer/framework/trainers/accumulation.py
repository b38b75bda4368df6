"""One gradient-accumulation semantics for every method on every tested stack (docs/method.md,
"Gradient accumulation"): each epoch's micro-batches are cut into windows of `gradient_accumulation_steps`,
the last window holding the rest; each window is one optimizer step, whose loss is the mean over the
micro-batches the window holds. That is transformers 5's own training loop. Without the trainer below,
4.45 runs windows across epoch ends and 4.51 ends an epoch's partial window with its sum divided by the
full window's length; both count whole windows only, so an epochs-based run stops early."""

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass

import transformers
from accelerate.utils import DistributedType


@dataclass(frozen=True)
class EpochWindows:
    """The accumulation windows of one epoch on one rank.

    Args:
        micro_batches: the rank's micro-batches per epoch (its train dataloader's length).
        accumulation: `gradient_accumulation_steps`, the micro-batches of a full window.
    """

    micro_batches: int
    accumulation: int

    @property
    def steps(self) -> int:
        """Optimizer steps per epoch: one per window, the last one partial when the epoch ends mid-window."""
        return max(math.ceil(self.micro_batches / self.accumulation), 1)

    def size(self, global_step: int) -> int:
        """Micro-batches in the window that optimizer step `global_step` + 1 closes."""
        window = global_step % self.steps
        return max(min(self.accumulation, self.micro_batches - window * self.accumulation), 1)


def loop_windows_cross_epochs() -> bool:
    """Whether this transformers' training loop steps on the run's count of micro-batches rather than on
    windows of each epoch (4.45; 4.46 cut epochs into windows with `get_batch_samples`)."""
    return not hasattr(transformers.Trainer, "get_batch_samples")


@functools.cache
def loop_divides_by_window_size() -> bool:
    """Whether this transformers' `training_step` divides the loss by the micro-batches of the current
    window (5.x) rather than by `gradient_accumulation_steps`."""
    return "current_gradient_accumulation_steps" in inspect.getsource(transformers.Trainer.training_step)


def loop_sums_accumulated_losses() -> bool:
    """Whether this transformers' `training_step` leaves the loss undivided by the accumulation steps for a
    model whose forward takes `**kwargs` (4.46 to 4.x: `model_accepts_loss_kwargs`)."""
    return not loop_windows_cross_epochs() and not loop_divides_by_window_size()


class EpochWindowAccumulation:
    """A Trainer that accumulates gradients in windows of each epoch, whichever transformers runs it; listed
    before the Trainer's class among the bases."""

    epoch_windows: EpochWindows | None = None  # set with the train dataloader

    def get_train_dataloader(self):
        from palu_trainer.framework.patches.windows import (
            counting_whole_windows,
            restoring_accumulation_steps,
        )

        loader = super().get_train_dataloader()
        self.epoch_windows = EpochWindows(len(loader), self.args.gradient_accumulation_steps)
        self.micro_batches_in_window = 0
        if not loop_divides_by_window_size():
            restoring_accumulation_steps(self, decides_after_each_micro_batch=loop_windows_cross_epochs())
        if loop_windows_cross_epochs():
            loader = counting_whole_windows(self, loader)
        return loader

    def set_initial_training_values(self, args, dataloader, *more):
        """4.51 counts whole windows per epoch; one more step for an epoch's partial window."""
        values = list(super().set_initial_training_values(args, dataloader, *more))
        if not dataloader or not len(dataloader):
            return tuple(values)
        steps_per_epoch = EpochWindows(len(dataloader), args.gradient_accumulation_steps).steps
        values[1] = steps_per_epoch
        if args.max_steps > 0:
            values[0] = math.ceil(args.max_steps / steps_per_epoch)
        else:
            values[-1] = math.ceil(args.num_train_epochs * steps_per_epoch)
        return tuple(values)

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        """A window of up to `gradient_accumulation_steps` micro-batches: 4.51 asks for the rows of the
        dataset modulo the accumulation steps in an epoch's last window, which can leave micro-batches out,
        and a resumed run's partial window would not step."""
        from palu_trainer.framework.patches.windows import ending_partial_window

        if loop_divides_by_window_size():
            return super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        if epoch_iterator is not getattr(self, "windows_iterator", None):
            self.windows_iterator, self.epoch_micro_batches = epoch_iterator, 0
        accumulation = self.args.gradient_accumulation_steps
        batch_samples, *rest = super().get_batch_samples(epoch_iterator, accumulation, *args, **kwargs)
        if 0 < len(batch_samples) < accumulation:
            ending_partial_window(self, self.epoch_micro_batches, len(batch_samples))
        self.epoch_micro_batches += len(batch_samples)
        return (batch_samples, *rest)

    def training_step(self, model, inputs, *args, **kwargs):
        from palu_trainer.framework.patches.windows import scaling_the_loss, stepping_at_window_end

        if self.epoch_windows is None:  # a step outside `train`
            return super().training_step(model, inputs, *args, **kwargs)
        window = self.epoch_windows.size(self.state.global_step)
        self.micro_batches_in_window += 1
        window_ends = self.micro_batches_in_window >= window
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            # accelerate before 1.x lets DeepSpeed count its own windows across epochs
            self.accelerator.deepspeed_engine_wrapped.engine.set_gradient_accumulation_boundary(window_ends)
        factor = 1 if loop_divides_by_window_size() else self.args.gradient_accumulation_steps / window
        with scaling_the_loss(self, factor) if factor != 1 else contextlib.nullcontext():
            loss = super().training_step(model, inputs, *args, **kwargs)
        if window_ends:
            self.micro_batches_in_window = 0
        if loop_windows_cross_epochs():
            stepping_at_window_end(self, window_ends)
        return loss
