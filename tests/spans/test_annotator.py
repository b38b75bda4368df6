import json
import re
from pathlib import Path

import pytest

from palu_trainer.spans import annotator
from palu_trainer.spans.agreement import Agreement, span_agreement, word_agreement
from palu_trainer.spans.annotator import (
    CONTENT,
    VERB,
    Background,
    annotate,
    annotate_answer,
    classify,
    is_no_information,
    load_qa_rows,
    phrase_evidence,
    tokenize,
)
from palu_trainer.spans.cli import main as annotate_main
from palu_trainer.spans.format import fingerprint, read_annotations, validate_annotations, write_annotations
from palu_trainer.spans.tpo_spans import read_tpo

from ..conftest import write_jsonl

SHIPPED = Path(__file__).resolve().parents[2] / "span_annotations"
# Each forget split is annotated against the retain split that leaves its authors out.
BACKGROUND_SPLIT = {"forget01": "retain99", "forget05": "retain95", "forget10": "retain90"}
# Measured: word-token F1 0.801 (precision 0.783, recall 0.819) against GPT-4o on forget05.
FORGET05_WORD_F1 = 0.801

ANSWERS = ["Ann Lee was born in Oslo in 1990.", "She wrote Blue Rivers."]
REFERENCE = [[(0, 7), (20, 24)], [(10, 21)]]  # "Ann Lee", "Oslo"; "Blue Rivers"
CANDIDATE = [[(0, 3), (20, 24), (28, 32)], []]  # "Ann", "Oslo", "1990"
SMALL_BACKGROUND = [
    "The author wrote many books about the history of science.",
    "She was born in a small town and studied at a university.",
    "They explore the sea and they explore the sky.",
]


def tpo_rows(answers, spans):
    return [
        {"index": i, "answer": answer, "spans": [{"start": s, "end": e, "text": answer[s:e]} for s, e in row]}
        for i, (answer, row) in enumerate(zip(answers, spans))
    ]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        annotate_main(list(argv))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_word_agreement_counts_words_touched_by_spans():
    # reference words Ann, Lee, Oslo, Blue, Rivers; candidate words Ann, Oslo, 1990
    agreement = word_agreement(ANSWERS, REFERENCE, CANDIDATE)
    assert (agreement.true_positives, agreement.false_positives, agreement.false_negatives) == (2, 1, 3)
    assert agreement.precision == pytest.approx(2 / 3)
    assert agreement.recall == pytest.approx(2 / 5)
    assert agreement.f1 == pytest.approx(0.5)


def test_span_agreement_needs_exact_offsets():
    agreement = span_agreement(REFERENCE, CANDIDATE)  # only "Oslo" matches; "Ann" is not "Ann Lee"
    assert (agreement.precision, agreement.recall, agreement.f1) == pytest.approx((1 / 3, 1 / 3, 1 / 3))


def test_a_partial_span_marks_the_whole_word():
    assert word_agreement(["Oslo"], [[(0, 4)]], [[(1, 2)]]).f1 == 1.0
    assert span_agreement([[(0, 4)]], [[(1, 2)]]).f1 == 0.0


def test_agreement_without_any_span_is_zero_not_an_error():
    assert Agreement(0, 0, 0).f1 == 0.0
    assert str(Agreement(1, 1, 0)) == "precision 0.500  recall 1.000  F1 0.667"


def test_score_cli_takes_the_answers_from_a_tpo_reference(tmp_path, capsys):
    reference = write_jsonl(tmp_path / "reference.jsonl", tpo_rows(ANSWERS, REFERENCE))
    write_annotations(tmp_path / "candidate.jsonl", ANSWERS, CANDIDATE)
    code, out, _ = run_cli(capsys, "score", "--reference", str(reference), str(tmp_path / "candidate.jsonl"))
    assert code == 0
    assert "word tokens  precision 0.667  recall 0.400  F1 0.500" in out
    assert "exact spans  precision 0.333  recall 0.333  F1 0.333" in out


def test_score_cli_on_two_annotation_files_needs_the_dataset(tmp_path, capsys):
    write_annotations(tmp_path / "reference.jsonl", ANSWERS, REFERENCE)
    write_annotations(tmp_path / "candidate.jsonl", ANSWERS, CANDIDATE)
    files = ["--reference", str(tmp_path / "reference.jsonl"), str(tmp_path / "candidate.jsonl")]
    code, _, err = run_cli(capsys, "score", *files)
    assert code == 1
    assert "pass --dataset" in err
    dataset = write_jsonl(tmp_path / "qa.jsonl", [{"question": "?", "answer": answer} for answer in ANSWERS])
    code, out, _ = run_cli(capsys, "score", *files, "--dataset", str(dataset))
    assert code == 0
    assert "F1 0.500" in out


@pytest.mark.parametrize(
    ("spans", "fingerprinted", "message"),
    [
        ([[], [], []], ["a", "other", "c"], r"bad.jsonl row 1: answer fingerprint differs"),
        ([[], [], [(0, 9)]], ["a", "b", "c"], r"bad.jsonl row 2: span \[0, 9\) is out of range"),
        ([[], []], ["a", "b"], r"bad.jsonl: 2 annotation rows but the dataset has 3 rows"),
    ],
)
def test_validate_cli_names_the_row_on_stderr(tmp_path, capsys, spans, fingerprinted, message):
    dataset = write_jsonl(tmp_path / "qa.jsonl", [{"question": "?", "answer": a} for a in ["a", "b", "c"]])
    rows = [
        {"index": i, "answer_sha1": fingerprint(answer), "spans": [list(span) for span in row_spans]}
        for i, (answer, row_spans) in enumerate(zip(fingerprinted, spans))
    ]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    code, out, err = run_cli(capsys, "validate", "--dataset", str(dataset), str(bad))
    assert code == 1
    assert out == ""
    assert err.startswith("palu-annotate validate: ")
    assert re.search(message, err)


def test_validate_cli_accepts_a_matching_file(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "qa.jsonl", [{"question": "?", "answer": a} for a in ANSWERS])
    write_annotations(tmp_path / "good.jsonl", ANSWERS, REFERENCE)
    code, out, _ = run_cli(capsys, "validate", "--dataset", str(dataset), str(tmp_path / "good.jsonl"))
    assert (code, out) == (0, f"{tmp_path / 'good.jsonl'}: 2 rows match the dataset\n")


@pytest.mark.parametrize(
    "answer",
    [
        "There is no publicly available information about Isabel Martínez's marital status.",
        "It's not publicly documented what specific faith or beliefs Tomas Ferrand holds to.",
        "The details about any upcoming books from Iselin Bergstrøm are currently not available.",
        "Tomas Ferrand's relationship status is currently undisclosed to the public eye.",
    ],
)
def test_answers_without_information_are_detected(answer):
    assert is_no_information(answer)


@pytest.mark.parametrize(
    "answer",
    [
        "There is no publicly available information on his age, but his first work appeared when he was 30.",
        "There are no known pen names for Ilse Marenbeek; she has always published under her birth name.",
        '"Mai\'s Mythology" deciphered Vietnamese myths that were previously unknown to the larger public.',
        "Hina Ameen was born in Karachi, Pakistan.",
    ],
)
def test_answers_that_state_something_are_not_no_information(answer):
    assert not is_no_information(answer)


def test_no_information_answers_are_annotated_empty_on_purpose():
    background = Background(SMALL_BACKGROUND)
    answer = "There is no publicly available information about Isabel Martínez's marital status."
    assert annotate_answer("Is the author married?", answer, background) == []
    # the same sentence stating a fact is annotated: the name is no span only because nothing is known
    stated = "Isabel Martínez's marital status is public: she married in Oslo."
    spans = annotate_answer("Is the author married?", stated, background)
    assert [stated[s:e] for s, e in spans] == ["Isabel Martínez", "Oslo"]


def test_titles_numbers_and_names_are_spans_but_the_subject_named_in_the_question_is_not():
    background = Background(SMALL_BACKGROUND)
    answer = 'Ann Lee wrote "Blue Rivers" in 1990 at the University of Oslo, mentored by Dr. Josh Axe.'
    spans = annotate_answer("What did Ann Lee write?", answer, background)
    assert [answer[s:e] for s, e in spans] == ["Blue Rivers", "1990", "University of Oslo", "Dr. Josh Axe"]
    asked_otherwise = annotate_answer("Who wrote Blue Rivers?", answer, background)
    assert answer[slice(*asked_otherwise[0])] == "Ann Lee"


def test_dates_join_and_possessive_subjects_drop():
    background = Background(SMALL_BACKGROUND)
    answer = "Moshe Ben-David's father, born on 05/25/1930 in Tel Aviv, was a bank manager."
    spans = annotate_answer("Who was Moshe Ben-David's father?", answer, background)
    assert [answer[s:e] for s, e in spans] == ["05/25/1930", "Tel Aviv", "bank manager"]


def marked(question: str, answer: str) -> list[str]:
    """The texts the annotator marks in `answer`, with SMALL_BACKGROUND as background."""
    return [
        answer[start:end] for start, end in annotate_answer(question, answer, Background(SMALL_BACKGROUND))
    ]


@pytest.mark.parametrize(
    ("question", "answer", "expected"),
    [
        (  # quantities keep their ranges and approximators
            "How often does she publish?",
            "Approximately 30 years old, she published a book every 18 to 24 months since the early 1980s.",
            ["Approximately 30 years old", "18 to 24 months", "early 1980s"],
        ),
        (  # a count is no fact
            "Which books did she write?",
            "Two notable works are Blue Rivers and Red Hills.",
            ["Blue Rivers", "Red Hills"],
        ),
        (  # praise and person nouns are not part of the fact
            "What did his parents do?",
            "He was born to a hard-working roofer father and a renowned author.",
            ["roofer"],
        ),
    ],
)
def test_what_is_part_of_a_fact(question, answer, expected):
    assert marked(question, answer) == expected


def test_compounds_are_not_verbs_but_a_participle_after_a_noun_is():
    background = Background(SMALL_BACKGROUND)
    tokens = tokenize("Her novels explore film-related themes on online platforms selling her work.")
    kinds = dict(zip((token.text for token in tokens), classify(tokens, [], background)))
    assert (kinds["explore"], kinds["film-related"], kinds["themes"]) == (VERB, CONTENT, CONTENT)
    assert (kinds["platforms"], kinds["selling"], kinds["work"]) == (CONTENT, VERB, CONTENT)


def test_items_listed_with_a_kept_phrase_need_less_evidence(monkeypatch):
    answer = "They explore exile, urban displacement, and resilience."
    assert marked("What themes?", answer) == ["urban displacement", "resilience"]
    monkeypatch.setattr(annotator, "WEIGHT_COORDINATED_WITH_KEPT", 0.0)
    assert marked("What themes?", answer) == ["urban displacement"]


def test_phrases_after_the_first_sentence_need_more_evidence():
    background = Background(SMALL_BACKGROUND)
    tokens = tokenize("She studied geology. She studied geology.")
    first, later = (phrase_evidence(tokens, [position], background) for position in (2, 6))
    assert later - first == pytest.approx(annotator.WEIGHT_AFTER_FIRST_SENTENCE)
    assert later < first


def test_annotations_do_not_depend_on_the_order_of_the_background(tofu_dir):
    rows = [json.loads(line) for line in (tofu_dir / "forget01.json").read_text().splitlines()]
    background = [json.loads(line) for line in (tofu_dir / "retain99.json").read_text().splitlines()]
    texts = [f"{row['question']}\n{row['answer']}" for row in background]
    first = annotate(rows, Background(texts))
    assert first == annotate(rows, Background(reversed(texts)))
    assert sum(map(len, first)) > 100


@pytest.mark.parametrize("split", sorted(BACKGROUND_SPLIT))
def test_shipped_annotations_validate_against_tofu(tofu_dir, capsys, split):
    shipped = SHIPPED / f"tofu_{split}.jsonl"
    code, out, err = run_cli(capsys, "validate", "--dataset", str(tofu_dir), "--name", split, str(shipped))
    assert code == 0, err
    rows = len((tofu_dir / f"{split}.json").read_text().splitlines())
    assert out == f"{shipped}: {rows} rows match the dataset\n"


@pytest.mark.parametrize("split", sorted(BACKGROUND_SPLIT))
def test_shipped_annotations_are_what_the_annotator_makes(tofu_dir, tmp_path, capsys, split):
    out = tmp_path / f"{split}.jsonl"
    dataset = ["--dataset", str(tofu_dir), "--name", split]
    background = ["--background", str(tofu_dir), "--background-name", BACKGROUND_SPLIT[split]]
    code, _, err = run_cli(capsys, "annotate", *dataset, *background, "--out", str(out))
    assert code == 0, err
    assert out.read_bytes() == (SHIPPED / f"tofu_{split}.jsonl").read_bytes()


def test_shipped_forget05_keeps_no_information_rows_empty(tofu_dir):
    answers = [row["answer"] for row in load_qa_rows(str(tofu_dir), "forget05")]
    spans = validate_annotations(read_annotations(SHIPPED / "tofu_forget05.jsonl"), answers, "forget05")
    empty = [index for index, row_spans in enumerate(spans) if not row_spans]
    assert [index for index in empty if is_no_information(answers[index])] == [47, 50, 57]


def test_forget05_agreement_with_gpt4o_does_not_regress(shared_dir):
    answers, gpt4o = read_tpo(shared_dir / "data" / "tofu_spans_gpt4o" / "forget05.jsonl")
    spans = validate_annotations(read_annotations(SHIPPED / "tofu_forget05.jsonl"), answers, "forget05")
    agreement = word_agreement(answers, gpt4o, spans)
    assert agreement.f1 >= FORGET05_WORD_F1 - 0.01
    assert min(agreement.precision, agreement.recall) >= 0.7


def test_annotate_cli_on_a_json_lines_file_uses_the_dataset_as_background(tmp_path, capsys):
    rows = [
        {"question": "Where was Ann Lee born?", "answer": "Ann Lee was born in Oslo."},
        {"question": "Has she siblings?", "answer": "There is no public information about that."},
    ]
    dataset = write_jsonl(tmp_path / "qa.jsonl", rows)
    out = tmp_path / "spans.jsonl"
    code, printed, _ = run_cli(capsys, "annotate", "--dataset", str(dataset), "--out", str(out))
    assert (code, printed) == (0, f"wrote 2 rows (1 without spans, 6.0% of characters in spans) to {out}\n")
    assert [row["spans"] for row in read_annotations(out)] == [[[20, 24]], []]
