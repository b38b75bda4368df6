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
from palu_trainer.spans.tpo_spans import import_tpo, read_tpo

from ..conftest import read_jsonl, write_jsonl
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


def test_import_tpo_checks_each_span_text_against_the_answer(tmp_path, capsys, shared_dir):
    rows = read_jsonl(shared_dir / "data" / "tofu_spans_gpt4o" / "forget01.jsonl")
    for row in rows:
        for span in row["spans"]:
            span["start"], span["end"] = span["start"] + 2, span["end"] + 2
    shifted = write_jsonl(tmp_path / "shifted.jsonl", rows)
    code, out, err = run_cli(capsys, "import-tpo", str(shifted), str(tmp_path / "out.jsonl"))
    assert (code, out) == (1, "")
    assert (
        "shifted.jsonl line 1: span [102, 126) covers 'sil Mahfouz Al-Kuwaiti.' but its text is "
        "'Basil Mahfouz Al-Kuwaiti'; the text is at offset 100 (shifted by -2). Fix the offsets" in err
    )
    assert not (tmp_path / "out.jsonl").exists()


def test_import_tpo_says_when_a_span_text_is_not_in_the_answer(tmp_path):
    tpo = write_jsonl(
        tmp_path / "tpo.jsonl", [{"answer": ANSWER, "spans": [{"start": 0, "end": 3, "text": "Zed"}]}]
    )
    with pytest.raises(
        AnnotationError, match=r"tpo\.jsonl line 1: span \[0, 3\) covers .*; the text is not in the answer"
    ):
        import_tpo(tpo, tmp_path / "out.jsonl")


def test_a_tpo_file_as_span_annotations_points_to_import_tpo(tmp_path, capsys, shared_dir, tofu_dir):
    tpo = shared_dir / "data" / "tofu_spans_gpt4o" / "forget01.jsonl"
    with pytest.raises(
        AnnotationError, match=r"forget01\.jsonl line 1: a TPO-style row .*palu-annotate import-tpo"
    ):
        read_annotations(tpo)
    code, _, err = run_cli(capsys, "validate", "--dataset", str(tofu_dir), "--name", "forget01", str(tpo))
    assert code == 1 and "convert the file with `palu-annotate import-tpo" in err


def test_a_binary_span_file_is_named(tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(
        AnnotationError, match=r"spans\.jsonl: not UTF-8 text \(invalid start byte at byte 0\)"
    ):
        read_annotations(path)


@pytest.mark.parametrize(
    ("dataset", "out", "message"),
    [
        ("{tmp}/no-such-dir", "{tmp}/o.jsonl", r"no-such-dir: no such file or folder; give a local dataset"),
        ("{tmp}/missing.jsonl", "{tmp}/o.jsonl", r"missing\.jsonl: no such file or folder"),
        ("{tmp}/qa.jsonl", "{tmp}", r"--out .* is a folder; name a file in it"),
        ("{tmp}/qa.jsonl", "{tmp}/qa.jsonl/o.jsonl", r"--out .*: cannot create its folder"),
    ],
)
def test_annotate_names_a_missing_dataset_or_a_bad_out(tmp_path, capsys, dataset, out, message):
    write_jsonl(tmp_path / "qa.jsonl", [{"question": "Who?", "answer": ANSWER}])
    dataset, out = dataset.format(tmp=tmp_path), out.format(tmp=tmp_path)
    code, stdout, err = run_cli(capsys, "annotate", "--dataset", dataset, "--out", out)
    assert (code, stdout) == (1, "")
    assert re.search(message, err), err


def test_annotate_names_a_config_the_folder_lacks(tmp_path, capsys, tofu_dir):
    code, _, err = run_cli(
        capsys,
        "annotate",
        "--dataset",
        str(tofu_dir),
        "--name",
        "forget77",
        "--out",
        str(tmp_path / "o.jsonl"),
    )
    assert (
        code == 1 and "(--name forget77, --split train) could not be loaded: BuilderConfig 'forget77'" in err
    )


def test_a_huge_value_is_named_by_an_excerpt_and_a_deeply_nested_row_is_refused(tmp_path):
    """A 50 MB span value is not echoed whole into the message; JSON nested past Python's recursion limit
    is one line, not a RecursionError."""
    from palu_trainer.spans.format import AnnotationError, fingerprint, read_annotations, validate_annotations

    answer = "Jaime Vasquez was born in Santiago."
    huge = "x" * 50_000_000
    row = {"index": 0, "answer_sha1": fingerprint(answer), "spans": huge}
    with pytest.raises(AnnotationError) as raised:
        validate_annotations([row], [answer], "spans.jsonl")
    assert len(str(raised.value)) < 300 and "(50,000,002 characters)" in str(raised.value)
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"index": 0, "spans": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(AnnotationError, match=r"deep\.jsonl line 1: JSON nested too deeply"):
        read_annotations(deep)
