import json
import os
from pathlib import Path

import pytest
import yaml

from palu_trainer.experiments.tiny import save_tiny_model, train_bpe_tokenizer

TAG_TEMPLATE = {
    "apply_chat_template": False,
    "user_start_tag": "Question: ",
    "user_end_tag": "\n",
    "asst_start_tag": "Answer:\n",
    "asst_end_tag": "\n",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared (TOFU and GPT-4o spans): required in CI, skipped with a reason in a user's clone."""
    path = Path(os.environ.get("PALU_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
    if not (path / "data" / "tofu" / "README.md").is_file():
        message = f"TOFU data not found at {path}/data/tofu (set PALU_SHARED to the shared/ folder)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def tofu_dir(shared_dir) -> Path:
    return shared_dir / "data" / "tofu"


@pytest.fixture(scope="session")
def tofu_rows(tofu_dir):
    return [json.loads(line) for line in (tofu_dir / "full.json").read_text().splitlines()]


@pytest.fixture(scope="session")
def tokenizer(tofu_rows):
    texts = [row["question"] + "\n" + row["answer"] for row in tofu_rows]
    return train_bpe_tokenizer(texts, vocab_size=2048)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tofu_rows):
    texts = [row["question"] + "\n" + row["answer"] for row in tofu_rows]
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), texts, vocab_size=2048)


def make_tofu_mirror(mirror: Path, tofu_dir: Path, replaced: dict[str, list[dict]]) -> Path:
    """A TOFU_DIR: the shared TOFU files; `replaced` configs are added or overridden with the given rows."""
    header = yaml.safe_load((tofu_dir / "README.md").read_text().split("---")[1])
    configs = {config["config_name"]: config for config in header["configs"]}
    mirror.mkdir(parents=True, exist_ok=True)
    for source in tofu_dir.glob("*.json"):
        (mirror / source.name).symlink_to(source)
    for name, rows in replaced.items():
        (mirror / f"{name}.json").unlink(missing_ok=True)
        write_jsonl(mirror / f"{name}.json", rows)
        configs[name] = {"config_name": name, "data_files": f"{name}.json"}
    header["configs"] = list(configs.values())
    (mirror / "README.md").write_text("---\n" + yaml.safe_dump(header) + "---\n")
    return mirror


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="session")
def fast_results(tmp_path_factory) -> Path:
    """One results/ folder for the FAST miniature's tests: its .cache holds Original and Retain, made once."""
    return tmp_path_factory.mktemp("results")
