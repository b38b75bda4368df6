"""The framework's loaders (`get_model`, `get_data`, `load_trainer`) wrapped: `patch_framework_script` for
every run; `resuming`, `averaging_accumulated_losses` and `guarding` by palu-train, for the stock trainers."""

import functools
import logging

import torch
from omegaconf import open_dict

from palu_trainer.framework import lora
from palu_trainer.training.resume import allow_numpy_rng_state
from palu_trainer.training.run_guard import RunStopped

logger = logging.getLogger(__name__)

PATCHED = "palu_trainer_patched"  # set on a framework script's module once its loaders are wrapped


def loader_wrapper(step):
    """`step(first, second, *options)` -> `wrapper(load, *options)`: the framework's `load` (`get_model` or
    `load_trainer`, each returning a pair), whose pair goes through `step`."""

    @functools.wraps(step)
    def wrapper(load, *options):
        @functools.wraps(load)
        def loaded(*args, **kwargs):
            return step(*load(*args, **kwargs), *options)

        return loaded

    return wrapper


@loader_wrapper
def resuming(trainer, trainer_args, checkpoint: str | None, allow_other_data: bool = False):
    """A trainer that resumes from `checkpoint` (train.py calls `train()`). Its checkpoints record the run's
    data (`checks.CheckpointRecord`); resuming on other data is refused."""
    from palu_trainer.framework import checks

    record = checks.run_data(trainer.train_dataset)
    trainer.add_callback(checks.CheckpointRecord(checks.RUN_DATA_FILE, record))
    if checkpoint is not None:
        error, warning = checks.resume_data_problem(checkpoint, record)
        if error and not allow_other_data:
            raise checks.BadInput(error)
        if warning or error:
            logger.warning(warning or error)
        logger.info("resuming from %s", checkpoint)
        allow_numpy_rng_state()
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
        return data

    return load


@loader_wrapper
def averaging_accumulated_losses(trainer, trainer_args):
    """A trainer that divides each micro-batch's loss by the accumulation steps, as transformers 4.45 did:
    4.51 skips it for Llama, Qwen and Gemma, and the unlearning losses, means per micro-batch, would then grow
    with the accumulation steps (docs/setup.md, "Gradient accumulation on upstream main")."""
    if getattr(trainer, "model_accepts_loss_kwargs", False):
        trainer.model_accepts_loss_kwargs = False
        logger.info("loss divided by gradient_accumulation_steps per micro-batch (a mean per micro-batch)")
    return trainer, trainer_args


@loader_wrapper
def guarding(trainer, trainer_args, argv: list[str]):
    """A guarded trainer (`protect_run`; PALU's and TPO's guard themselves): the stock trainers
    under palu-train too."""
    from palu_trainer.framework.trainers.guarded import protect_run

    if trainer_args.do_train:
        protect_run(trainer, argv)
    return trainer, trainer_args


def merging_adapter_checkpoints(get_model):
    """The framework's `get_model`, which for a LoRA run's checkpoint (the adapter only) loads the base model
    its adapter_config.json names and merges the adapter in: a plain model, as from the run's final folder,
    where transformers alone would attach the adapter unmerged, its dropout in training mode."""

    @functools.wraps(get_model)
    def load(model_cfg, *args, **kwargs):
        checkpoint = model_cfg.model_args.get("pretrained_model_name_or_path")
        base = lora.adapter_checkpoint_base(checkpoint)
        if base is None:
            return get_model(model_cfg, *args, **kwargs)
        from peft import PeftModel

        with open_dict(model_cfg):
            model_cfg.model_args.pretrained_model_name_or_path = base
        model, tokenizer = load(model_cfg, *args, **kwargs)  # a base that is a LoRA checkpoint is merged too
        merged = PeftModel.from_pretrained(model, checkpoint).merge_and_unload()
        # adapters trained on the merged model name the checkpoint as their base, not the model under it
        merged.name_or_path = merged.config.name_or_path = checkpoint
        logger.info("LoRA checkpoint %s: its adapter merged into its base model %s", checkpoint, base)
        return merged.eval(), tokenizer

    return load


@loader_wrapper
def with_adapters(model, tokenizer, settings):
    """A model with LoRA adapters (`+peft=lora`), refused with the reason when they cannot fit it."""
    from palu_trainer.framework.checks import BadInput

    problem = lora.adapter_problem(model, settings)
    if problem:
        raise BadInput(problem)
    return lora.add_adapters(model, settings), tokenizer


def training_with_adapters(load_trainer):
    """The framework's `load_trainer` for a LoRA run: a reference without a second copy, the optimizer without
    empty parameter groups, and a final save of the merged weights with the adapter beside them."""
    from palu_trainer.framework.trainers.guarded import use_non_reentrant_checkpointing

    @functools.wraps(load_trainer)
    def load(*args, **kwargs):
        with lora.reference_without_copy():
            trainer, trainer_args = load_trainer(*args, **kwargs)
        # the stock methods too: reentrant checkpointing gives ZeRO-3 two gradients per parameter and step
        use_non_reentrant_checkpointing(trainer.args)
        if trainer.is_deepspeed_enabled and trainer.args.gradient_checkpointing:
            lora.keeping_frozen_weights_through_recompute()
        return lora.saving_merged(lora.without_empty_parameter_groups(trainer)), trainer_args

    return load


@loader_wrapper
def recording_options(trainer, trainer_args, cfg):
    """A trainer whose checkpoints record the run's method options (`checks.run_options`), which a resume
    compares (`checks.resume_options_problem`)."""
    from palu_trainer.framework.checks import RUN_OPTIONS_FILE, CheckpointRecord, run_options

    trainer.add_callback(CheckpointRecord(RUN_OPTIONS_FILE, run_options(cfg)))
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


def patch_framework_script(module, cfg) -> None:
    """Wrap the loaders of the running framework script (`module`: train.py or eval.py) for the run `cfg`."""
    if getattr(module, PATCHED, False):
        return  # palu-train patches every run; a config's Hydra callback asks again
    setattr(module, PATCHED, True)
    get_model = upcasting_evaluation_logits(
        checking_vocabulary(merging_adapter_checkpoints(module.get_model))
    )
    training = hasattr(module, "load_trainer")
    if training and cfg.get("peft") is not None:
        get_model = with_adapters(get_model, lora.LoraSettings.from_config(cfg.peft))
        module.load_trainer = training_with_adapters(module.load_trainer)
    module.get_model = stopping_on_bad_input(get_model)
    if training:
        module.get_data = stopping_on_bad_input(checking_data(module.get_data, cfg))
        module.load_trainer = recording_options(module.load_trainer, cfg)
