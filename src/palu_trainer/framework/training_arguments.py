"""The Trainer's numeric and named arguments (`trainer.args.*`) and the settings that train nothing, checked
on the composed config before anything loads.

transformers accepts some of these values and fails later with a `ZeroDivisionError` or a bare torch
`ValueError` (after the model has loaded); others it accepts and trains on silently (`learning_rate=0`,
`num_train_epochs=0`): each gets a sentence naming the option, the range and why.
"""

import difflib
import math
from dataclasses import dataclass

from omegaconf import OmegaConf


def written(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


@dataclass(frozen=True)
class Bound:
    """A numeric `trainer.args` option: integer or any number, within [low, high] (strict where marked)."""

    meaning: str
    integer: bool = False
    low: float | None = None
    high: float | None = None
    low_strict: bool = False
    high_strict: bool = False
    optional: bool = False  # None (null) is allowed: transformers' own default

    def problem(self, value) -> str | None:
        if value is None and self.optional:
            return None
        kind = "an integer" if self.integer else "a number"
        numeric = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
        if numeric and self.integer and not float(value).is_integer():
            numeric = False
        in_range = numeric and not (
            (self.low is not None and (value <= self.low if self.low_strict else value < self.low))
            or (self.high is not None and (value >= self.high if self.high_strict else value > self.high))
        )
        if in_range:
            return None
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_strict else '>='} {written(self.low)}")
        if self.high is not None:
            bounds.append(f"{'<' if self.high_strict else '<='} {written(self.high)}")
        return f"must be {kind} {' and '.join(bounds)} ({self.meaning})"


POSITIVE_INTEGER = {"integer": True, "low": 1}
# trainer.args option -> its bound; the framework's own `warmup_epochs` is here too (it becomes warmup_steps).
BOUNDS = {
    "per_device_train_batch_size": Bound("rows per device in each micro-batch", **POSITIVE_INTEGER),
    "per_device_eval_batch_size": Bound("rows per device in each evaluation batch", **POSITIVE_INTEGER),
    "gradient_accumulation_steps": Bound(
        "micro-batches per optimizer step; 1 steps after every micro-batch", **POSITIVE_INTEGER
    ),
    "learning_rate": Bound(
        "0 trains nothing and saves the original model as the unlearned one; a negative rate ascends "
        "every loss",
        low=0,
        low_strict=True,
    ),
    "num_train_epochs": Bound(
        "0 trains nothing; to train a few steps set +trainer.args.max_steps=N", low=0, low_strict=True
    ),
    "warmup_ratio": Bound("the share of the steps spent warming up", low=0, high=1),
    "warmup_steps": Bound("optimizer steps of linear warm-up; 0 uses warmup_ratio", integer=True, low=0),
    "warmup_epochs": Bound(
        "epochs of warm-up, turned into warmup_steps by the framework", low=0, optional=True
    ),
    "weight_decay": Bound("AdamW's decoupled decay; a negative one inflates the weights", low=0),
    "adam_beta1": Bound("the first-moment decay", low=0, high=1, high_strict=True),
    "adam_beta2": Bound("the second-moment decay", low=0, high=1, high_strict=True),
    "adam_epsilon": Bound("added to the update's denominator; 0 divides by zero", low=0, low_strict=True),
    "max_grad_norm": Bound("the gradient norm clipped to; 0 turns clipping off", low=0, optional=True),
    "logging_steps": Bound(
        "steps between logs; a number below 1 is a share of the run", low=0, low_strict=True
    ),
    "save_steps": Bound("steps between checkpoints; below 1 a share of the run", low=0, low_strict=True),
    "eval_steps": Bound(
        "steps between evaluations; below 1 a share of the run", low=0, low_strict=True, optional=True
    ),
    "save_total_limit": Bound("checkpoints kept; null keeps all", optional=True, **POSITIVE_INTEGER),
    "seed": Bound("numpy's seed range", integer=True, low=0, high=2**32 - 1),
    "data_seed": Bound("numpy's seed range", integer=True, low=0, high=2**32 - 1, optional=True),
    "dataloader_num_workers": Bound("worker processes; 0 loads in the main process", integer=True, low=0),
}
# Step-interval options and the strategy that reads them.
READ_BY = {"logging_steps": "logging_strategy", "save_steps": "save_strategy", "eval_steps": "eval_strategy"}


def named_choices() -> dict[str, list[str]]:
    """trainer.args options that name one of transformers' choices -> the installed version's choices."""
    from transformers.trainer_utils import IntervalStrategy, SchedulerType
    from transformers.training_args import OptimizerNames

    try:
        from transformers.trainer_utils import SaveStrategy  # transformers >= 4.49: adds `best`
    except ImportError:
        SaveStrategy = IntervalStrategy
    intervals = [choice.value for choice in IntervalStrategy]
    return {
        "lr_scheduler_type": [choice.value for choice in SchedulerType],
        "optim": [choice.value for choice in OptimizerNames],
        "eval_strategy": intervals,
        "evaluation_strategy": intervals,
        "logging_strategy": intervals,
        "save_strategy": [choice.value for choice in SaveStrategy],
    }


def training_arguments_problem(cfg, script) -> str | None:
    """The first `trainer.args` value out of its range or not among its choices."""
    args = OmegaConf.to_container(cfg.trainer.args, resolve=True)
    for name, bound in BOUNDS.items():
        if name not in args:
            continue
        if name in READ_BY and args.get(READ_BY[name], "steps") != "steps":
            continue
        if name == "num_train_epochs" and args.get("max_steps", -1) not in (-1, None):
            continue  # max_steps overrides the epochs
        problem = bound.problem(args[name])
        if problem:
            return f"trainer.args.{name}={args[name]!r}: {problem}"
    for name, choices in named_choices().items():
        value = args.get(name)
        if value is None or value in choices:
            continue
        close = difflib.get_close_matches(str(value), choices, n=1)
        suggestion = f"did you mean {close[0]}? " if close else ""
        return (
            f"trainer.args.{name}={value!r} is not a choice of transformers: {suggestion}choose one of "
            + (", ".join(choices))
        )
    return None


def forget_weight_problem(cfg, script) -> str | None:
    """gamma = 0 with no retain term: the loss is 0 at every step, and the original model is saved."""
    options = cfg.trainer.get("method_args") or {}
    gamma, alpha = options.get("gamma"), options.get("alpha")
    if gamma != 0 or alpha is None:
        return None
    if alpha == 0 or options.get("retain_loss_type") == "none":
        retain = "alpha=0" if alpha == 0 else "retain_loss_type=none"
        return (
            f"trainer.method_args.gamma=0 with {retain}: every term of the loss has weight 0, so the run "
            "trains nothing and saves the original model under the unlearned name. gamma weighs the forget "
            "terms and alpha the retain loss: give gamma > 0 (the stock configs use 1.0)"
        )
    return None


def forget_weight_warning(cfg, script) -> str | None:
    """gamma = 0 with a retain term: a real control run (retain-only fine-tuning) that unlearns nothing."""
    options = cfg.trainer.get("method_args") or {}
    if (
        options.get("gamma") == 0
        and options.get("alpha", 0) != 0
        and options.get("retain_loss_type") != "none"
    ):
        return (
            "trainer.method_args.gamma=0: the forget terms have weight 0, so this run only fine-tunes on the "
            "retain set and unlearns nothing (a control run); give gamma > 0 to unlearn"
        )
    return None


def no_training_warning(cfg, script) -> str | None:
    if cfg.trainer.args.get("do_train", True) is False:
        return (
            "trainer.args.do_train=false: the run trains nothing and saves no model (it only evaluates the "
            "loaded one when do_eval=true); set do_train=true to unlearn"
        )
    return None
