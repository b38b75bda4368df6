"""Mistakes that palu-train and palu-eval refuse before training, each message naming the option and the fix:
on the command line, on the composed config before Hydra makes the output folder (`CONFIG_CHECKS`, which
include a resume under other options: `provenance`) and on the loaded data (forget rows that are also retain
rows)."""

import functools
import inspect
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import create_model

from palu_trainer.framework.datasets import DatasetArguments
from palu_trainer.framework.lora import LoraSettings
from palu_trainer.framework.model_paths import model_path_problem
from palu_trainer.framework.provenance import resume_options_problem, row_keys
from palu_trainer.framework.training_arguments import (
    forget_weight_problem,
    no_training_warning,
    training_arguments_problem,
)
from palu_trainer.method.initiating import InitiatingOptions
from palu_trainer.options import STOCK_RETAIN_LOSS_TYPES
from palu_trainer.training.resume import checkpoints_newest_first
from palu_trainer.training.run_folder import FAILED_RUN_FILE, final_weights
from palu_trainer.validation import Alpha, Choice, Gamma, Number, Options, written


class BadInput(ValueError):
    """A mistake in the command line, the config or the data; the message names it and the fix."""


SPAN_DATASETS = ("QAwithSpansDataset", "PretrainingWithSpansDataset")
SPAN_TRAINERS = ("PALUTrainer", "TPOTrainer")
# Top-level keys (`+key=true`) that let a run through a check on purpose.
ALLOW_OVERLAP = "allow_forget_retain_overlap"
# Not transformers' `overwrite_output_dir`, which 5.x removed from TrainingArguments (a TypeError there).
ALLOW_OVERWRITE = "allow_overwriting_output_dir"
OVERWRITE_FLAG = f"+{ALLOW_OVERWRITE}=true"


def argv_problem(argv) -> str | None:
    """A command-line mistake that Hydra reports in its own terms."""
    for arg in argv:
        if arg.startswith("runtime="):
            return (
                f"{arg}: the runtime overlay is not part of the default config, so it is added, not "
                f"overridden: write `+{arg}`"
            )
    return None


def cpu_runtime_missing(runtime_choice: str | None, cuda_available: bool) -> str | None:
    """A run without CUDA and without `+runtime=cpu`: the framework's warm-up divides by the CUDA device count
    ("float floor division by zero") and its optimizer and bf16 defaults need a GPU."""
    if cuda_available or runtime_choice == "cpu":
        return None
    return (
        "no CUDA device: add `+runtime=cpu` to the command line (adamw_torch, fp32, no bf16, warm-up as a "
        "ratio, device_map=cpu; configs/runtime/cpu.yaml)"
    )


def output_dir_problem(cfg, script) -> str | None:
    path = Path(str(cfg.paths.output_dir)).expanduser()
    where = f"paths.output_dir={path}"
    existing = next((parent for parent in (path, *path.parents) if parent.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"{where}: {existing} is a file, not a folder; choose another paths.output_dir"
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as error:
        return (
            f"{where}: cannot write there ({error.strerror or error}); choose a writable folder "
            "(a read-only filesystem, /proc and /sys cannot hold the run)"
        )
    return None


def finished_folder_problem(cfg, script) -> str | None:
    """A new run into a folder that holds a finished model, a failed run's marker or an earlier run's
    checkpoints (a run that was stopped or killed: its lock says nothing once its process is gone), which it
    would replace or leave beside its own without a word: refused unless overwriting is asked for
    (`ALLOW_OVERWRITE`, or on transformers 4.x its `overwrite_output_dir`; the run guard then deletes them
    before the first step) or the run resumes."""
    args = cfg.trainer.args
    if (
        args.get("resume_from_checkpoint")
        or args.get("overwrite_output_dir")
        or cfg.get(ALLOW_OVERWRITE, False)
        or not args.get("do_train", True)
    ):
        return None
    folder = Path(str(cfg.paths.output_dir)).expanduser()
    held = final_weights(folder) + ([FAILED_RUN_FILE] if (folder / FAILED_RUN_FILE).is_file() else [])
    checkpoints = [path.name for path in checkpoints_newest_first(folder)]
    if checkpoints and not held:
        return (
            f"paths.output_dir={folder} holds an earlier run's checkpoints ({', '.join(checkpoints)}) and no "
            "final model: that run was stopped or killed. Resume it with "
            f"+trainer.args.resume_from_checkpoint=true, or start over with {OVERWRITE_FLAG}, which deletes "
            "them, or choose another paths.output_dir"
        )
    if not held:
        return None
    what = "a failed run's marker" if held == [FAILED_RUN_FILE] else "a finished model"
    return (
        f"paths.output_dir={folder} already holds {what} ({', '.join(held)}), which this run would replace: "
        f"choose another paths.output_dir, add {OVERWRITE_FLAG} to replace it, or resume its last checkpoint "
        "with +trainer.args.resume_from_checkpoint=true"
    )


def init_keywords(cls) -> tuple[set[str], set[str]]:
    """The named keywords `cls.__init__` takes up its MRO, and those of them that transformers' Trainer and
    the framework's FinetuneTrainer do not take: the method's own."""
    from trainer.base import FinetuneTrainer

    accepted, method = set(), set()
    for klass in cls.__mro__:
        if "__init__" not in klass.__dict__:
            continue
        names = {
            name
            for name, parameter in inspect.signature(klass.__init__).parameters.items()
            if name != "self" and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        }
        accepted |= names
        if not issubclass(FinetuneTrainer, klass):
            method |= names
    return accepted, method


def stock_options(cls) -> type[Options]:
    """A stock trainer's options (its __init__'s keywords up its MRO), checking what its code does not: the
    loss weights, NPO's, SimNPO's and DPO's beta (their loss divides by it) and GradDiff's retain loss."""
    from trainer.unlearn.dpo import DPO
    from trainer.unlearn.grad_diff import GradDiff
    from trainer.unlearn.npo import NPO
    from trainer.unlearn.simnpo import SimNPO

    accepted, method = init_keywords(cls)  # the framework passes Trainer's and FinetuneTrainer's itself
    checked = {"gamma": Gamma, "alpha": Alpha}
    if issubclass(cls, (NPO, SimNPO, DPO)):
        checked["beta"] = Number(f"{cls.__name__}'s temperature; 0 divides by zero", gt=0)
    if issubclass(cls, GradDiff):
        checked["retain_loss_type"] = Choice(f"{cls.__name__}'s retain loss", *STOCK_RETAIN_LOSS_TYPES)
    fields = {name: (checked.get(name, Any), None) for name in accepted}
    options = create_model(f"{cls.__name__}Options", __base__=Options, **fields)
    options.OWNER, options.LISTED = cls.__name__, tuple(sorted(method))
    return options


def method_args_problem(cfg, script) -> str | None:
    """An option the chosen trainer does not take (a typo), or a value it refuses: PALU's and TPO's
    `options_type`, or the stock trainers' `stock_options`."""
    from trainer import TRAINER_REGISTRY

    cls = TRAINER_REGISTRY.get(cfg.trainer.get("handler"))
    method_args = cfg.trainer.get("method_args")
    if cls is None or method_args is None:
        return None
    options_type = getattr(cls, "options_type", None) or stock_options(cls)
    return options_type.problem(OmegaConf.to_container(method_args, resolve=True), "trainer.method_args.")


def trainer_data_problem(cfg, script) -> str | None:
    """A trainer that cannot read span-role forget batches (they carry token roles and row indices), or PALU
    and TPO on a forget set without them."""
    handler = cfg.trainer.get("handler")
    forget = OmegaConf.select(cfg, "data.forget") or {}
    span_sets = [name for name, node in forget.items() if node.get("handler") in SPAN_DATASETS]
    experiment = OmegaConf.select(cfg, "hydra.runtime.choices.experiment") or "this experiment"
    trainer = OmegaConf.select(cfg, "hydra.runtime.choices.trainer") or handler
    muse = "muse" in str(experiment)
    if handler in SPAN_TRAINERS and forget and not span_sets:
        own = "unlearn/muse/palu" if muse else f"unlearn/tofu/{'tpo' if handler == 'TPOTrainer' else 'palu'}"
        return (
            f"trainer={trainer} reads span roles in the forget batches, which "
            f"experiment={experiment}'s forget set ({', '.join(forget)}) does not make: use "
            f"experiment={own} (its span-annotated forget set and collator)"
        )
    if not span_sets or handler in SPAN_TRAINERS:
        return None
    stock = "unlearn/muse/default" if muse else "unlearn/tofu/default"
    return (
        f"trainer={trainer} cannot train on experiment={experiment}'s forget set ({span_sets[0]}: span roles "
        f"and row indices, read by PALU and TPO only; it would fail at the first step). For the stock "
        f"baselines use experiment={stock} trainer={trainer}"
    )


def dataset_arguments_problem(cfg, script) -> str | None:
    """A dataset's `max_length` or `min_initiating_tokens` its loading would refuse."""
    for group, datasets in (OmegaConf.select(cfg, "data") or {}).items():
        for name, dataset in datasets.items() if isinstance(datasets, DictConfig) else ():
            args = dataset.get("args") if isinstance(dataset, DictConfig) else None
            checked = {key: args[key] for key in DatasetArguments.model_fields if args and key in args}
            if problem := DatasetArguments.problem(checked, f"data.{group}.{name}.args."):
                return problem
    return None


def initiating_problem(cfg, script) -> str | None:
    """Initiating options the forget dataset would refuse (an option its strategy does not read, N < 1)."""
    problems = (
        InitiatingOptions.problem(OmegaConf.to_container(node.get("args", {}), resolve=True))
        for node in (OmegaConf.select(cfg, "data.forget") or {}).values()
        if node.get("handler") in SPAN_DATASETS
    )
    return next(filter(None, problems), None)


def peft_problem(cfg, script) -> str | None:
    """LoRA settings (`+peft=lora`) peft would refuse or that make no sense; LoRA asked of palu-eval."""
    node = cfg.get("peft")
    if node is None:
        return None
    if script == "eval":
        return (
            "+peft=lora is a training option: a LoRA run saves merged weights, which palu-eval loads as any "
            "model; drop +peft=lora"
        )
    if cfg.trainer.get("handler") == "RMU":  # it probes the reference's hidden states by module
        return (
            f"trainer={cfg.trainer.handler} reads its reference model's modules by name, which a LoRA run's "
            "reference (the model with its adapters disabled) does not expose: run it without +peft=lora"
        )
    try:
        LoraSettings.from_config(node)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def best_model_problem(cfg, script) -> str | None:
    """`best_model` (configs/best_model/) set with bad options, or on a run that does not evaluate during
    training or whose checkpoints cannot be the kept model."""
    from palu_trainer.training.best_model import SCORE, BestModelOptions

    node = cfg.get("best_model")
    if node is None:
        return None
    if not isinstance(node, DictConfig):
        return f"best_model={node!r}: choose one of its configs, +best_model=fq_at_mu_floor or fq_mu_mean"
    if problem := BestModelOptions.problem(OmegaConf.to_container(node, resolve=True), "best_model."):
        return problem
    if not cfg.get("eval"):
        return "best_model needs the framework's evaluators during training, and this run has no eval config"
    args = cfg.trainer.args
    wanted = {
        "eval_strategy": (args.get("eval_strategy"), args.get("save_strategy")),
        "load_best_model_at_end": (args.get("load_best_model_at_end"), True),
        "metric_for_best_model": (args.get("metric_for_best_model"), SCORE),
        "greater_is_better": (args.get("greater_is_better"), True),
    }
    for name, (value, needed) in wanted.items():
        if value != needed or value in (None, "no"):
            return (
                f"trainer.args.{name}={written(value)} undoes best_model, which needs {written(needed)} "
                "(keep what configs/best_model/ sets: an evaluation and a checkpoint at every epoch, "
                f"eval_on_start=true, load_best_model_at_end=true, metric_for_best_model={SCORE})"
            )
    return None


# (scripts, check): each returns the problem's message or None.
CONFIG_CHECKS = (
    (("train", "eval"), output_dir_problem),
    (("train", "eval"), model_path_problem),
    (("train",), finished_folder_problem),
    (("train",), resume_options_problem),
    (("train",), training_arguments_problem),
    (("train",), method_args_problem),
    (("train",), forget_weight_problem),
    (("train",), trainer_data_problem),
    (("train",), dataset_arguments_problem),
    (("train",), initiating_problem),
    (("train", "eval"), peft_problem),
    (("train",), best_model_problem),
)

# Settings with a real use that still surprise: warned about.
CONFIG_WARNINGS = (
    (("train",), functools.partial(forget_weight_problem, warn=True)),
    (("train",), no_training_warning),
)


def config_problems(cfg, script: str, checks=CONFIG_CHECKS) -> list[str]:
    """Every problem `checks` (or `CONFIG_WARNINGS`) finds in a composed config (with its `hydra` node)."""
    problems = [check(cfg, script) for scripts, check in checks if script in scripts]
    return [problem for problem in problems if problem]


def forget_retain_overlap(train_dataset, forget_split=None, retain_split=None) -> str | None:
    """The error for forget rows that are also retain rows (same question and answer, or same text)."""
    forget = row_keys(getattr(train_dataset, "forget", None))
    retain = row_keys(getattr(train_dataset, "retain", None))
    if not forget or not retain:
        return None
    retained = set(retain)
    shared = [row for row in forget if row in retained]
    if not shared:
        return None
    example = shared[0][0] if isinstance(shared[0], tuple) else shared[0][:80]
    splits = f"forget_split={forget_split} and retain_split={retain_split}" if forget_split else "the data"
    return (
        f"{splits} share {len(shared)} of the {len(forget)} forget rows (same question and answer, e.g. "
        f"{example!r}): the run would unlearn and retain the same rows. Use the retain split without the "
        "forget set (TOFU: forget01/retain99, forget05/retain95, forget10/retain90), or add "
        f"+{ALLOW_OVERLAP}=true to train on the overlap on purpose"
    )
