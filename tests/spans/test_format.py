import json

import pytest

from palu_trainer.spans.format import (
    AnnotationError,
    fingerprint,
    merge_spans,
    read_annotations,
    validate_annotations,
)
from palu_trainer.spans.tpo_spans import import_tpo

from ..conftest import TAG_TEMPLATE, write_jsonl

ANSWERS = ["Ann Lee was born in Oslo.", "She wrote two novels.", "No information."]


def rows_for(answers, spans):
    return [
        {"index": i, "answer_sha1": fingerprint(answer), "spans": [list(span) for span in row_spans]}
        for i, (answer, row_spans) in enumerate(zip(answers, spans))
    ]


def test_valid_rows_return_their_spans():
    rows = rows_for(ANSWERS, [[(0, 7), (20, 24)], [(10, 13)], []])
    assert validate_annotations(rows, ANSWERS, "f.jsonl") == [[(0, 7), (20, 24)], [(10, 13)], []]


def test_row_count_mismatch_names_the_file():
    with pytest.raises(AnnotationError, match=r"f\.jsonl: 2 annotation rows but the dataset has 3"):
        validate_annotations(rows_for(ANSWERS[:2], [[], []]), ANSWERS, "f.jsonl")


def test_shifted_rows_fail_on_the_fingerprint_of_the_first_shifted_row():
    shifted = rows_for(ANSWERS[1:] + ANSWERS[:1], [[], [], []])
    with pytest.raises(AnnotationError, match=r"f\.jsonl row 0: answer fingerprint differs"):
        validate_annotations(shifted, ANSWERS, "f.jsonl")


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([(20, 99)], r"row 1: span \[20, 99\) is out of range for an answer of 21 characters"),
        ([(0, 8), (4, 12)], r"row 1: span \[4, 12\) overlaps"),
    ],
)
def test_bad_spans_name_row_and_span(spans, message):
    rows = rows_for(ANSWERS, [[], spans, []])
    with pytest.raises(AnnotationError, match=message):
        validate_annotations(rows, ANSWERS, "f.jsonl")


def test_index_out_of_order():
    rows = rows_for(ANSWERS, [[], [], []])
    rows[1]["index"] = 2
    with pytest.raises(AnnotationError, match="row 1: index is 2, expected 1"):
        validate_annotations(rows, ANSWERS, "f.jsonl")


def test_missing_file_and_missing_fields(tmp_path):
    with pytest.raises(AnnotationError, match="not found.*palu-annotate import-tpo"):
        read_annotations(tmp_path / "absent.jsonl")
    write_jsonl(tmp_path / "bad.jsonl", [{"index": 0, "spans": []}])
    with pytest.raises(AnnotationError, match=r"bad\.jsonl line 1: missing field\(s\) \['answer_sha1'\]"):
        read_annotations(tmp_path / "bad.jsonl")


def test_merge_spans_joins_overlapping_and_touching():
    assert merge_spans([(5, 9), (0, 3), (3, 4), (8, 12), (20, 21)]) == [(0, 4), (5, 12), (20, 21)]


def test_import_tpo_keeps_offsets_and_no_text(tmp_path):
    tpo = write_jsonl(
        tmp_path / "tpo.jsonl",
        [
            {
                "index": 0,
                "answer": ANSWERS[0],
                "spans": [{"start": 20, "end": 24, "text": "Oslo"}, {"start": 0, "end": 7}],
            }
        ],
    )
    assert import_tpo(tpo, tmp_path / "out.jsonl") == 1
    (row,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert row == {"index": 0, "answer_sha1": fingerprint(ANSWERS[0]), "spans": [[0, 7], [20, 24]]}


def test_gpt4o_forget05_file_fails_on_forget01_before_training(tmp_path, tokenizer, shared_dir, tofu_dir):
    from palu_trainer.framework.datasets import QAwithSpansDataset

    annotations = tmp_path / "forget05.jsonl"
    import_tpo(shared_dir / "data" / "tofu_spans_gpt4o" / "forget05.jsonl", annotations)

    def dataset(name):
        return QAwithSpansDataset(
            span_annotations=annotations,
            hf_args={"path": str(tofu_dir), "name": name, "split": "train"},
            template_args=TAG_TEMPLATE,
            tokenizer=tokenizer,
        )

    assert len(dataset("forget05")) == 200
    with pytest.raises(AnnotationError, match=r"forget05\.jsonl: 200 annotation rows but the dataset has 40"):
        dataset("forget01")
    # Rotated by one author: same row count, every row now describes another answer.
    lines = annotations.read_text().splitlines()
    shifted = [json.loads(line) | {"index": i} for i, line in enumerate(lines[20:] + lines[:20])]
    write_jsonl(annotations, shifted)
    with pytest.raises(AnnotationError, match=r"row 0: answer fingerprint differs"):
        dataset("forget05")
