"""Local Hugging Face dataset folders: JSON lines files plus the hub README whose YAML lists the `configs`,
which `load_dataset(folder, name=config)` reads as it reads the hub repository (`TOFU_DIR`, `MUSE_DIR`)."""

from pathlib import Path

import yaml


def read_configs(directory: Path) -> dict[str, set[str]]:
    """Config names a local dataset folder offers, with their splits, from its README's YAML header."""
    return {
        config["config_name"]: set(_split_files(config.get("data_files"))) for config in _configs(directory)
    }


def missing_data_files(directory: Path, name: str, split: str = "train") -> list[str]:
    """The data files (or patterns) that config `name`'s `split` lists in the README but the folder lacks."""
    for config in _configs(directory):
        if config["config_name"] == name:
            files = _split_files(config.get("data_files")).get(split, [])
            return [pattern for pattern in files if not any(directory.glob(pattern))]
    return []


def _configs(directory: Path) -> list[dict]:
    readme = directory / "README.md"
    if not readme.is_file():
        raise FileNotFoundError(
            f"{readme} not found: a local dataset mirror needs the hub README with its `configs`"
        )
    header = readme.read_text(encoding="utf-8").split("---")
    return yaml.safe_load(header[1]).get("configs", []) if len(header) > 2 else []


def _split_files(data_files) -> dict[str, list[str]]:
    """{split: files}: `data_files` as paths is the single split `train`; as `{split, path}` entries (MUSE's
    layout), those."""
    if not (isinstance(data_files, list) and data_files and isinstance(data_files[0], dict)):
        return {"train": [data_files] if isinstance(data_files, str) else list(data_files or [])}
    splits = {}
    for entry in data_files:
        paths = entry["path"]
        splits.setdefault(entry["split"], []).extend([paths] if isinstance(paths, str) else paths)
    return splits
