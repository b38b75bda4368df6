"""The framework's accelerate and DeepSpeed ZeRO-3 configs, written where a launch from any folder finds
them; DeepSpeed's CPU shared-memory op, built before a launch needs it
(`python -m palu_trainer.framework.accelerate_config`, which `make setup` runs)."""

import json
from pathlib import Path

import yaml

from palu_trainer.framework.checkout import checkout_dir


def write_accelerate_config(directory: Path, num_processes: int, bf16: bool | str = True) -> Path:
    """The framework's accelerate + ZeRO-3 configs, made launchable from any directory.

    Its accelerate config names the DeepSpeed JSON by a path relative to the checkout; this writes both
    into `directory` with an absolute path, `num_processes` and DeepSpeed's bf16 setting (`auto` follows
    TrainingArguments, as CPU runs need).
    """
    source = checkout_dir() / "configs" / "accelerate"
    deepspeed = json.loads((source / "zero_stage3_offload_config.json").read_text())
    deepspeed["bf16"]["enabled"] = bf16
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "zero3.json").write_text(json.dumps(deepspeed, indent=2))
    accelerate = yaml.safe_load((source / "default_config.yaml").read_text())
    accelerate["deepspeed_config"]["deepspeed_config_file"] = str((directory / "zero3.json").resolve())
    accelerate["num_processes"] = num_processes
    (directory / "accelerate.yaml").write_text(yaml.safe_dump(accelerate))
    return directory / "accelerate.yaml"


def shared_memory_op_dir() -> Path | None:
    """The folder where torch builds DeepSpeed's CPU shared-memory op (its `lock` file marks a build under
    way, or a killed one); None where the accelerator has no such op (CUDA)."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    return None if builder is None else Path(_get_build_directory(builder.name, verbose=False))


def build_shared_memory_op() -> Path | None:
    """Build DeepSpeed's CPU shared-memory op, or find it built: every ZeRO-3 launch on the CPU loads it, and
    the first one compiles it (about a minute) while the other ranks wait. Returns its folder."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return None
    builder.load()
    return shared_memory_op_dir()


if __name__ == "__main__":
    built = build_shared_memory_op()
    print(f"DeepSpeed's CPU shared-memory op: {built or 'none for this accelerator'}")
