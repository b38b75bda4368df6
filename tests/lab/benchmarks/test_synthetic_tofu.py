"""The synthetic benchmark: TOFU's configs and fields, gold spans on the revealed facts, determinism."""

import json

import datasets
import pytest

from palu_lab.benchmarks.synthetic_tofu import TEMPLATES, generate, render, revealed_facts
from palu_trainer.benchmarks.hf_dir import read_configs
from palu_trainer.spans.format import read_annotations, validate_annotations

# Every config the stock TOFU evaluation and finetune/unlearn experiments load for forget10.
STOCK_CONFIGS = {
    "full",
    "forget10",
    "forget10_perturbed",
    "retain90",
    "holdout10",
    "retain_perturbed",
    "real_authors_perturbed",
    "world_facts_perturbed",
}


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("synthetic"), num_authors=20, forget_percents=(10,), seed=3)


def rows(directory, name):
    return [json.loads(line) for line in (directory / f"{name}.json").read_text().splitlines()]


def test_configs_load_like_tofu(benchmark):
    assert STOCK_CONFIGS <= set(read_configs(benchmark))
    for name in read_configs(benchmark):
        loaded = datasets.load_dataset(str(benchmark), name=name, split="train")
        assert len(loaded) == len(rows(benchmark, name)) > 0
    perturbed = rows(benchmark, "forget10_perturbed")[0]
    assert set(perturbed) == {
        "question",
        "answer",
        "paraphrased_answer",
        "perturbed_answer",
        "paraphrased_question",
    }
    assert set(rows(benchmark, "world_facts_perturbed")[0]) == {"question", "answer", "perturbed_answer"}


def test_splits_partition_the_trained_authors_and_holdout_is_never_trained(benchmark):
    full, forget, retain = (rows(benchmark, name) for name in ("full", "forget10", "retain90"))
    assert len(forget) == 2 * len(TEMPLATES)  # 10% of 20 authors
    assert retain + forget == full
    trained_questions = {row["question"] for row in full}
    assert not trained_questions & {row["question"] for row in rows(benchmark, "holdout10")}
    assert {row["question"] for row in rows(benchmark, "retain_perturbed")} <= {
        row["question"] for row in retain
    }


def test_perturbed_answers_are_five_distinct_wrong_versions_of_the_paraphrase(benchmark):
    for row in rows(benchmark, "forget10_perturbed"):
        assert len(set(row["perturbed_answer"])) == 5
        assert row["paraphrased_answer"] not in row["perturbed_answer"]
        assert row["paraphrased_answer"] != row["answer"] or row["paraphrased_question"] != row["question"]


def test_gold_spans_fit_the_forget_answers_and_mark_facts_absent_from_the_question(benchmark):
    forget = rows(benchmark, "forget10")
    annotation_rows = read_annotations(benchmark / "span_annotations" / "forget10.jsonl")
    spans = validate_annotations(annotation_rows, [row["answer"] for row in forget], source="generated")
    assert all(spans), "every synthetic answer reveals at least one fact"
    for row, row_spans in zip(forget, spans, strict=True):
        for start, end in row_spans:
            assert row["answer"][start:end] not in row["question"]


def test_render_reports_the_character_spans_of_sensitive_fields():
    text, spans = render(
        "{name} was born in {city}, {country}.",
        {"name": "Ana B", "city": "Porto", "country": "PT"},
        {"city", "country"},
    )
    assert text == "Ana B was born in Porto, PT."
    assert [text[start:end] for start, end in spans] == ["Porto", "PT"]
    assert revealed_facts(TEMPLATES[1], TEMPLATES[1].answers[0]) == {"city", "country"}


def test_same_seed_same_files_other_seed_other_authors(tmp_path):
    first, second, other = (
        generate(tmp_path / name, 12, seed=seed) for name, seed in (("a", 1), ("b", 1), ("c", 2))
    )
    for path in first.glob("*.json"):
        assert path.read_bytes() == (second / path.name).read_bytes()
    assert (first / "full.json").read_bytes() != (other / "full.json").read_bytes()
