"""Launching the framework's runs, the one way the recipes and the lab do it: `palu-train` or `palu-eval` as
a command line, alone or under accelerate with the framework's ZeRO-3 configs (written where a launch from
any folder finds them; the lab runs them logged to a file, palu_lab.logged_runs); DeepSpeed's CPU
shared-memory op, built before a launch needs it (`python -m palu_trainer.framework.launch`, which `make
setup` runs)."""

import json
import socket
import sys
from pathlib import Path

import yaml

from palu_trainer.framework.checkout import checkout_dir


def write_accelerate_config(directory: Path, num_processes: int, bf16: bool | str = True) -> Path:
    """The framework's accelerate + ZeRO-3 configs in `directory`, launchable from any folder: the DeepSpeed
    JSON named by its absolute path (the framework's is relative to the checkout), with `num_processes` and
    DeepSpeed's bf16 setting (`auto` follows TrainingArguments, as CPU runs need)."""
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


BIN = Path(sys.executable).parent  # where the venv has palu-train, palu-eval and accelerate


def command(tool: str, accelerate_config: Path | None = None) -> list[str]:
    """`tool` (palu-train, palu-eval) as a command line, under `accelerate launch` with that config (one
    process per GPU it names) when given."""
    if accelerate_config is None:
        return [str(BIN / tool)]
    accelerate = [str(BIN / "accelerate"), "launch", "--config_file", str(accelerate_config)]
    return [*accelerate, "--main_process_port", str(free_port()), str(BIN / tool)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def shared_memory_op_dir(build: bool = False) -> Path | None:
    """Where torch builds DeepSpeed's CPU shared-memory op (a `lock` file there: a build under way or killed),
    built first with `build`: every ZeRO-3 launch on the CPU loads it, the first compiling it (a minute)
    while the other ranks wait. None where the accelerator has no such op (CUDA)."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return None
    if build:
        builder.load()
    return Path(_get_build_directory(builder.name, verbose=False))


if __name__ == "__main__":
    built = shared_memory_op_dir(build=True)
    print(f"DeepSpeed's CPU shared-memory op: {built or 'none for this accelerator'}")
