"""Which checkpoint `trainer.args.resume_from_checkpoint` names, refused before anything loads if it cannot
resume this run or holds a pickled reference that a checkpoint does not need."""

import hashlib
import json
from pathlib import Path

NO_OPTIMIZER_STATE = "holds no optimizer state"
# What a resumable checkpoint's pickled files hold besides tensors and containers: the numpy RNG state the
# Trainer saves (`rng_state*.pth`), DeepSpeed's loss scaler and ZeRO stage (`global_step*/*optim_states.pt`).
# torch >= 2.6 loads with its weights-only unpickler, which refuses any other class or function; these are
# allowed to it (`patches.allowing_checkpoint_globals`) and nothing else, and a file naming any other one is
# refused before anything loads it (`checkpoint_problem`): unpickling a class the unpickler may call can run
# code.
CHECKPOINT_GLOBALS = (
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)
PICKLED_SUFFIXES = (".pt", ".pth", ".bin")
NOT_LOADED_TO_RESUME = ("training_args.bin",)  # the Trainer writes it and never reads it back


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
            elif path.suffix in PICKLED_SUFFIXES and not zipfile.is_zipfile(path):
                raise ValueError("not a complete torch.save file")
        except Exception as error:  # noqa: BLE001 (any failure to read it is the damage reported)
            return f"{path.relative_to(checkpoint)} is damaged ({error}); the checkpoint cannot be resumed"
        if path.suffix in PICKLED_SUFFIXES and path.name not in NOT_LOADED_TO_RESUME:
            if unexpected := unexpected_globals(path):
                return (
                    f"{path.relative_to(checkpoint)} names {', '.join(unexpected)}, which no checkpoint of a "
                    "run needs and which loading could run as code: refused, nothing was loaded. Resume only "
                    "from checkpoints your own runs wrote"
                )
    return None


def unexpected_globals(path: Path) -> list[str]:
    """The classes and functions the pickled file `path` refers to beyond `CHECKPOINT_GLOBALS`, read from
    its pickle opcodes without running them."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    return sorted(set(get_unsafe_globals_in_checkpoint(path)) - set(CHECKPOINT_GLOBALS))


def resumed_model_problem(checkpoint: str | None, model_path: str | None) -> str | None:
    """The error for a run that resumes from the checkpoint it also names as its model, else None: the
    model path is the reference unlearning started from."""
    if checkpoint and model_path and Path(model_path).resolve() == Path(checkpoint).resolve():
        return (
            f"resuming loads {checkpoint} itself; keep model.model_args.pretrained_model_name_or_path at "
            "the model unlearning started from (the reference)"
        )
    return None


SAMPLE_BYTES = 4096


def weights_fingerprint(model: str) -> str | None:
    """sha1 of a local model folder's weights, sampled: each weights file's safetensors header (names,
    shapes, dtypes, offsets) and `SAMPLE_BYTES` at the start, middle and end of every tensor; two models of
    one shape differ there unless almost all their weights are equal. None for a hub id or a folder without
    safetensors weights."""
    folder = Path(model).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    files = [path for path in files if path.name.startswith(("model", "adapter_model"))]
    if not files:
        return None
    digest = hashlib.sha1()
    for path in files:
        with path.open("rb") as file:
            header_size = int.from_bytes(file.read(8), "little")
            header = file.read(header_size)
            digest.update(header)
            for name, entry in sorted(json.loads(header).items()):
                if name == "__metadata__":
                    continue
                start, end = entry["data_offsets"]
                for offset in sorted({start, (start + end) // 2, max(start, end - SAMPLE_BYTES)}):
                    file.seek(8 + header_size + offset)
                    digest.update(file.read(min(SAMPLE_BYTES, end - offset)))
    return digest.hexdigest()
