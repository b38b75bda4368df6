"""Hub datasets read from local folders: `TOFU_DIR` and `MUSE_DIR` in place of their hub ids."""

import hashlib
import os
from pathlib import Path

from palu_trainer.benchmarks.hf_dir import missing_data_files, read_configs

# Hub dataset ids that an environment variable can point at a local directory with the same configs.
LOCAL_MIRRORS = {"locuslab/TOFU": "TOFU_DIR", "muse-bench/MUSE-News": "MUSE_DIR"}


def dataset_loads(cfg, trail: str = ""):
    """Yield (config path, hf_args node) for every dataset load in a composed config (few-shot ones too)."""
    from omegaconf import DictConfig, ListConfig

    for key in cfg.keys() if isinstance(cfg, DictConfig) else range(len(cfg)):
        child = cfg._get_node(key)
        if not isinstance(child, (DictConfig, ListConfig)) or child._is_interpolation():
            continue
        if str(key).endswith("hf_args") and isinstance(child, DictConfig):
            yield f"{trail}.{key}".lstrip("."), child
        else:
            yield from dataset_loads(child, f"{trail}.{key}")


def mirror_cache_dir(mirror_dir: Path) -> Path:
    """A `datasets` cache folder keyed by this mirror's path and its files' bytes: `datasets` caches a local
    folder under its base name, and would serve an edited file, or another mirror of that name, from the old
    cache."""
    import datasets

    digest = hashlib.sha1(str(mirror_dir).encode())
    for path in sorted(mirror_dir.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "palu_mirrors"
    return cache / f"{mirror_dir.name}-{digest.hexdigest()[:16]}"


def redirect_to_local_mirrors(cfg, environ=os.environ) -> list[str]:
    """Point every load of a mirrored hub dataset at its local directory and its own cache folder
    (`mirror_cache_dir`); return what changed. Fails before anything loads if a config or split is missing."""
    from omegaconf import open_dict

    redirected = []
    for hub_id, variable in LOCAL_MIRRORS.items():
        if not environ.get(variable):
            continue
        mirror_dir = Path(environ[variable]).expanduser().resolve()
        if not mirror_dir.is_dir():
            raise FileNotFoundError(
                f"{variable}={mirror_dir}: no such folder; point {variable} at a local copy of {hub_id} (its "
                "JSON files and the hub README listing the configs), or unset it to read the Hub"
            )
        available = read_configs(mirror_dir)
        cache_dir = None
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
            missing = missing_data_files(mirror_dir, name, split)
            if missing:
                raise FileNotFoundError(
                    f"{variable}={mirror_dir}: the README lists config {name!r} (split {split!r}, needed by "
                    f"{where}) in {missing}, which the folder lacks. Copy the file(s) there or drop the "
                    "config from the README"
                )
            cache_dir = cache_dir or mirror_cache_dir(mirror_dir)
            with open_dict(hf_args):
                hf_args.path = str(mirror_dir)
                hf_args.cache_dir = str(cache_dir)
            redirected.append(f"{where}: {name}")
    return redirected


def caching_local_folders_by_content(cfg) -> list[str]:
    """Give every load of a local dataset folder in `cfg` that names no cache folder its own
    (`mirror_cache_dir`), so that an edited file, or another folder of the same name, is read afresh rather
    than served from the cache of the first; return the loads changed."""
    from omegaconf import open_dict

    changed = []
    for where, hf_args in dataset_loads(cfg):
        folder = Path(str(hf_args.get("path", ""))).expanduser()
        if hf_args.get("cache_dir") or not folder.is_dir():
            continue
        with open_dict(hf_args):
            hf_args.cache_dir = str(mirror_cache_dir(folder.resolve()))
        changed.append(where)
    return changed


def hub_hint(error: BaseException, environ=os.environ) -> str | None:
    """What to do when a mirrored hub dataset cannot be reached and its variable is unset (offline)."""
    text = str(error)
    for hub_id, variable in LOCAL_MIRRORS.items():
        if hub_id in text and not environ.get(variable):
            return (
                f"{hub_id} could not be loaded ({text.strip().splitlines()[0]}). Offline, set "
                f"{variable}=/path to a local copy of it (its JSON files and the hub README listing the "
                "configs)"
            )
    return None
