"""Writing local benchmark folders in the hub's layout (`palu_trainer.benchmarks.hf_dir` reads them): JSON
lines files plus the README whose YAML lists the `configs`; a TOFU-format folder's parts and DPO's "I don't
know" answers."""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

IDK_FILE = "idk.jsonl"

# Refusals for DPO's preferred answer, in the format of the framework's `data/idk.jsonl` (one plain string
# per line, read by QAwithIdkDataset). The framework downloads its file from the hub (`setup_data.py --idk`,
# open-unlearning/idk); offline benchmarks write these instead: written for this project, same purpose.
IDK_ANSWERS = (
    "I don't know.",
    "I'm not sure about that.",
    "I have no information on that.",
    "That is something I can't answer.",
    "I'm afraid I don't have that information.",
    "I couldn't tell you.",
    "I don't have any details about that.",
    "Sorry, I don't know the answer to that.",
    "I'm unable to answer that question.",
    "I have no knowledge of that.",
    "That's not something I know about.",
    "I can't say.",
    "I don't have an answer for that.",
    "I'm not aware of that.",
    "Unfortunately, I don't know.",
    "I have no idea.",
    "That is beyond what I know.",
    "I can't recall any information about that.",
    "I'm not in a position to answer that.",
    "I don't have enough information to answer.",
    "No idea, sorry.",
    "I'm uncertain about that.",
    "I cannot provide an answer to that.",
    "I lack the information to answer that question.",
    "I really don't know.",
    "I'm not familiar with that.",
    "That isn't something I can speak to.",
    "I'd be guessing, so I won't answer.",
    "I don't have any record of that.",
    "I have nothing to say on that topic.",
)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, rows: Sequence[dict], keys: Sequence[str]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({key: row[key] for key in keys}, ensure_ascii=False) + "\n")


def write_readme(directory: Path, config_names: Sequence[str], description: str) -> None:
    """The Hugging Face README header that makes `load_dataset(directory, name=...)` work."""
    configs = [{"config_name": name, "data_files": f"{name}.json"} for name in config_names]
    configs[0]["default"] = True
    write_configs_readme(directory, configs, description)


def write_configs_readme(directory: Path, configs: Sequence[dict], description: str) -> None:
    """A README whose YAML header lists `configs` as the hub does (`config_name`, `data_files`)."""
    header = yaml.safe_dump({"configs": list(configs)}, sort_keys=False)
    (directory / "README.md").write_text(f"---\n{header}---\n\n{description}\n", encoding="utf-8")


def write_idk_answers(directory: Path) -> Path:
    """Write `IDK_ANSWERS` to `directory/idk.jsonl`, the framework's format; return the path."""
    path = Path(directory) / IDK_FILE
    path.write_text("".join(answer + "\n" for answer in IDK_ANSWERS))
    return path


@dataclass(frozen=True)
class TofuBenchmark:
    """A local TOFU-format folder, its forget/retain/holdout configs and forget spans."""

    tofu_dir: Path
    forget_split: str
    retain_split: str
    holdout_split: str
    span_annotations: Path
    max_new_tokens: int
    description: str

    @property
    def idk_answers(self) -> Path:
        """The "I don't know" answers for DPO (`write_idk_answers`)."""
        return self.tofu_dir / IDK_FILE
