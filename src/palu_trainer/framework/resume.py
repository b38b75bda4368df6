"""Which checkpoint `trainer.args.resume_from_checkpoint` names, refused before anything loads if it cannot
resume this run."""

from pathlib import Path


def checkpoint_to_resume(resume_from_checkpoint, output_dir: str) -> str | None:
    """The checkpoint folder `trainer.args.resume_from_checkpoint` names, checked to hold optimizer state.

    `true` means the last `checkpoint-N` in `output_dir`. Fails before anything loads when there is none,
    or when the checkpoint holds only the model (`save_only_model=true`), which cannot resume training.
    """
    from transformers.trainer_utils import get_last_checkpoint

    if resume_from_checkpoint in (None, False, "", "false", "False"):
        return None
    if resume_from_checkpoint in (True, "true", "True"):
        last = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        if last is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=true: no checkpoint-N folder in {output_dir}; name one"
            )
        resume_from_checkpoint = last
    checkpoint = Path(resume_from_checkpoint)
    if not (checkpoint / "trainer_state.json").is_file():
        raise FileNotFoundError(
            f"resume_from_checkpoint={checkpoint}: not a Trainer checkpoint (no trainer_state.json)"
        )
    if not ((checkpoint / "optimizer.pt").is_file() or any(checkpoint.glob("global_step*"))):
        raise ValueError(
            f"resume_from_checkpoint={checkpoint} holds no optimizer state (saved with save_only_model=true, "
            "the framework's default): it cannot resume. Save checkpoints with "
            "trainer.args.save_only_model=false (PALU's config does)"
        )
    return str(checkpoint)


def resumed_model_problem(checkpoint: str | None, model_path: str | None) -> str | None:
    """The error for a run that resumes from the checkpoint it also names as its model, else None: the
    model path is the reference unlearning started from."""
    if checkpoint and model_path and Path(model_path).resolve() == Path(checkpoint).resolve():
        return (
            f"resuming loads {checkpoint} itself; keep model.model_args.pretrained_model_name_or_path at "
            "the model unlearning started from (the reference)"
        )
    return None
