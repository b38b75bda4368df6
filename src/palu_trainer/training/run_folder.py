"""What a training run's output folder holds, read and tidied: its final weights (an earlier run's removed
before a new run trains into the folder), the staging folder of a checkpoint being written, the failed mark
(`FAILED_RUN_FILE`, written by `crashes.mark_crashed` and the run guard), and checkpoint rotation on
transformers 4.x and 5.x."""

import json
from pathlib import Path

from palu_trainer.training.crashes import FAILED_RUN_FILE

FINAL_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
    "pytorch_model*.bin",
)
STAGING_DIR = "palu-checkpoint-staging"  # a checkpoint being written, renamed when whole
FINISHED_LOOKING = (*FINAL_WEIGHTS, "config.json", "generation_config.json")


def final_weights(folder) -> list[str]:
    return sorted({path.name for pattern in FINAL_WEIGHTS for path in Path(folder).glob(pattern)})


def remove_stale_weights(output_dir: str) -> list[str]:
    """Delete an earlier run's final weights from `output_dir` before training into it: the framework writes
    them only after the last step, so an interrupted run would leave the old model beside its new
    checkpoints, looking finished."""
    stale = final_weights(output_dir)
    for name in stale:
        (Path(output_dir) / name).unlink()
    return stale


def failed_run_problem(key: str, folder) -> str | None:
    path = Path(folder) / FAILED_RUN_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    when = f" at step {record['step']}" if record.get("step") is not None else ""
    return (
        f"{key}={folder} is a failed run's folder ({FAILED_RUN_FILE}: {record['reason']}{when}); it holds no "
        f"finished model. {record.get('next', '')}".rstrip()
    )


def rotate_checkpoints(trainer, output_dir: str) -> None:
    """Delete `output_dir`'s oldest checkpoints beyond `save_total_limit`, as the Trainer does after a save:
    its method `_rotate_checkpoints` up to transformers 4.x, the function `trainer_utils.rotate_checkpoints`
    that 5.x replaced it with."""
    if hasattr(trainer, "_rotate_checkpoints"):
        trainer._rotate_checkpoints(use_mtime=False, output_dir=output_dir)
        return
    from transformers.trainer_utils import rotate_checkpoints as rotate

    rotate(
        output_dir=output_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
    )
