"""An earlier run's final weights, deleted before training into its output folder."""

from pathlib import Path

FINAL_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
    "pytorch_model*.bin",
)


def remove_stale_weights(output_dir: str) -> list[str]:
    """Delete an earlier run's final weights from `output_dir` before training into it.

    The framework writes them only after the last step: left in place, an interrupted run would leave
    the old model beside its new checkpoints, looking finished.
    """
    stale = final_weights(output_dir)
    for name in stale:
        (Path(output_dir) / name).unlink()
    return stale


def final_weights(folder) -> list[str]:
    """The names of the final weights a finished run saved in `folder`."""
    return sorted({path.name for pattern in FINAL_WEIGHTS for path in Path(folder).glob(pattern)})
