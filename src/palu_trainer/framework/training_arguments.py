"""The Trainer's numeric and named arguments (`trainer.args.*`) and the settings that train nothing, checked
on the composed config before anything loads."""

from typing import Any

from omegaconf import OmegaConf
from pydantic import ConfigDict
from transformers import trainer_utils
from transformers.training_args import OptimizerNames

from palu_trainer.validation import Checked, Choice, Integer, Number, Options

Interval = trainer_utils.IntervalStrategy
SaveStrategy = getattr(trainer_utils, "SaveStrategy", Interval)  # transformers >= 4.49: adds `best`


def step_limit(value):
    if value == -1 or (type(value) is int and value >= 1):
        return value
    raise ValueError(
        "give a number of optimizer steps >= 1, or -1 (the default) to train trainer.args.num_train_epochs "
        "epochs (transformers reads 0 as 'no limit' and trains every epoch)"
    )


def TransformersChoice(enum) -> Any:
    """One of the installed transformers' values of `enum`, or null (transformers' default)."""
    return Choice(f"one of transformers' {enum.__name__} values", *(choice.value for choice in enum), None)


class TrainerArguments(Options):
    """The `trainer.args` that transformers accepts and then fails on after the model has loaded (a
    `ZeroDivisionError`, a bare torch `ValueError`) or trains on silently (`learning_rate=0`), and the
    framework's `warmup_epochs`; the rest is transformers' to check."""

    model_config = ConfigDict(extra="ignore")
    OWNER = "the Trainer"

    max_steps: Checked("optimizer steps; -1: the epochs", step_limit) = None
    per_device_train_batch_size: Integer("rows per device in each micro-batch", ge=1) = None
    per_device_eval_batch_size: Integer("rows per device in each evaluation batch", ge=1) = None
    gradient_accumulation_steps: Integer(
        "micro-batches per optimizer step; 1 steps after every micro-batch", ge=1
    ) = None
    learning_rate: Number(
        "0 trains nothing and saves the original model as the unlearned one; a negative rate ascends every "
        "loss",
        gt=0,
    ) = None
    num_train_epochs: Number("0 trains nothing; to train a few steps set +trainer.args.max_steps=N", gt=0) = (
        None
    )
    warmup_ratio: Number("the share of the steps spent warming up", ge=0, le=1) = None
    warmup_steps: Integer("optimizer steps of linear warm-up; 0 uses warmup_ratio", ge=0) = None
    warmup_epochs: Number("epochs of warm-up, turned into warmup_steps by the framework", True, ge=0) = None
    weight_decay: Number("AdamW's decoupled decay; a negative one inflates the weights", ge=0) = None
    adam_beta1: Number("the first-moment decay", ge=0, lt=1) = None
    adam_beta2: Number("the second-moment decay", ge=0, lt=1) = None
    adam_epsilon: Number("added to the update's denominator; 0 divides by zero", gt=0) = None
    max_grad_norm: Number("the gradient norm clipped to; 0 turns clipping off", True, ge=0) = None
    logging_steps: Number("steps between logs; a number below 1 is a share of the run", gt=0) = None
    save_steps: Number("steps between checkpoints; below 1 a share of the run", gt=0) = None
    eval_steps: Number("steps between evaluations; below 1 a share of the run", True, gt=0) = None
    save_total_limit: Integer("checkpoints kept; null keeps all", True, ge=1) = None
    seed: Integer("numpy's seed range", ge=0, le=2**32 - 1) = None
    data_seed: Integer("numpy's seed range", True, ge=0, le=2**32 - 1) = None
    dataloader_num_workers: Integer("worker processes; 0 loads in the main process", ge=0) = None
    lr_scheduler_type: TransformersChoice(trainer_utils.SchedulerType) = None
    optim: TransformersChoice(OptimizerNames) = None
    eval_strategy: TransformersChoice(Interval) = None
    evaluation_strategy: TransformersChoice(Interval) = None
    logging_strategy: TransformersChoice(Interval) = None
    save_strategy: TransformersChoice(SaveStrategy) = None


# Step-interval options and the strategy that reads them.
READ_BY = {"logging_steps": "logging_strategy", "save_steps": "save_strategy", "eval_steps": "eval_strategy"}


def training_arguments_problem(cfg, script) -> str | None:
    """The first `trainer.args` value out of its range or not among transformers' choices."""
    args = OmegaConf.to_container(cfg.trainer.args, resolve=True)
    unread = {name for name, strategy in READ_BY.items() if args.get(strategy, "steps") != "steps"}
    if args.get("max_steps", -1) not in (-1, None):
        unread.add("num_train_epochs")  # max_steps overrides the epochs
    return TrainerArguments.problem(
        {name: value for name, value in args.items() if name not in unread}, "trainer.args."
    )


def forget_weight_problem(cfg, script, warn: bool = False) -> str | None:
    """gamma = 0. With no retain term the loss is 0 at every step and the original model is saved (refused);
    with one, a real control run (retain-only fine-tuning) that unlearns nothing (`warn`: warned about)."""
    options = cfg.trainer.get("method_args") or {}
    if options.get("gamma") != 0:
        return None
    alpha, no_retain_loss = options.get("alpha"), options.get("retain_loss_type") == "none"
    retain = "alpha=0" if alpha == 0 else "retain_loss_type=none" if no_retain_loss else None
    if warn:
        if retain or "alpha" not in options:
            return None
        return (
            "trainer.method_args.gamma=0: the forget terms have weight 0, so this run only fine-tunes on the "
            "retain set and unlearns nothing (a control run); give gamma > 0 to unlearn"
        )
    if alpha is None or retain is None:
        return None
    return (
        f"trainer.method_args.gamma=0 with {retain}: every term of the loss has weight 0, so the run "
        "trains nothing and saves the original model under the unlearned name. gamma weighs the forget "
        "terms and alpha the retain loss: give gamma > 0 (the stock configs use 1.0)"
    )


def no_training_warning(cfg, script) -> str | None:
    if cfg.trainer.args.get("do_train", True) is False:
        return (
            "trainer.args.do_train=false: the run trains nothing and saves no model (it only evaluates the "
            "loaded one when do_eval=true); set do_train=true to unlearn"
        )
    return None
