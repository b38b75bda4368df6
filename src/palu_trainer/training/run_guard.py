"""The guard on a training run (docs/operations.md): divergence (a non-finite loss, gradient norm or weight)
and failed saves stop the run and mark its folder failed (`FAILED_RUN_FILE`); SIGTERM or a first Ctrl-C
writes a resumable checkpoint and exits with 128 + the signal; `training.run_plan` checks before the first
step. PALU's and TPO's trainers attach it themselves (`framework.trainers.guarded.protect_run`), so it
holds under the framework's own `src/train.py`; palu-train attaches it to the stock trainers too.

The guarded trainer's own methods (`training_step`, `save_model`, `_save_checkpoint`, `train`) call the
guard's hooks, and the guard is a callback of the trainer for each step's verdict. Under several processes
that verdict is agreed by one all-reduce, so all ranks stop together.
"""

import json
import logging
import math
import re
import shlex
import shutil
import signal
import sys
import threading
from pathlib import Path

import torch
from transformers import TrainerCallback

from palu_trainer.training.crashes import FAILED_RUN_FILE, mark_crashed
from palu_trainer.training.resume import checkpoints_newest_first
from palu_trainer.training.run_folder import (
    FINISHED_LOOKING,
    STAGING_DIR,
    remove_stale_weights,
    rotate_checkpoints,
)
from palu_trainer.training.run_plan import (
    ALLOW_LOW_DISK,
    disk_space_problem,
    empty_epoch_problem,
    zero_learning_rate_problem,
)

logger = logging.getLogger(__name__)


def hydra_quoted(value: str) -> str:
    """`value` as a Hydra override's value: as it is when Hydra's grammar reads it so, else quoted."""
    if re.fullmatch(r"[\w./~+:@-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class RunStopped(SystemExit):
    """The run stopped before its end on purpose; the message (printed to stderr when raised, prefixed with
    the program) says why and what to do next. A SystemExit, so that the framework's Hydra app (which reports
    any Exception with a traceback) exits with the message alone."""

    def __init__(self, message: str, exit_code: int = 1, program: str | None = None):
        super().__init__(exit_code)
        self.message, self.exit_code = message, exit_code
        print(f"{program or Path(sys.argv[0]).name}: {message}", file=sys.stderr, flush=True)

    def __str__(self) -> str:
        return self.message


def finite(value) -> bool:
    # None: no gradient norm, as clipping is off (max_grad_norm=0)
    return value is None or bool(torch.isfinite(torch.as_tensor(value)).all())


def gradient_norm(trainer) -> float | None:
    """The gradient norm of the optimizer step about to be taken, whether or not the run clips: DeepSpeed's
    engine has stepped already and holds it; else the parameters' gradients give it."""
    if trainer.is_deepspeed_enabled:
        return float(trainer.deepspeed.get_global_grad_norm())
    norms = [
        torch.linalg.vector_norm(parameter.grad, dtype=torch.float32)
        for parameter in trainer.model.parameters()
        if parameter.grad is not None
    ]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else None


class RunGuard(TrainerCallback):
    """The guard of `trainer`, a `GuardedTrainer` (framework/trainers/guarded.py), whose own methods call its
    hooks; a callback for the step's verdict. `argv` is the run's command line after `command`, for the
    resume command. An override `allow_low_disk_space=true` skips the disk check."""

    def __init__(self, trainer, argv: list[str], command: list[str]):
        self.trainer = trainer
        self.argv = list(argv)
        self.command = command
        self.program = Path(self.command[-1]).name
        self.allow_low_disk = any(
            arg.lstrip("+~").lower() in (f"{ALLOW_LOW_DISK}=true", f"{ALLOW_LOW_DISK}=1") for arg in argv
        )
        self.nonfinite_loss = None  # (step, loss, terms) of this rank's first non-finite micro-batch
        self.grad_norm = None  # this optimizer step's
        self.preempted_by: signal.Signals | None = None  # the first SIGTERM or SIGINT this process got
        self.stopping_for_preemption = False
        self.crashed = False  # training raised: its report is out, and a signal now ends the process
        self.staging: Path | None = None  # where the checkpoint being saved is written
        trainer.add_callback(self)

    def _on_preemption(self, signum, frame):
        if self.crashed:
            raise SystemExit(128 + signum)  # an exit Python sees: the folder unlocked, shared memory freed
        if self.preempted_by == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.preempted_by = self.preempted_by or signal.Signals(signum)
        again = " (Ctrl-C again stops at once, with no checkpoint)" if signum == signal.SIGINT else ""
        message = f"{signal.Signals(signum).name}: finishing this step, then writing a checkpoint{again}"
        print(f"{self.program}: {message}", file=sys.stderr, flush=True)

    def check_plan(self, resuming: bool) -> None:
        """Refuse a run that would train nothing or could not save, before its first step (the message alone,
        under the framework's train.py too); clear an earlier run's failure mark and final weights, and unless
        `resuming` its checkpoints, which the config check (`checks.finished_folder_problem`) let through only
        when asked to overwrite or resume: no checkpoint outlives its run beside another run's model."""
        checks = [empty_epoch_problem, zero_learning_rate_problem, self._nonfinite_start_problem]
        for check in checks if self.allow_low_disk else [*checks, disk_space_problem]:
            if problem := check(self.trainer):
                raise RunStopped(problem, program=self.program)
        if self.trainer.is_world_process_zero():
            output_dir = self.trainer.args.output_dir
            (Path(output_dir) / FAILED_RUN_FILE).unlink(missing_ok=True)
            if removed := remove_stale_weights(output_dir):
                logger.warning("removed an earlier run's final weights from %s: %s", output_dir, removed)
            earlier = [] if resuming else checkpoints_newest_first(output_dir)
            for checkpoint in earlier:
                shutil.rmtree(checkpoint)
            if earlier:
                logger.warning(
                    "removed an earlier run's checkpoints from %s: %s",
                    output_dir,
                    ", ".join(path.name for path in earlier),
                )

    # -- divergence ---------------------------------------------------------------------------------------

    def record_loss(self, loss) -> None:
        """The guarded trainer's `training_step` reports each micro-batch's loss."""
        if self.nonfinite_loss is None and not finite(loss):
            terms = dict(getattr(self.trainer, "last_terms", {}))
            self.nonfinite_loss = (self.trainer.state.global_step + 1, float(loss), terms)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grad_norm = gradient_norm(self.trainer)

    def _agreed(self, *flags: bool) -> list[bool]:
        """`flags` OR-ed over all processes (one all-reduce), so every rank takes the same branch."""
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return list(flags)
        tensor = torch.tensor([float(flag) for flag in flags], device=accelerator.device)
        return [bool(value) for value in accelerator.reduce(tensor, reduction="sum").cpu() > 0]

    def on_step_end(self, args, state, control, **kwargs):
        diverged, preempted = self._agreed(
            self.nonfinite_loss is not None or not finite(self.grad_norm), self.preempted_by is not None
        )
        if diverged:
            self._stop_diverged(self._what_diverged(self.grad_norm))
        if preempted and not self.stopping_for_preemption:
            self.stopping_for_preemption = True
            control.should_save = control.should_training_stop = True
            args.save_only_model = False  # the checkpoint must resume: optimizer state too
        return control

    def _what_diverged(self, grad_norm) -> str:
        if self.nonfinite_loss is None:
            if not finite(grad_norm):
                return f"the gradient norm is {float(grad_norm):.4g} (every micro-batch's loss was finite)"
            return "another process's loss went non-finite"
        step, loss, terms = self.nonfinite_loss
        named = [name for name, value in terms.items() if not math.isfinite(value)]
        where = f" ({', '.join(named)} non-finite)" if named else ""
        values = f"; terms: {', '.join(f'{n}={v:.4g}' for n, v in terms.items())}" if terms else ""
        return f"the loss is {loss}{where} at step {step}{values}"

    def _stop_diverged(self, what: str, when: str = "") -> None:
        args = self.trainer.args
        fixes = [f"lower trainer.args.learning_rate (now {args.learning_rate:g})"]
        if not args.max_grad_norm:
            fixes.append("clip gradients (trainer.args.max_grad_norm=1.0; clipping is off)")
        if args.bf16 or args.fp16:
            fixes.append("or train in fp32 (bf16=false): 16-bit arithmetic overflows sooner")
        step = self.trainer.state.global_step
        self._stop(
            "diverged",
            f"training diverged at step {step}{when}: {what}. Nothing was saved as the final model",
            f"To train again, {', '.join(fixes)}.{self._last_checkpoint(step)}",
        )

    def _last_checkpoint(self, before_step: int) -> str:
        for path in checkpoints_newest_first(self.trainer.args.output_dir):
            if int(path.name.split("-")[-1]) < before_step:
                return f" Its last checkpoint before the divergence, {path}, has finite weights."
        return ""

    def _stop(self, reason: str, message: str, next_step: str):
        output_dir = Path(self.trainer.args.output_dir)
        if self.trainer.is_world_process_zero():
            output_dir.mkdir(parents=True, exist_ok=True)
            record = {"reason": reason, "step": self.trainer.state.global_step, "message": message}
            (output_dir / FAILED_RUN_FILE).write_text(json.dumps({**record, "next": next_step}, indent=1))
        raise RunStopped(
            f"{message}; {output_dir} is marked failed ({FAILED_RUN_FILE}), so palu-eval refuses it. "
            f"{next_step}",
            program=self.program,
        )

    def _nonfinite_weights(self, model=None) -> list[str]:
        """Names of parameters holding a non-finite value (each rank checks its ZeRO-3 partition)."""
        names = [
            name
            for name, parameter in (self.trainer.model if model is None else model).named_parameters()
            if not torch.isfinite(getattr(parameter, "ds_tensor", parameter)).all()
        ]
        (any_rank,) = self._agreed(bool(names))
        return names or (["(on another process)"] if any_rank else [])

    def _nonfinite_start_problem(self, trainer) -> str | None:
        """A starting model (or reference) with nan or inf weights: broken before any step, whatever the
        learning rate."""
        models = {"starting model": trainer.model, "reference model": getattr(trainer, "ref_model", None)}
        for role, model in models.items():
            if names := (self._nonfinite_weights(model) if model is not None else []):
                path = getattr(getattr(model, "config", None), "name_or_path", "") or "it"
                return (
                    f"the {role} ({path}) holds non-finite weights before the first step: {len(names)} "
                    f"tensor(s) with nan or inf, the first {names[0]}. The model file is broken (or was "
                    "saved by a run that diverged): train from a model with finite weights"
                )
        return None

    # -- saves ----------------------------------------------------------------------------------------------

    def save_final(self, save_model, output_dir=None, _internal_call=False):
        """The guarded trainer's `save_model`: no weights with nan or inf saved, and a failed final save's
        partial files removed."""
        if names := self._nonfinite_weights():
            self._stop_diverged(
                f"{len(names)} weight tensor(s) hold nan or inf (e.g. {names[0]})", " before saving"
            )
        try:
            return save_model(output_dir, _internal_call)
        except Exception as error:  # noqa: BLE001 (any failed save leaves a broken folder)
            if _internal_call:  # transformers' own save (a checkpoint's): raised as it is
                raise
            folder = Path(output_dir or self.trainer.args.output_dir)
            if self.trainer.is_world_process_zero():
                for pattern in FINISHED_LOOKING:
                    for path in folder.glob(pattern):
                        path.unlink()
            self._stop(
                "final save failed",
                f"saving the final model to {folder} failed after training: {error}. Its partial files "
                "were removed",
                "Free space on its filesystem (or choose another paths.output_dir) and run again.",
            )

    def save_checkpoint(self, save_checkpoint, *args, **kwargs):
        """The guarded trainer's `_save_checkpoint`, writing whole checkpoints or none: each is written into
        `STAGING_DIR` (the trainer's `_get_output_dir` gives `self.staging`) and renamed into the output
        folder once every rank has written its part, so a kill during a save leaves no half `checkpoint-N`
        for `resume_from_checkpoint=true` to pick; a failed save is removed."""
        trainer = self.trainer
        output_dir = Path(trainer.args.output_dir)
        staging = output_dir / STAGING_DIR
        folder = output_dir / f"checkpoint-{trainer.state.global_step}"
        self.staging = staging
        try:
            if trainer.is_world_process_zero():
                shutil.rmtree(staging, ignore_errors=True)  # what an earlier killed save left
            trainer.accelerator.wait_for_everyone()
            saved = save_checkpoint(*args, **kwargs)
            trainer.save_checkpoint_state(staging / folder.name)
            trainer.accelerator.wait_for_everyone()
            if trainer.is_world_process_zero():
                evaluated = folder / "evals"  # the framework's evaluation at this step, written before it
                if evaluated.is_dir():
                    evaluated.rename(staging / folder.name / "evals")
                shutil.rmtree(folder, ignore_errors=True)
                (staging / folder.name).rename(folder)
                staging.rmdir()
            trainer.accelerator.wait_for_everyone()
        except Exception as error:  # noqa: BLE001 (a RunStopped, a SystemExit, passes)
            if trainer.is_world_process_zero():
                shutil.rmtree(staging, ignore_errors=True)
            self._stop(
                "checkpoint save failed",
                f"writing {folder} failed at step {trainer.state.global_step}: {error}. The partial "
                "checkpoint was removed",
                "Free space (or save fewer checkpoints: trainer.args.save_total_limit) and resume from "
                "an earlier checkpoint, or run again.",
            )
        finally:
            self.staging = None
        if trainer.state.best_model_checkpoint:
            trainer.state.best_model_checkpoint = trainer.state.best_model_checkpoint.replace(
                str(staging / folder.name), str(folder)
            )
        if trainer.args.should_save:
            rotate_checkpoints(trainer, str(output_dir))
        return saved

    # -- preemption -----------------------------------------------------------------------------------------

    def train(self, train, *args, **kwargs):
        """The guarded trainer's `train`: the plan checked, SIGTERM and Ctrl-C turned into a checkpoint and
        the command that resumes it, and a crash told in one line (`training.crashes`), its folder marked."""
        self.check_plan(bool(kwargs.get("resume_from_checkpoint", args[0] if args else None)))
        main_thread = threading.current_thread() is threading.main_thread()  # signals go to it alone
        handlers = {
            signum: signal.signal(signum, self._on_preemption)
            for signum in (signal.SIGTERM, signal.SIGINT)
            if main_thread
        }
        try:
            result = train(*args, **kwargs)
        except Exception as error:
            # Once one rank dies its launcher sends the others SIGTERM: this rank first tells its own crash,
            # and a signal after that ends it as an exit Python sees.
            for signum in handlers:
                signal.signal(signum, signal.SIG_IGN)
            problem = mark_crashed(self.trainer.args.output_dir, error)
            stopped = problem and RunStopped(problem, program=self.program)  # printed here
            self.crashed = True
            for signum in handlers:
                signal.signal(signum, self._on_preemption)
            if stopped:
                raise stopped from error
            raise
        finally:
            if not self.crashed:
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
        if self.stopping_for_preemption:
            step = self.trainer.state.global_step
            checkpoint = Path(self.trainer.args.output_dir) / f"checkpoint-{step}"
            received = self.preempted_by or signal.SIGTERM  # another process's signal: as SIGTERM
            raise RunStopped(
                f"stopped by {received.name} after step {step} of {self.trainer.state.max_steps}: "
                f"{checkpoint} holds the model and optimizer state. Resume with:\n  "
                f"{self.resume_command(checkpoint)}",
                128 + received,
                self.program,
            )
        return result

    def resume_command(self, checkpoint: Path) -> str:
        """The run's command line with `resume_from_checkpoint` set to `checkpoint`."""
        kept = [
            arg for arg in self.argv if not arg.lstrip("+").startswith("trainer.args.resume_from_checkpoint=")
        ]
        resume = f"+trainer.args.resume_from_checkpoint={hydra_quoted(str(checkpoint))}"
        command = shlex.join([*self.command, *kept, resume])
        if self.trainer.accelerator.num_processes > 1:
            return f"{command}   (under your launcher, e.g. accelerate launch, as before)"
        return command
