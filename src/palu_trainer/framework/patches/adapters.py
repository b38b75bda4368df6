"""The patches that LoRA runs need (`peft` adapters on the framework's models): the adapter added at load,
a LoRA checkpoint's adapter merged into its base, the reference as the adapted model with its adapters off,
and the merged save."""

import contextlib
import functools
import logging
from pathlib import Path

import torch
from omegaconf import open_dict

from palu_trainer.framework import lora
from palu_trainer.framework.patches.wrapping import loader_wrapper

logger = logging.getLogger(__name__)


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
        with reference_without_copy():
            trainer, trainer_args = load_trainer(*args, **kwargs)
        # the stock methods too: reentrant checkpointing gives ZeRO-3 two gradients per parameter and step
        use_non_reentrant_checkpointing(trainer.args)
        if trainer.is_deepspeed_enabled and trainer.args.gradient_checkpointing:
            keeping_frozen_weights_through_recompute()
        return saving_merged(without_empty_parameter_groups(trainer)), trainer_args

    return load


@contextlib.contextmanager
def reference_without_copy():
    """While a trainer is built inside this block, the framework's `GradDiff._prepare_ref_model` (which every
    method with a reference calls, PALU's and TPO's included) returns an adapted model's `AdaptersDisabled`
    instead of a deep copy."""
    from trainer.unlearn.grad_diff import GradDiff

    prepare = GradDiff._prepare_ref_model

    def prepare_reference(self, model):
        if not lora.is_adapted(model):
            return prepare(self, model)
        logger.info("reference: the model with its LoRA adapters disabled (no second copy)")
        return lora.AdaptersDisabled(model)

    GradDiff._prepare_ref_model = prepare_reference
    try:
        yield
    finally:
        GradDiff._prepare_ref_model = prepare


def without_empty_parameter_groups(trainer):
    """`trainer.create_optimizer`, whose optimizer keeps only parameter groups with trainable parameters.

    With LoRA the Trainer's group of parameters without weight decay is empty (every adapter is a weight
    matrix). DeepSpeed's ZeRO-3 optimizer drops empty groups while the learning rate scheduler keeps one rate
    per group: its first step failed with "zip() argument 2 is longer than argument 1".
    """
    create_optimizer = trainer.create_optimizer

    @functools.wraps(create_optimizer)
    def create():
        optimizer = create_optimizer()
        optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
        return optimizer

    trainer.create_optimizer = create
    return trainer


def keeping_frozen_weights_through_recompute() -> None:
    """Make ZeRO-3 keep a LoRA run's small frozen weights gathered while a checkpointed block is recomputed.

    torch's non-reentrant checkpoint holds the frozen weights the recompute saves (RMSNorm's, not behind
    DeepSpeed's linear function) by reference; ZeRO-3's post-forward hook frees them in place and the backward
    finds them empty: "Recomputed values ... have different metadata ... torch.Size([0])" on the first step
    (fixed after DeepSpeed 0.19; the framework pins 0.15.4). Only weights ZeRO-3 already keeps (below
    `stage3_param_persistence_threshold`, 10 x hidden by default: the norms) are kept: no memory is lost.
    """
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator,
        iter_params,
    )
    from deepspeed.utils import z3_leaf_module

    release = PartitionedParameterCoordinator.release_sub_module
    if getattr(release, "keeps_frozen_weights", False):
        return

    @functools.wraps(release)
    def release_sub_module(self, submodule, *args, **kwargs):
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass: no recompute
            return release(self, submodule, *args, **kwargs)
        kept = [
            parameter
            for parameter in iter_params(submodule, recurse=z3_leaf_module(submodule))
            if parameter.ds_persist and not parameter.requires_grad and not parameter.is_external_param
        ]
        for parameter in kept:  # the release loop leaves external parameters gathered
            parameter.is_external_param = True
        try:
            return release(self, submodule, *args, **kwargs)
        finally:
            for parameter in kept:
                parameter.is_external_param = False

    release_sub_module.keeps_frozen_weights = True
    PartitionedParameterCoordinator.release_sub_module = release_sub_module


def saving_merged(trainer):
    """`trainer.save_model`, whose final save (not a checkpoint's) writes the merged weights and the tokenizer
    to the output folder and the adapter to `adapter/` beside them."""
    save_model = trainer.save_model

    @functools.wraps(save_model)
    def save(output_dir=None, _internal_call=False):
        if _internal_call:  # a checkpoint: transformers' own (the adapter, the optimizer state)
            return save_model(output_dir, _internal_call)
        output_dir = Path(output_dir or trainer.args.output_dir)
        wrapped = trainer.deepspeed if trainer.is_deepspeed_enabled else trainer.model
        state = trainer.accelerator.get_state_dict(wrapped)  # gathered on every rank's call under ZeRO-3
        if not trainer.args.should_save:
            return None
        adapted = trainer.accelerator.unwrap_model(trainer.model)
        adapted.save_pretrained(output_dir / lora.ADAPTER_DIR, state_dict=state)
        lora.base_model(adapted).save_pretrained(
            output_dir, state_dict=lora.merged_state_dict(state, adapted)
        )
        tokenizer = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(trainer.args, output_dir / "training_args.bin")
        logger.info("merged weights saved to %s, the LoRA adapter to %s", output_dir, lora.ADAPTER_DIR)
        return None

    trainer.save_model = save
    return trainer
