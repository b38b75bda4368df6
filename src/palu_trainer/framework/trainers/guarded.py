"""What PALU's and TPO's trainers share, so that it holds under the framework's own `src/train.py` as under
palu-train: a loss that is a mean per micro-batch, non-reentrant activation checkpointing, the run guard
(`GuardedTrainer`: the Trainer's own methods call it), and resuming from
`trainer.args.resume_from_checkpoint`."""

import logging
import shutil
import sys
import tempfile
from pathlib import Path

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.trainers.accumulation import EpochWindowAccumulation
from palu_trainer.training.resume import checkpoint_to_resume
from palu_trainer.training.run_guard import RunGuard, RunStopped

ensure_importable()
from trainer.unlearn.grad_diff import GradDiff  # noqa: E402

logger = logging.getLogger(__name__)


def protect_run(trainer) -> RunGuard:
    """`trainer`'s guard, with the running Hydra app's command for its resume command: `python src/train.py`
    (or palu-train), its config name and overrides."""
    from hydra.core.hydra_config import HydraConfig

    script, arguments = sys.argv[0], sys.argv[1:]
    command = ["python", script] if script.endswith(".py") else [Path(script).name]
    if HydraConfig.initialized():
        hydra = HydraConfig.get()
        arguments = [f"--config-name={hydra.job.config_name}", *hydra.overrides.task]
    return RunGuard(trainer, arguments, command)


class GuardedTrainer(EpochWindowAccumulation):
    """A Trainer whose own methods report to its run guard (`training.run_guard`), and whose steps are the
    mean loss of each accumulation window of an epoch on every stack (`trainers.accumulation`); listed
    before the Trainer's class among the bases. PALU's and TPO's trainers are; palu-train and the plugin's
    experiments make the stock ones so (`patches.guarding_stock_trainers`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the loss is a mean per micro-batch, for the loop to divide by the window's micro-batches; 4.51
        # skips that division for models whose forward takes `**kwargs` (Llama, Qwen, Gemma)
        self.model_accepts_loss_kwargs = False
        self.run_guard = protect_run(self)

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.run_guard.record_loss(loss)
        return loss

    def save_model(self, output_dir=None, _internal_call=False):
        return self.run_guard.save_final(super().save_model, output_dir, _internal_call)

    def _save_checkpoint(self, *args, **kwargs):
        return self.run_guard.save_checkpoint(super()._save_checkpoint, *args, **kwargs)

    def _get_output_dir(self, *args, **kwargs):
        staging = self.run_guard.staging
        return str(staging) if staging else super()._get_output_dir(*args, **kwargs)

    def train(self, *args, **kwargs):
        return self.run_guard.train(super().train, *args, **kwargs)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval", trial=None):
        """The framework's evaluators' metrics (under several processes too: `evaluate_on_every_rank`),
        scored by the run's `best_model` rule when it has one (`training.best_model`; the framework's
        `evaluate` calls no callback with them)."""
        if getattr(self, "evaluators", None) and self.accelerator.num_processes > 1:
            metrics = self.evaluate_on_every_rank(trial)
        else:
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, trial)
        selection = getattr(self, "model_selection", None)
        if selection is not None and metrics:
            selection.judge(metrics, self.state, self.control)
        return metrics

    def evaluate_on_every_rank(self, trial) -> dict:
        """The framework's evaluators under several processes, where its own `evaluate` warns and returns
        nothing: every rank runs every evaluator on the whole of each set (ZeRO-3 needs every rank in each
        forward pass and each generation step, since each holds a shard of the weights), so the metrics
        are the same on every rank and nothing is gathered; the main process writes the evaluation files
        where one process would (`checkpoint-<step>/evals`), the others into a folder of their own."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        step = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.accelerator.is_main_process:
            folder = Path(self._get_output_dir(trial=trial)) / step / "evals"
        else:
            folder = Path(tempfile.mkdtemp(prefix=f"palu-evals-rank{self.accelerator.process_index}-"))
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer = getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)
        arguments = {"template_args": self.template_args, "model": self.model, "tokenizer": tokenizer}
        metrics = {}
        for evaluator in self.evaluators.values():
            metrics.update(evaluator.evaluate(output_dir=str(folder), **arguments))
        if not self.accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)
        self.log(metrics)
        return metrics

    def save_checkpoint_state(self, folder: Path) -> None:
        """Write what this trainer's checkpoints hold beyond the Trainer's own files into `folder`, the
        checkpoint being written (called on every rank, before it is renamed into place)."""

    def checkpoint_state_bytes(self) -> int:
        """Bytes that `save_checkpoint_state` adds to each checkpoint (the run's disk estimate)."""
        return 0


def use_non_reentrant_checkpointing(args) -> None:
    """Make `gradient_checkpointing: true` recompute without reentrant backward passes, unless the run
    says otherwise (`gradient_checkpointing_kwargs.use_reentrant`). transformers defaults to torch's
    reentrant checkpoint, which runs a separate backward pass per checkpointed layer: with the model run
    twice per step, each parameter's gradient arrives twice, and DeepSpeed ZeRO-3 reduces each arrival on its
    own, so the step's gradient is wrong (measured on two processes: a gradient norm 12% below the
    one-process run's). The non-reentrant form gives one gradient per parameter and step.
    """
    if not args.gradient_checkpointing:
        return
    kwargs = dict(args.gradient_checkpointing_kwargs or {})
    if "use_reentrant" not in kwargs:
        kwargs["use_reentrant"] = False
        args.gradient_checkpointing_kwargs = kwargs
        logger.info("gradient checkpointing: use_reentrant=false (one gradient per parameter and step)")
    elif kwargs["use_reentrant"] and args.deepspeed:
        logger.warning(
            "gradient_checkpointing_kwargs.use_reentrant=true under DeepSpeed: the model runs twice a step, "
            "so ZeRO-3 reduces each parameter's gradient twice and the step's gradient is wrong; drop the "
            "setting (this trainer then uses use_reentrant=false)"
        )


def command_line_flag(name: str) -> bool:
    """Whether the running Hydra app's command line sets `+name=true`."""
    from hydra.core.hydra_config import HydraConfig

    values = (override.lstrip("+~").partition("=") for override in HydraConfig.get().overrides.task)
    return any(key == name and value.lower() in ("true", "1") for key, _, value in values)


class GuardedGradDiff(GuardedTrainer, GradDiff):
    options_type: type  # the trainer's `trainer.method_args` (PALUOptions, TPOOptions): `self.options`

    def __init__(self, *args, **kwargs):
        """Takes the method's options out of `kwargs` (the framework passes `trainer.method_args` as
        keywords) and checks them here, so that a run without the plugin's config check (a user's own
        experiment YAML under src/train.py) stops on a typo or a bad value with the same one line."""
        from palu_trainer.framework.checks import init_keywords

        accepted, _ = init_keywords(GradDiff)
        fields = self.options_type.model_fields
        method_args = {
            name: kwargs.pop(name) for name in list(kwargs) if name in fields or name not in accepted
        }
        try:
            self.options = options = self.options_type.parse(method_args, "trainer.method_args.")
        except ValueError as error:
            raise RunStopped(str(error)) from None
        super().__init__(
            *args,
            gamma=options.gamma,
            alpha=options.alpha,
            retain_loss_type=options.retain_loss_type,
            **kwargs,
        )
        use_non_reentrant_checkpointing(self.args)
        self._check_overlap()

    def _check_overlap(self) -> None:
        """Forget rows that are also retain rows stop a run of the framework's script that no config check
        saw the data of (a user's own experiment YAML without the plugin's Hydra callback);
        `+allow_forget_retain_overlap=true` allows them. A trainer built in Python is handed what its caller
        chose."""
        from hydra.core.hydra_config import HydraConfig

        from palu_trainer.framework.checks import ALLOW_OVERLAP, forget_retain_overlap

        if getattr(self.train_dataset, "palu_overlap_checked", False) or not HydraConfig.initialized():
            return
        problem = forget_retain_overlap(self.train_dataset)
        if problem and not command_line_flag(ALLOW_OVERLAP):
            raise RunStopped(problem)

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
            self.before_resuming(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def before_resuming(self, checkpoint: str) -> None:
        """What must happen before the checkpoint's weights replace the starting model's."""
