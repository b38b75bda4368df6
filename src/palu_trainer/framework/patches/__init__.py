"""Every change this plugin makes at run time to the framework's or a library's behaviour: the one place
that patches (docs/layout.md). `patch_framework_script` wraps the framework script's loaders (`get_model`,
`get_data`, `load_trainer`) in every run, under src/train.py as under palu-train; `patch_palu_train_script`
adds what only palu-train does (resuming, run stats).
Each patch says what needs it; `INTERFACES` lists what they rely on, which tests/framework/test_patches.py
checks on every tested stack.
"""

import atexit
import functools
import logging
import os

import torch
import transformers

from palu_trainer.framework import lora
from palu_trainer.framework.checkout import imported_checkout
from palu_trainer.framework.patches.adapters import (
    merging_adapter_checkpoints,
    training_with_adapters,
    with_adapters,
)
from palu_trainer.framework.patches.wrapping import loader_wrapper
from palu_trainer.training import crashes
from palu_trainer.training.resume import CHECKPOINT_GLOBALS
from palu_trainer.training.run_guard import RunStopped

logger = logging.getLogger(__name__)

STOCK_TRAINER = "palu_trainer_stock_trainer"  # a noting subclass's framework class
PATCHED = "palu_trainer_patched"  # set on a framework script's module once its loaders are wrapped
READING_MIRRORS = "palu_trainer_reads_mirrors"  # set once its data and evaluators read TOFU_DIR, MUSE_DIR

# (what is patched, overridden or called, the leading parameters relied on): the framework's as at d3d7cf9,
# 4ad738a and c3301d8, transformers' 4.45 to 5.5, DeepSpeed's 0.15 to 0.18, Hydra's 1.3
INTERFACES = (
    ("model.get_model", ("model_cfg",)),
    ("data.get_data", ("data_cfg", "mode")),
    ("evals.get_evaluators", ("eval_cfgs",)),
    ("trainer.load_trainer", ("trainer_cfg", "model", "train_dataset")),  # then tokenizer or processing_class
    ("trainer.TRAINER_REGISTRY", None),
    ("trainer.unlearn.grad_diff.GradDiff._prepare_ref_model", ("self", "model")),
    ("transformers.Trainer.create_optimizer", ("self",)),
    ("transformers.Trainer.training_step", ("self", "model", "inputs")),
    ("transformers.Trainer.save_model", ("self", "output_dir", "_internal_call")),
    ("transformers.Trainer._save_checkpoint", ("self", "model", "trial")),
    ("transformers.Trainer._get_output_dir", ("self", "trial")),
    ("transformers.TrainerCallback.on_pre_optimizer_step", ("self", "args", "state", "control")),
    (
        "deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator"
        ".release_sub_module",
        ("self", "submodule"),
    ),
    ("hydra._internal.hydra.Hydra.get_mode", ("self", "config_name", "overrides")),
    (
        "hydra._internal.config_loader_impl.ConfigLoaderImpl.load_configuration",
        ("self", "config_name", "overrides", "run_mode"),
    ),
)


def allowing_checkpoint_globals() -> None:
    """Let torch's weights-only `torch.load` (its default from torch 2.6) read the checkpoint files that
    resuming loads: transformers 4.45's numpy RNG state (later transformers allowlist these numpy types
    themselves) and DeepSpeed 0.15's optimizer state, which it loads with torch's defaults. Exactly
    `resume.CHECKPOINT_GLOBALS`, those that this environment has."""
    import importlib

    allowed = []
    for name in CHECKPOINT_GLOBALS:
        module, _, attribute = name.rpartition(".")
        try:
            allowed.append(getattr(importlib.import_module(module), attribute))
        except (ImportError, AttributeError):
            continue  # numpy 1's or 2's name, a DeepSpeed not installed
    torch.serialization.add_safe_globals(allowed)


@loader_wrapper
def resuming(trainer, trainer_args, checkpoint: str | None, allow_other_data: bool = False):
    """A trainer that resumes from `checkpoint` (train.py calls `train()`). Its checkpoints record the run's
    data (`provenance.CheckpointRecord`); resuming on other data is refused."""
    from palu_trainer.framework import checks, provenance

    record = provenance.run_data(trainer.train_dataset)
    trainer.add_callback(provenance.CheckpointRecord(provenance.RUN_DATA_FILE, record))
    if checkpoint is not None:
        error, warning = provenance.resume_data_problem(checkpoint, record)
        if error and not allow_other_data:
            raise checks.BadInput(error)
        if warning or error:
            logger.warning(warning or error)
        logger.info("resuming from %s", checkpoint)
        allowing_checkpoint_globals()
        trainer.train = functools.partial(trainer.train, resume_from_checkpoint=checkpoint)
    return trainer, trainer_args


@loader_wrapper
def checking_vocabulary(model, tokenizer):
    """A tokenizer that does not fit the model's vocabulary refused."""
    from palu_trainer.framework.checks import BadInput
    from palu_trainer.training.vocabulary import model_vocab_size, vocabulary_mismatch

    names = [getattr(loaded, "name_or_path", "") for loaded in (tokenizer, model)]
    error, warning = vocabulary_mismatch(len(tokenizer), model_vocab_size(model), *names)
    if error:
        raise BadInput(error)
    if warning:
        logger.warning(warning)
    return model, tokenizer


def upcast_logits_in_eval(module, args, output):
    logits = getattr(output, "logits", None)
    if not module.training and logits is not None and logits.dtype in (torch.bfloat16, torch.float16):
        output.logits = logits.float()
    return output


@loader_wrapper
def upcasting_evaluation_logits(model, tokenizer):
    """A model that returns fp32 logits in eval mode, as transformers 4.45 did: from 4.46 they keep the
    model's dtype, and the framework's metrics hand bf16 to numpy, which refuses it (docs/reproducing.md)."""
    model.register_forward_hook(upcast_logits_in_eval)
    return model, tokenizer


def finding_hub_models(get_model):
    """`get_model`, stopping in one line on a model or tokenizer hub id that is neither in the Hugging Face
    cache nor reachable (offline), before the hub client's retries (21 s and seven tracebacks)."""
    from palu_trainer.framework.checks import BadInput
    from palu_trainer.framework.model_paths import MODEL_FILES, hub_model_problem, is_local_path

    @functools.wraps(get_model)
    def load(model_cfg, *args, **kwargs):
        for part, file_name in MODEL_FILES.items():
            value = (model_cfg.get(part) or {}).get("pretrained_model_name_or_path")
            key = f"model.{part}.pretrained_model_name_or_path"
            if isinstance(value, str) and not is_local_path(value):
                if problem := hub_model_problem(key, value, file_name):
                    raise BadInput(problem)
        return get_model(model_cfg, *args, **kwargs)

    return load


def checking_data(get_data, cfg):
    """The framework's `get_data`, refusing forget rows that are also retain rows (unless allowed)."""
    from palu_trainer.framework.checks import ALLOW_OVERLAP, BadInput, forget_retain_overlap

    @functools.wraps(get_data)
    def load(*args, **kwargs):
        data = get_data(*args, **kwargs)
        problem = forget_retain_overlap(data.get("train"), cfg.get("forget_split"), cfg.get("retain_split"))
        if problem and not cfg.get(ALLOW_OVERLAP, False):
            raise BadInput(problem)
        if problem:
            logger.warning("%s=true: %s", ALLOW_OVERLAP, problem)
        if data.get("train") is not None:
            data["train"].palu_overlap_checked = True  # the guarded trainers check what no patch did
        return data

    return load


def guarding_stock_trainers() -> None:
    """The framework's registered trainers (NPO, SimNPO, GradDiff, finetune's, ...) built as
    `GuardedTrainer`s, as PALU's and TPO's are, in every run of palu-train and of the plugin's experiments:
    the run guard and the mean loss of each epoch's accumulation windows (`trainers.accumulation`) for the
    stock methods."""
    from trainer import TRAINER_REGISTRY

    from palu_trainer.framework.trainers.guarded import GuardedTrainer

    for name, trainer_class in list(TRAINER_REGISTRY.items()):
        if not issubclass(trainer_class, GuardedTrainer):
            stock = getattr(trainer_class, STOCK_TRAINER, trainer_class)
            attributes = {"__module__": stock.__module__, "__doc__": stock.__doc__}
            TRAINER_REGISTRY[name] = type(stock.__name__, (GuardedTrainer, stock), attributes)


def noting_a_sum(stock_init):
    """`stock_init`, a stock trainer's `__init__`, followed by one line when the trainer built sums its
    accumulated losses (its signature is the stock one: the options a config may give are its own)."""

    @functools.wraps(stock_init)
    def init(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        accumulation = self.args.gradient_accumulation_steps
        if getattr(self, "model_accepts_loss_kwargs", False) and accumulation > 1:
            logger.warning(
                "%s sums its loss over each window of gradient_accumulation_steps=%d micro-batches on "
                "transformers %s instead of averaging it; palu-train and palu-trainer's experiments "
                "(experiment=unlearn/tofu/npo, simnpo, graddiff) average it",
                type(self).__name__,
                accumulation,
                transformers.__version__,
            )

    return init


def noting_summed_accumulation() -> None:
    """The framework's registered trainers as the framework's own experiments run them, but for one line when
    one sums its accumulated losses: transformers 4.46 to 4.x skip dividing the loss by the accumulation
    steps for models whose forward takes `**kwargs` (Llama, Qwen, Gemma), which the stock trainers leave
    as it is (docs/method.md, "Gradient accumulation")."""
    from trainer import TRAINER_REGISTRY

    from palu_trainer.framework.trainers.accumulation import loop_sums_accumulated_losses
    from palu_trainer.framework.trainers.guarded import GuardedTrainer

    if not loop_sums_accumulated_losses():
        return
    for name, trainer_class in list(TRAINER_REGISTRY.items()):
        if issubclass(trainer_class, GuardedTrainer) or hasattr(trainer_class, STOCK_TRAINER):
            continue

        attributes = {"__init__": noting_a_sum(trainer_class.__init__), STOCK_TRAINER: trainer_class}
        attributes["__module__"] = trainer_class.__module__
        TRAINER_REGISTRY[name] = type(trainer_class.__name__, (trainer_class,), attributes)


@loader_wrapper
def with_run_stats(trainer, trainer_args):
    """A trainer with a `RunStatsCallback` on its output folder (make gpu-check: step times, peak memory),
    its process's CUDA memory capped at `PALU_CUDA_MEMORY_CAP_GIB` if set."""
    from palu_trainer.training.run_stats import MEMORY_CAP_VARIABLE, RunStatsCallback

    if (gib := os.environ.get(MEMORY_CAP_VARIABLE)) and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(gib) * 2**30 / total))
    trainer.add_callback(RunStatsCallback(trainer_args.output_dir))
    return trainer, trainer_args


@loader_wrapper
def recording_options(trainer, trainer_args, options: dict):
    """A trainer whose checkpoints record the run's `options` (`provenance.run_options`, read from the config
    before the framework's get_model pops the model path out of it), which a resume compares
    (`provenance.resume_options_problem`)."""
    from palu_trainer.framework.provenance import RUN_OPTIONS_FILE, CheckpointRecord

    trainer.add_callback(CheckpointRecord(RUN_OPTIONS_FILE, options))
    return trainer, trainer_args


@loader_wrapper
def keeping_the_best_model(trainer, trainer_args, options):
    """A trainer that scores each evaluation by the `best_model` rule of `options`
    (`training.best_model.ModelSelection`) and records which one its output folder keeps."""
    from palu_trainer.training.best_model import ModelSelection

    if not hasattr(trainer, "run_guard"):
        raise RunStopped(
            f"best_model needs a trainer of this plugin's: {type(trainer).__name__} is the framework's own "
            "under src/train.py (palu-train guards every trainer)"
        )
    trainer.model_selection = ModelSelection(options)
    trainer.add_callback(trainer.model_selection)
    return trainer, trainer_args


def stopping_on_bad_input(load):
    """`load`, whose BadInput or AnnotationError (a bad span file: file, row and fix named) stops the run with
    the message alone: under src/train.py nothing else would catch it."""
    from palu_trainer.framework.checks import BadInput
    from palu_trainer.spans.format import AnnotationError

    @functools.wraps(load)
    def checked(*args, **kwargs):
        try:
            return load(*args, **kwargs)
        except (BadInput, AnnotationError) as error:
            raise RunStopped(str(error)) from None

    return checked


def releasing_shared_memory() -> None:
    """DeepSpeed 0.15's CPU allreduce buffers (ZeRO on the CPU), which it never unlinks: this rank's at
    every exit that Python sees, and those of runs killed outright, which no live process maps, now."""
    if os.environ.get("RANK", "0") == "0" and (stale := crashes.remove_stale_shared_memory()):
        logger.warning("removed the shared-memory buffers of runs that are gone: %s", ", ".join(stale))
    atexit.register(crashes.release_shared_memory)


def reading_local_mirrors(module) -> None:
    """The running framework script's `get_data` and `get_evaluators` (`module`: train.py or eval.py, with
    any experiment, the framework's own too), pointing each hub dataset that `TOFU_DIR` or `MUSE_DIR` mirrors
    at that folder as they load (`local_mirrors.redirect_to_local_mirrors`: offline, the evaluators' 23 TOFU
    paths and the training data need no override; a mirror that lacks a split stops in one line), and reading
    every local dataset folder through a cache of its own (`datasets` keys a folder's cache by its base name
    and config alone, and would serve another folder's rows)."""
    from palu_trainer.framework.local_mirrors import (
        caching_local_folders_by_content,
        redirect_to_local_mirrors,
    )

    if getattr(module, READING_MIRRORS, False):
        return
    setattr(module, READING_MIRRORS, True)

    def redirecting(load, parameter: str):
        @functools.wraps(load)
        def loaded(*args, **kwargs):
            cfg = kwargs.get(parameter, args[0] if args else None)
            if cfg is not None:
                try:
                    for line in redirect_to_local_mirrors(cfg):
                        logger.info("local dataset mirror: %s", line)
                except FileNotFoundError as error:
                    raise RunStopped(str(error)) from None
                caching_local_folders_by_content(cfg)
            return load(*args, **kwargs)

        return loaded

    for name, parameter in (("get_data", "data_cfg"), ("get_evaluators", "eval_cfgs")):
        if hasattr(module, name):
            setattr(module, name, redirecting(getattr(module, name), parameter))


def patch_framework_script(module, cfg) -> None:
    """Wrap the loaders of the running framework script (`module`: train.py or eval.py) for the run `cfg`."""
    if getattr(module, PATCHED, False):
        return  # palu-train patches every run; a config's Hydra callback asks again
    setattr(module, PATCHED, True)
    logger.info("open-unlearning imported from %s (%s)", *imported_checkout())
    reading_local_mirrors(module)
    if hasattr(module, "load_trainer"):
        releasing_shared_memory()
    get_model = upcasting_evaluation_logits(
        checking_vocabulary(merging_adapter_checkpoints(finding_hub_models(module.get_model)))
    )
    training = hasattr(module, "load_trainer")
    if training and cfg.get("peft") is not None:
        get_model = with_adapters(get_model, lora.LoraSettings.from_config(cfg.peft))
        module.load_trainer = training_with_adapters(module.load_trainer)
    module.get_model = stopping_on_bad_input(get_model)
    if training:
        guarding_stock_trainers()
        module.get_data = stopping_on_bad_input(checking_data(module.get_data, cfg))
        from palu_trainer.framework.provenance import run_options

        module.load_trainer = recording_options(module.load_trainer, run_options(cfg))
        if cfg.get("best_model") is not None:
            from palu_trainer.training.best_model import BestModelOptions

            options = BestModelOptions.parse(cfg.best_model, "best_model.")
            module.load_trainer = keeping_the_best_model(module.load_trainer, options)


def patch_palu_train_script(module, checkpoint: str | None, allow_other_data: bool) -> None:
    """What palu-train adds to train.py (`module`) beyond `patch_framework_script`: resuming from
    `checkpoint`, run stats."""
    from palu_trainer.training.run_stats import RUN_STATS_VARIABLE

    module.load_trainer = resuming(module.load_trainer, checkpoint, allow_other_data)
    if os.environ.get(RUN_STATS_VARIABLE):
        module.load_trainer = with_run_stats(module.load_trainer)
