"""Which checkpoint `trainer.args.resume_from_checkpoint` names, refused before anything loads if it cannot
resume this run; what torch >= 2.6 must allow for transformers 4.45 to resume one."""

import json
from pathlib import Path

NO_OPTIMIZER_STATE = "holds no optimizer state"


def checkpoint_to_resume(resume_from_checkpoint, output_dir: str, report=None) -> str | None:
    """The checkpoint folder `trainer.args.resume_from_checkpoint` names, checked whole
    (`checkpoint_problem`).

    `true` means the newest complete `checkpoint-N` in `output_dir`; each newer one it skips is passed to
    `report` (a logger's method) with the reason. Fails before anything loads when there is none, or when the
    named checkpoint is incomplete or damaged, naming the file and the newest complete checkpoint.
    """
    if resume_from_checkpoint in (None, False, "", "false", "False"):
        return None
    if resume_from_checkpoint in (True, "true", "True"):
        candidates = checkpoints_newest_first(output_dir)
        if not candidates:
            raise FileNotFoundError(
                f"resume_from_checkpoint=true: no checkpoint-N folder in {output_dir}; name one"
            )
        skipped = []
        for checkpoint in candidates:
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                for name, why in skipped if report else []:
                    report(f"resume_from_checkpoint=true: skipped {name}: {why}; resuming from {checkpoint}")
                return str(checkpoint)
            skipped.append((checkpoint.name, problem))
        raise FileNotFoundError(
            f"resume_from_checkpoint=true: no complete checkpoint in {output_dir} ("
            + "; ".join(f"{name}: {why}" for name, why in skipped)
            + ")"
        )
    checkpoint = Path(resume_from_checkpoint)
    problem = checkpoint_problem(checkpoint)
    if problem is None:
        return str(checkpoint)
    newest = next(
        (other for other in checkpoints_newest_first(checkpoint.parent) if checkpoint_problem(other) is None),
        None,
    )
    hint = f"; the newest complete checkpoint is {newest}" if newest else ""
    if problem.startswith(NO_OPTIMIZER_STATE):
        raise ValueError(f"resume_from_checkpoint={checkpoint} {problem}{hint}")
    raise FileNotFoundError(f"resume_from_checkpoint={checkpoint}: {problem}{hint}")


def checkpoints_newest_first(folder) -> list[Path]:
    numbered = [path for path in Path(folder).glob("checkpoint-*") if path.name.split("-")[-1].isdigit()]
    return sorted(
        (path for path in numbered if path.is_dir()), key=lambda path: -int(path.name.split("-")[-1])
    )


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot resume a run: not a checkpoint, half-written (a save killed midway), saved
    without optimizer state, or a file in it damaged (read as far as its header or zip directory: cheap)."""
    import zipfile

    from safetensors import safe_open

    state = checkpoint / "trainer_state.json"
    if not state.is_file():
        return "not a Trainer checkpoint (no trainer_state.json; a save killed midway leaves one like this)"
    if not ((checkpoint / "optimizer.pt").is_file() or any(checkpoint.glob("global_step*"))):
        return (
            f"{NO_OPTIMIZER_STATE} (saved with save_only_model=true, the framework's default): it cannot "
            "resume. Save checkpoints with trainer.args.save_only_model=false (PALU's config does)"
        )
    for path in sorted(checkpoint.rglob("*")):
        try:
            if path.name.endswith(".json"):
                json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                with safe_open(str(path), "pt"):
                    pass
            elif path.suffix in (".pt", ".pth", ".bin") and not zipfile.is_zipfile(path):
                raise ValueError("not a complete torch.save file")
        except Exception as error:  # noqa: BLE001 (any failure to read it is the damage reported)
            return f"{path.relative_to(checkpoint)} is damaged ({error}); the checkpoint cannot be resumed"
    return None


def resumed_model_problem(checkpoint: str | None, model_path: str | None) -> str | None:
    """The error for a run that resumes from the checkpoint it also names as its model, else None: the
    model path is the reference unlearning started from."""
    if checkpoint and model_path and Path(model_path).resolve() == Path(checkpoint).resolve():
        return (
            f"resuming loads {checkpoint} itself; keep model.model_args.pretrained_model_name_or_path at "
            "the model unlearning started from (the reference)"
        )
    return None


def allow_numpy_rng_state() -> None:
    """Let transformers 4.45 read a checkpoint's `rng_state.pth` under torch >= 2.6, whose `torch.load`
    defaults to weights_only=True and rejects the numpy RNG state the Trainer saved (later transformers
    allowlist these same numpy types)."""
    import numpy
    import torch

    torch.serialization.add_safe_globals(
        [numpy._core.multiarray._reconstruct, numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]
    )
