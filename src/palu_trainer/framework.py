"""The one place that touches open-unlearning: its checkout, its registries, Hydra, entry points.

open-unlearning is not a package: its `src/` holds top-level modules (`data`, `trainer`, `train`…)
that its scripts import after Python puts `src/` on the path. We do the same, register PALU's
classes into its registries and run its own `train.py`/`eval.py` `main` under a Hydra app that
first points `locuslab/TOFU` loads at a local mirror when `TOFU_DIR` is set.
"""

import importlib
import logging
import os
import sys
from pathlib import Path

import yaml

logger = logging.getLogger(__name__)

PINNED_COMMIT = "d3d7cf9e6b3c125d16687d4232680d8d83548f1a"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = PROJECT_ROOT / "configs"
# Where `make setup` records the checkout it used, per Python environment.
CHECKOUT_RECORD = Path(sys.prefix) / "etc" / "palu_trainer" / "open-unlearning-dir"
DEFAULT_CHECKOUT = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "palu-trainer" / "open-unlearning"
)
# Hub dataset ids that an environment variable can point at a local directory with the same configs.
LOCAL_MIRRORS = {"locuslab/TOFU": "TOFU_DIR"}


def checkout_dir() -> Path:
    """OPEN_UNLEARNING_DIR, else the checkout `make setup` recorded, else the default cache dir."""
    if os.environ.get("OPEN_UNLEARNING_DIR"):
        return Path(os.environ["OPEN_UNLEARNING_DIR"]).expanduser().resolve()
    if CHECKOUT_RECORD.is_file():
        return Path(CHECKOUT_RECORD.read_text().strip())
    return DEFAULT_CHECKOUT


def ensure_importable() -> Path:
    """Put the checkout's `src/` on sys.path (as its scripts do) and return that directory."""
    src = checkout_dir() / "src"
    if not (src / "trainer" / "unlearn" / "base.py").is_file():
        raise RuntimeError(
            f"open-unlearning not found at {src.parent}. Run `make setup`, or set "
            "OPEN_UNLEARNING_DIR to a checkout of https://github.com/locuslab/open-unlearning "
            f"(commit {PINNED_COMMIT})."
        )
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    return src


def register() -> None:
    """Add PALU's dataset, collator and trainer to open-unlearning's registries (idempotent)."""
    ensure_importable()
    import data
    import trainer
    from omegaconf import OmegaConf

    from palu_trainer.data import DataCollatorWithTokenRoles, QAwithSpansDataset
    from palu_trainer.trainer import PALUTrainer

    data._register_data(QAwithSpansDataset)
    data._register_collator(DataCollatorWithTokenRoles)
    trainer._register_trainer(PALUTrainer)
    OmegaConf.register_new_resolver("palu_root", lambda: str(PROJECT_ROOT), replace=True)


def mirror_configs(mirror_dir: Path) -> set[str]:
    """Config names a local dataset directory offers, from its README's Hugging Face YAML header."""
    readme = mirror_dir / "README.md"
    if not readme.is_file():
        raise FileNotFoundError(
            f"{readme} not found: a local dataset mirror needs the hub README with its `configs`"
        )
    header = readme.read_text(encoding="utf-8").split("---")
    configs = yaml.safe_load(header[1]).get("configs", []) if len(header) > 2 else []
    return {config["config_name"] for config in configs}


def dataset_loads(cfg, trail: str = ""):
    """Yield (config path, hf_args node) for every dataset load in a composed config."""
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
        if key == "hf_args" and isinstance(child, DictConfig):
            yield f"{trail}.{key}".lstrip("."), child
        else:
            yield from dataset_loads(child, f"{trail}.{key}")


def redirect_to_local_mirrors(cfg, environ=os.environ) -> list[str]:
    """Point every load of a mirrored hub dataset at its local directory; return what changed.

    Fails before anything loads when the directory lacks a config some load needs.
    """
    redirected = []
    for hub_id, variable in LOCAL_MIRRORS.items():
        if not environ.get(variable):
            continue
        mirror_dir = Path(environ[variable]).expanduser().resolve()
        available = mirror_configs(mirror_dir)
        for where, hf_args in dataset_loads(cfg):
            if hf_args.get("path") != hub_id:
                continue
            name = hf_args.get("name")
            if name not in available:
                raise FileNotFoundError(
                    f"{variable}={mirror_dir} has no dataset config {name!r}, needed by {where}. "
                    f"It offers: {', '.join(sorted(available))}. Add that split to the mirror or "
                    "drop the metric/dataset that needs it."
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
    import json

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
