"""What PALU's and TPO's trainers share as open-unlearning trainers: a loss that is a mean per
micro-batch, non-reentrant activation checkpointing, the run guard, and resuming from
`trainer.args.resume_from_checkpoint`, so that all of it holds under the framework's own `src/train.py` as
under palu-train."""

import logging

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.resume import checkpoint_to_resume
from palu_trainer.framework.run_guard import RunStopped, protect_run
from palu_trainer.framework.torch_safe_globals import allow_numpy_rng_state
from palu_trainer.framework.trainers.checkpointing import use_non_reentrant_checkpointing

ensure_importable()
from trainer.unlearn.grad_diff import GradDiff  # noqa: E402

logger = logging.getLogger(__name__)


class GuardedGradDiff(GradDiff):
    options_type: type  # the trainer's `trainer.method_args` (PALUOptions, TPOOptions): `self.options`

    def __init__(self, *args, **kwargs):
        self.options = options = self.options_type.take(kwargs)
        super().__init__(
            *args,
            gamma=options.gamma,
            alpha=options.alpha,
            retain_loss_type=options.retain_loss_type,
            **kwargs,
        )
        # The loss is a mean over each micro-batch: the Trainer divides it by the accumulation steps itself
        # (transformers >= 4.46 skips that for models that take loss kwargs, expecting num_items_in_batch).
        self.model_accepts_loss_kwargs = False
        use_non_reentrant_checkpointing(self.args)
        protect_run(self)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`resume_from_checkpoint` defaults to `trainer.args.resume_from_checkpoint` (a folder, or true for
        the last checkpoint): the framework's train.py calls `train()` without it."""
        if resume_from_checkpoint is None:
            try:
                resume_from_checkpoint = checkpoint_to_resume(
                    self.args.resume_from_checkpoint, self.args.output_dir, logger.warning
                )
            except (FileNotFoundError, ValueError) as error:
                raise RunStopped(str(error)) from None
        if resume_from_checkpoint:
            allow_numpy_rng_state()
            self.before_resuming()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def before_resuming(self) -> None:
        """What must happen before the checkpoint's weights replace the starting model's."""
