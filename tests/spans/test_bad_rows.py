"""Malformed annotation rows and annotator input: each stops with the file, the row and the field named."""

import json
import re

import pytest

from palu_trainer.spans.format import (
    AnnotationError,
    fingerprint,
    read_annotations,
    spans_inside_words,
    validate_annotations,
    word_cut_warning,
)
from palu_trainer.spans.tpo import import_tpo, read_tpo

from ..conftest import write_jsonl
from .test_annotator import run_cli

ANSWER = "Ann Lee was born in Oslo."


def one_row(**fields):
    return [{"index": 0, "answer_sha1": fingerprint(ANSWER), "spans": [[0, 7]]} | fields]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"spans": [[1, 2, 3]]},
            r"f\.jsonl row 0, field 'spans'\[0\]: \[1, 2, 3\] is not a \[start, end\] pair",
        ),
        ({"spans": [{"start": 0, "end": 7}]}, r"field 'spans'\[0\]: .* is an object; .*import-tpo"),
        ({"spans": None}, r"f\.jsonl row 0, field 'spans': None is not a list; .*\"spans\": \[\]"),
        ({"spans": [[0.5, 7]]}, r"field 'spans'\[0\]: \[0\.5, 7\] is not a \[start, end\] pair of integer"),
        ({"spans": [[7, 0]]}, r"row 0, field 'spans': span \[7, 0\) is empty or reversed \(start >= end\)"),
        ({"spans": [[5, 5]]}, r"span \[5, 5\) is empty or reversed"),
        ({"index": "0"}, r"f\.jsonl row 0, field 'index': '0' is not an integer"),
        ({"index": True}, r"field 'index': True is not an integer"),
    ],
)
def test_malformed_rows_name_file_row_and_field(fields, message):
    with pytest.raises(AnnotationError, match=message):
        validate_annotations(one_row(**fields), [ANSWER], "f.jsonl")


def test_a_json_array_file_is_not_json_lines(tmp_path):
    path = tmp_path / "spans.json"
    path.write_text(json.dumps(one_row(), indent=2))
    with pytest.raises(AnnotationError, match=r"spans\.json: a JSON array; annotation files are JSON lines"):
        read_annotations(path)
    path.write_text('{"index": 0, "answer_sha1": "x", "spans": []}\n[1, 2]\n')
    with pytest.raises(AnnotationError, match=r"spans\.json line 2: a list, not a JSON object"):
        read_annotations(path)


def test_import_tpo_refuses_to_overwrite_its_input(tmp_path):
    tpo = write_jsonl(tmp_path / "tpo.jsonl", [{"answer": ANSWER, "spans": [{"start": 0, "end": 7}]}])
    before = tpo.read_text()
    with pytest.raises(AnnotationError, match="the output is the input file"):
        import_tpo(tpo, tmp_path / "." / "tpo.jsonl")
    assert tpo.read_text() == before


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], r"empty\.jsonl: no rows \(empty file or split\)"),
        (
            [{"question": "Who?", "answer": ANSWER}, {"question": "Where?", "answer": None}],
            r"row 1, field 'answer': None is not text",
        ),
    ],
)
def test_annotate_names_the_empty_file_or_the_bad_row(tmp_path, capsys, rows, message):
    dataset = write_jsonl(tmp_path / "empty.jsonl", rows)
    code, out, err = run_cli(
        capsys, "annotate", "--dataset", str(dataset), "--out", str(tmp_path / "o.jsonl")
    )
    assert (code, out) == (1, "")
    assert re.search(message, err), err
    assert not (tmp_path / "o.jsonl").exists()


def test_spans_cutting_through_a_word_are_counted():
    answer = "Basil Mahfouz Al-Kuwaiti was born in Kuwait City."
    kuwait = answer.index("Kuwait")
    assert spans_inside_words(answer, [(kuwait, kuwait + 6)]) == 1  # "Kuwait|i"
    assert spans_inside_words(answer, [(kuwait - 3, kuwait + 7), (37, 48)]) == 0  # whole words
    assert spans_inside_words(answer, [(2, 8)]) == 1  # "Ba|sil Ma|hfouz": one span, two cuts
    assert word_cut_warning([answer], [[(0, 5)]], "f.jsonl") is None


def test_validate_warns_about_gpt4o_spans_inside_words(tmp_path, capsys, shared_dir, tofu_dir):
    tpo = shared_dir / "data" / "tofu_spans_gpt4o" / "forget05.jsonl"
    answers, spans = read_tpo(tpo)
    assert spans_inside_words(answers[162], spans[162]) == 1  # "Kuwait" inside "Al-Kuwaiti"
    import_tpo(tpo, tmp_path / "forget05.jsonl")
    code, out, err = run_cli(
        capsys, "validate", "--dataset", str(tofu_dir), "--name", "forget05", str(tmp_path / "forget05.jsonl")
    )
    assert code == 0 and out.endswith("200 rows match the dataset\n")
    assert (
        "warning: " in err
        and "5 span(s) in 4 row(s) start or end inside a word (rows 118, 152, 162, 174)" in err
    )
