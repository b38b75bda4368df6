import argparse
import json
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from palu_lab.tiny import save_tiny_model, train_bpe_tokenizer

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


TESTS = Path(__file__).resolve().parent
STACK_INDEPENDENT = ("method", "perf", "lab", "test_docs.py", "test_layout.py", "test_validation.py")


def pytest_collection_modifyitems(items):
    """`needs_shared` follows the fixtures: a test reads ../shared directly or through another fixture.
    `stack_independent` follows the folder (pyproject.toml's markers say what each means).

    The files with the most minutes of `slow` tests come first, each file's tests in their order: `make test`
    hands whole files to its two workers in this order (`--dist loadfile`), so the long files start early
    and the short ones fill in, rather than one worker finishing a long file alone at the end."""
    for item in items:
        if "shared_dir" in item.fixturenames:
            item.add_marker(pytest.mark.needs_shared)
        if item.path.relative_to(TESTS).parts[0] in STACK_INDEPENDENT:
            item.add_marker(pytest.mark.stack_independent)
    minutes = defaultdict(float)
    for item in items:
        minutes[item.path] += slow_minutes(item)
    items.sort(key=lambda item: -minutes[item.path])  # stable: file order and test order otherwise kept


def slow_minutes(item) -> float:
    """About how long a `slow` test takes in `make test` on 2 cores, fixtures included: its marker's
    `minutes` (`@pytest.mark.slow(minutes=5)`, the tests of several minutes), else half a minute; 0 for the
    rest."""
    marker = item.get_closest_marker("slow")
    return 0.0 if marker is None else marker.kwargs.get("minutes", 0.5)


def unavailable(message: str):
    """A test's data or model is not here: fail in CI (`CI` set), else skip with the reason."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared (TOFU and GPT-4o spans): required in CI, skipped with a reason in a user's clone."""
    path = Path(os.environ.get("PALU_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
    if not (path / "data" / "tofu" / "README.md").is_file():
        unavailable(f"TOFU data not found at {path}/data/tofu (set PALU_SHARED to the shared/ folder)")
    return path


@pytest.fixture(scope="session")
def muse_news_dir(shared_dir) -> Path:
    """../shared/data/muse_news, a partial MUSE-News in the hub's layout."""
    path = shared_dir / "data" / "muse_news"
    if not (path / "README.md").is_file():
        unavailable(f"MUSE-News data not found at {path}")
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


# Llama-3's pre-tokenizer split (tokenizer.json of meta-llama/Meta-Llama-3-8B).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _trained_spec(tokenizer: Tokenizer, texts, trainer) -> dict:
    """The trained tokenizer's JSON, for options the trainer cannot set (ignore_merges, byte fallback)."""
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return json.loads(tokenizer.to_str())


def llama3_style_tokenizer(texts, vocab_size=2048) -> PreTrainedTokenizerFast:
    """Llama-3's layout: its split regex, ByteLevel without its own regex, BPE with ignore_merges."""
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    spec = _trained_spec(tokenizer, texts, trainer)
    spec["model"]["ignore_merges"] = True
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=eos,
        pad_token=eos,
        clean_up_tokenization_spaces=False,
    )


def sentencepiece_style_tokenizer(texts, vocab_size=2048) -> PreTrainedTokenizerFast:
    """Llama-2's layout: "▁" for spaces and a "▁" prefix (Metaspace), BPE with byte fallback (<0xNN>)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    spec = _trained_spec(tokenizer, texts, trainer)
    for byte in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    spec["pre_tokenizer"]["split"] = False  # as Llama-2's converted tokenizer: pieces never cross a "▁"
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Metaspace(prepend_scheme="first", split=False), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        clean_up_tokenization_spaces=False,
    )


TOKENIZER_STYLES = {
    "byte-level": train_bpe_tokenizer,
    "sentencepiece": sentencepiece_style_tokenizer,
    "llama3": llama3_style_tokenizer,
}


@pytest.fixture(scope="session", params=list(TOKENIZER_STYLES))
def any_tokenizer(request, tofu_rows):
    """The project's byte-level BPE, a Llama-2-style (SentencePiece) and a Llama-3-style tokenizer."""
    texts = [row["question"] + "\n" + row["answer"] for row in tofu_rows]
    return TOKENIZER_STYLES[request.param](texts, vocab_size=2048)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tofu_rows):
    texts = [row["question"] + "\n" + row["answer"] for row in tofu_rows]
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), texts, vocab_size=2048)


def tied_and_untied_models(tmp_path_factory, tofu_rows, vocabulary: int) -> dict[bool, Path]:
    """Tiny Llamas at a real model's |V| (a TOFU-trained BPE filled up with unused tokens), keyed by whether
    their output embeddings are tied."""
    texts = [row["question"] + "\n" + row["answer"] for row in tofu_rows]
    return {
        tied: save_tiny_model(
            tmp_path_factory.mktemp(f"vocabulary-{vocabulary}-tied-{tied}"),
            texts,
            padded_vocab_size=vocabulary,
            tie_word_embeddings=tied,
        )
        for tied in (True, False)
    }


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


@pytest.fixture(scope="module")
def tofu_mirror(tmp_path_factory, tofu_dir):
    """A TOFU_DIR of the shared TOFU with a holdout01 (which TOFU lacks) of 40 retain rows."""
    placeholder_holdout = read_jsonl(tofu_dir / "retain99.json")[:40]
    return make_tofu_mirror(tmp_path_factory.mktemp("tofu"), tofu_dir, {"holdout01": placeholder_holdout})


EVAL_ROWS = 4


@pytest.fixture(scope="session")
def small_tofu_mirror(tmp_path_factory, tofu_dir):
    """forget01 and every evaluation set cut to EVAL_ROWS rows (retain99 rows stand in for holdout01)."""
    replaced = {
        name: read_jsonl(tofu_dir / f"{name}.json")[:EVAL_ROWS]
        for name in ("forget01", "forget01_perturbed", "retain_perturbed")
        + ("real_authors_perturbed", "world_facts_perturbed")
    }
    retain = read_jsonl(tofu_dir / "retain99.json")
    replaced |= {"holdout01": retain[:EVAL_ROWS], "retain99": retain[EVAL_ROWS : 2 * EVAL_ROWS]}
    return make_tofu_mirror(tmp_path_factory.mktemp("small-tofu"), tofu_dir, replaced)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="session")
def fast_results(tmp_path_factory) -> Path:
    """One results/ folder for the FAST TOFU miniature's tests. Original and Retain are finetuned and
    evaluated here, before any of those tests, so each finds them in results/.cache whatever the order."""
    from palu_lab import miniature

    results = tmp_path_factory.mktemp("results")
    parser = argparse.ArgumentParser()
    miniature.add_arguments(parser)
    args = miniature.parse_arguments(
        parser, ["--fast", "--results", str(results), "--jobs", "2"], "references"
    )
    progress = miniature.start_run("tofu", args.data, args.size, args.run_dir, stages=0)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        references = miniature.tofu_miniature(args, progress, pool)
        references.original_eval.result(), references.retain_eval.result()
    return results
