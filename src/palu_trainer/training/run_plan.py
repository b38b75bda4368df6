"""What a built trainer is about to do, checked before its first step: how many optimizer steps it takes,
whether any of them has a learning rate above 0, and whether its output folder can hold what it saves.

Each check returns the problem's message or None; `RunGuard.check_plan` stops on the first.
"""

import math
import shutil
from pathlib import Path

import torch

from palu_trainer.training.resume import checkpoints_newest_first

ALLOW_LOW_DISK = "allow_low_disk_space"
# Adam-type optimizers keep two fp32 moments per trainable parameter; DeepSpeed also an fp32 master copy.
ADAM_STATE_BYTES, DEEPSPEED_MASTER_BYTES = 8, 4
SAVE_MARGIN = 1.02  # config, tokenizer, trainer state and RNG files beside the weights


def batches_per_rank(trainer) -> int:
    """Micro-batches each rank draws per epoch: the dataloader's length, without building it."""
    args = trainer.args
    rows = len(trainer.train_dataset)
    batch = args.per_device_train_batch_size
    batches = rows // batch if args.dataloader_drop_last else math.ceil(rows / batch)
    return math.ceil(batches / max(args.world_size, 1))  # accelerate pads ranks to the same count


def optimizer_steps(trainer) -> int:
    """The run's optimizer steps, as `Trainer.train` computes them."""
    args = trainer.args
    if args.max_steps > 0:
        return args.max_steps
    per_epoch = math.ceil(
        batches_per_rank(trainer) / args.gradient_accumulation_steps
    )  # a partial last window
    return math.ceil(args.num_train_epochs * per_epoch)


def empty_epoch_problem(trainer) -> str | None:
    """No micro-batch at all: the Trainer warns and saves the model it started from."""
    if batches_per_rank(trainer) > 0:
        return None
    args = trainer.args
    return (
        f"the training set has {len(trainer.train_dataset)} rows and trainer.args.dataloader_drop_last=true "
        f"drops every batch of per_device_train_batch_size={args.per_device_train_batch_size} x "
        f"{args.world_size} processes: no step would train, and the original model would be saved. Lower "
        "the batch size or set dataloader_drop_last=false"
    )


def learning_rates(trainer, steps: int) -> list[float]:
    """The learning rate of each of the first `steps` optimizer steps under the run's scheduler."""
    from transformers.optimization import get_scheduler

    args = trainer.args
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=args.get_warmup_steps(steps),
        num_training_steps=steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
    )
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def zero_learning_rate_problem(trainer, checked_steps: int = 64) -> str | None:
    """Every step at learning rate 0: a one-step run under warm-up (the first step's rate is 0)."""
    steps = optimizer_steps(trainer)
    scheduler = getattr(trainer.args.lr_scheduler_type, "value", trainer.args.lr_scheduler_type)
    if steps > checked_steps or scheduler == "reduce_lr_on_plateau":
        return None
    if any(rate > 0 for rate in learning_rates(trainer, steps)):
        return None
    schedule = f"lr_scheduler_type={scheduler}, {trainer.args.get_warmup_steps(steps)} warm-up step(s)"
    return (
        f"every one of the run's {steps} optimizer step(s) has learning rate 0 ({schedule}: warm-up starts "
        "at 0): the run would train nothing and save the original model. Take more steps, or set "
        "trainer.args.warmup_ratio=0 and +trainer.args.warmup_steps=0"
    )


def checkpoints_kept(trainer, steps: int) -> int:
    """The most checkpoints on disk at once (a new one is written before the oldest is rotated out)."""
    args = trainer.args
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if strategy == "epoch":
        written = math.ceil(args.num_train_epochs) if args.max_steps <= 0 else 1
    elif strategy == "steps":
        interval = math.ceil(args.save_steps * steps) if args.save_steps < 1 else int(args.save_steps)
        written = steps // max(interval, 1)
    else:
        written = 0  # "no"; "best" saves only on evaluation improvements: not counted
    return min(written, args.save_total_limit + 1) if args.save_total_limit else written


def disk_estimate(trainer) -> dict:
    """Bytes the run writes into its output folder: the final model and the checkpoints kept at once."""
    # each parameter once (tied embeddings are one tensor), whole (ZeRO-3 partitions the tensor itself)
    numels = {id(p): (p, getattr(p, "ds_numel", p.numel())) for p in trainer.model.parameters()}.values()
    model_bytes = sum(numel * p.element_size() for p, numel in numels)
    trainable = sum(numel for p, numel in numels if p.requires_grad)
    checkpoint_bytes = model_bytes
    if not trainer.args.save_only_model:
        per_parameter = ADAM_STATE_BYTES + (DEEPSPEED_MASTER_BYTES if trainer.is_deepspeed_enabled else 0)
        checkpoint_bytes += trainable * per_parameter
    checkpoint_bytes += trainer.checkpoint_state_bytes()
    kept = checkpoints_kept(trainer, optimizer_steps(trainer))
    # checkpoints already in the folder hold their space: a resumed run's, or an earlier run's that a run
    # starting over deletes before its first step
    written = max(0, kept - len(checkpoints_newest_first(trainer.args.output_dir)))
    return {
        "model": model_bytes,
        "checkpoint": checkpoint_bytes,
        "checkpoints": kept,
        "total": int(SAVE_MARGIN * (model_bytes + written * checkpoint_bytes)),
    }


def megabytes(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:,.2f} GiB"


def disk_space_problem(trainer) -> str | None:
    """The output folder's filesystem has less free space than the run will write there."""
    output_dir = Path(trainer.args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(output_dir).free
    estimate = disk_estimate(trainer)
    if estimate["total"] <= free:
        return None
    args = trainer.args
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    contents = "model" if args.save_only_model else "model and optimizer state"
    checkpoints = (
        f" and {estimate['checkpoints']} checkpoint(s) of {megabytes(estimate['checkpoint'])} on disk at "
        f"once ({contents}; save_strategy={strategy}, save_total_limit={args.save_total_limit})"
        if estimate["checkpoints"]
        else ""
    )
    total, model = megabytes(estimate["total"]), megabytes(estimate["model"])
    return (
        f"paths.output_dir={output_dir}: {megabytes(free)} free on its filesystem, but the run writes about "
        f"{total} there: the final model of {model}{checkpoints}. "
        "The final save would fail after every step has trained. Free space, choose another "
        "paths.output_dir, or save less (trainer.args.save_total_limit=1; save_strategy=no). "
        f"+{ALLOW_LOW_DISK}=true skips this check"
    )
