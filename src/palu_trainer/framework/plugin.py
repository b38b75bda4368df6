"""Top floor: PALU's classes in open-unlearning's registries, local dataset mirrors, entry points.

`palu-train` and `palu-eval` run the framework's own `train.py`/`eval.py` `main` under a Hydra app that
first registers PALU and points hub dataset loads at local mirrors (`TOFU_DIR`, `MUSE_DIR`).
"""

import importlib
import json
import logging
import os
from pathlib import Path

import yaml

from palu_trainer.benchmarks.hf_dir import read_configs
from palu_trainer.framework.checkout import PROJECT_ROOT, checkout_dir, ensure_importable

logger = logging.getLogger(__name__)

# Hub dataset ids that an environment variable can point at a local directory with the same configs.
LOCAL_MIRRORS = {"locuslab/TOFU": "TOFU_DIR", "muse-bench/MUSE-News": "MUSE_DIR"}


def register() -> None:
    """Add PALU's dataset, collator and trainer to open-unlearning's registries (idempotent)."""
    ensure_importable()
    import data
    import trainer
    from omegaconf import OmegaConf

    from palu_trainer.framework.datasets import (
        DataCollatorWithTokenRoles,
        PretrainingWithSpansDataset,
        QAwithSpansDataset,
    )
    from palu_trainer.framework.trainers.palu import PALUTrainer

    data._register_data(QAwithSpansDataset)
    data._register_data(PretrainingWithSpansDataset)
    data._register_collator(DataCollatorWithTokenRoles)
    trainer._register_trainer(PALUTrainer)
    OmegaConf.register_new_resolver("palu_root", lambda: str(PROJECT_ROOT), replace=True)


def trainer_config(name: str):
    """The composed config `trainer=<name>` (the framework's or this plugin's): handler, method_args."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(checkout_dir() / "configs"), version_base=None):
        return compose(config_name="unlearn.yaml", overrides=[f"trainer={name}", "task_name=config"]).trainer


def dataset_loads(cfg, trail: str = ""):
    """Yield (config path, hf_args node) for every dataset load in a composed config (few-shot ones too)."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(cfg, DictConfig):
        items = [(key, cfg._get_node(key)) for key in cfg.keys()]
    elif isinstance(cfg, ListConfig):
        items = [(index, cfg._get_node(index)) for index in range(len(cfg))]
    else:
        return
    for key, child in items:
        if not isinstance(child, (DictConfig, ListConfig)) or child._is_interpolation():
            continue
        if str(key).endswith("hf_args") and isinstance(child, DictConfig):
            yield f"{trail}.{key}".lstrip("."), child
        else:
            yield from dataset_loads(child, f"{trail}.{key}")


def redirect_to_local_mirrors(cfg, environ=os.environ) -> list[str]:
    """Point every load of a mirrored hub dataset at its local directory; return what changed.

    Fails before anything loads when the directory lacks a config or split some load needs.
    """
    redirected = []
    for hub_id, variable in LOCAL_MIRRORS.items():
        if not environ.get(variable):
            continue
        mirror_dir = Path(environ[variable]).expanduser().resolve()
        available = read_configs(mirror_dir)
        for where, hf_args in dataset_loads(cfg):
            if hf_args.get("path") != hub_id:
                continue
            name, split = hf_args.get("name"), hf_args.get("split", "train")
            if name not in available or split not in available[name]:
                missing = f"config {name!r}" + (f" with split {split!r}" if name in available else "")
                offered = ", ".join(
                    f"{config}/{'|'.join(sorted(splits))}" for config, splits in available.items()
                )
                raise FileNotFoundError(
                    f"{variable}={mirror_dir} has no dataset {missing}, needed by {where}. It offers: "
                    f"{offered}. Add that split to the mirror or drop the metric/dataset that needs it."
                )
            hf_args.path = str(mirror_dir)
            redirected.append(f"{where}: {name}")
    return redirected


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


def _run_framework_script(script: str, config_name: str) -> None:
    import hydra

    src = ensure_importable()
    register()
    framework_main = importlib.import_module(script).main.__wrapped__

    @hydra.main(version_base=None, config_path=str(src.parent / "configs"), config_name=config_name)
    def main(cfg):
        for line in redirect_to_local_mirrors(cfg):
            logger.info("local dataset mirror: %s", line)
        framework_main(cfg)

    main()


def train_main() -> None:
    """`palu-train`: open-unlearning's train.py, with PALU registered and its configs visible."""
    _run_framework_script("train", "train.yaml")


def eval_main() -> None:
    """`palu-eval`: open-unlearning's eval.py, likewise."""
    _run_framework_script("eval", "eval.yaml")
