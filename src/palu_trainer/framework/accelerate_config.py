"""The framework's accelerate and DeepSpeed ZeRO-3 configs, written where a launch from any folder finds
them."""

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
