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
    stale = sorted({path for pattern in FINAL_WEIGHTS for path in Path(output_dir).glob(pattern)})
    for path in stale:
        path.unlink()
    return [path.name for path in stale]
