"""What torch >= 2.6's `weights_only` loading must allow for transformers 4.45 to resume a checkpoint."""


def allow_numpy_rng_state() -> None:
    """Let transformers 4.45 read a checkpoint's `rng_state.pth` under torch >= 2.6.

    Its `torch.load` now defaults to weights_only=True, which rejects the numpy RNG state the Trainer
    saved; later transformers allowlist these same numpy types.
    """
    import numpy
    import torch

    numpy_types = [
        numpy._core.multiarray._reconstruct,
        numpy.ndarray,
        numpy.dtype,
        type(numpy.dtype(numpy.uint32)),
    ]
    torch.serialization.add_safe_globals(numpy_types)
