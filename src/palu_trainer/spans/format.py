"""Span-annotation files: one JSON line per forget row, offsets and a fingerprint, never text.

    {"index": 0, "answer_sha1": "<sha1 of the answer>", "spans": [[21, 31], [47, 60]]}   (QA rows)
    {"index": 0, "text_sha1": "<sha1 of the text>", "spans": [[0, 12], [40, 47]]}        (raw text)

`spans` are sorted, non-overlapping character ranges `[start, end)` into the annotated field of the row;
the fingerprint key names that field (`<field>_sha1`): `answer` for TOFU's QA rows, `text` for MUSE's raw
documents.
"""

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

Span = tuple[int, int]


class AnnotationError(ValueError):
    """An annotation file does not fit its dataset; the message names file, row and remedy."""


def fingerprint(answer: str) -> str:
    return hashlib.sha1(answer.encode("utf-8")).hexdigest()


def fingerprint_key(field: str) -> str:
    """The key holding the fingerprint of dataset field `field`: answer -> answer_sha1, text -> text_sha1."""
    return f"{field}_sha1"


def read_annotations(path: str | Path, field: str = "answer") -> list[dict]:
    """Rows of an annotation file whose spans index dataset field `field` (answer or text)."""
    path = Path(path)
    if not path.is_file():
        raise AnnotationError(
            f"{path}: span-annotation file not found. Create one with "
            "`palu-annotate annotate --dataset <dataset> --out <out.jsonl>` or "
            "`palu-annotate import-tpo <tpo.jsonl> <out.jsonl>`, or point the dataset's "
            "`span_annotations` argument at an existing file."
        )
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise AnnotationError(f"{path} line {line_number}: not JSON ({error})") from None
            key = fingerprint_key(field)
            missing = {"index", key, "spans"} - row.keys()
            if missing:
                other = sorted(k for k in row if k.endswith("_sha1") and k != key)
                hint = f" (it has {other[0]}: a file made for another kind of dataset)" if other else ""
                raise AnnotationError(
                    f"{path} line {line_number}: missing field(s) {sorted(missing)}{hint}; "
                    f"each line needs index, {key} and spans"
                )
            rows.append(row)
    return rows


def write_annotations(
    path: str | Path, answers: Sequence[str], spans: Sequence[Iterable[Span]], field: str = "answer"
):
    """Write one row per answer (or text, `field="text"`); spans are sorted and validated first."""
    rows = []
    for index, (answer, row_spans) in enumerate(zip(answers, spans, strict=True)):
        row = {
            "index": index,
            fingerprint_key(field): fingerprint(answer),
            "spans": sorted([int(start), int(end)] for start, end in row_spans),
        }
        rows.append(row)
    validate_annotations(rows, answers, source=str(path), field=field)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def validate_annotations(
    rows: Sequence[dict], answers: Sequence[str], source: str, field: str = "answer"
) -> list[list[Span]]:
    """Check rows against the dataset's `field` values (answers, texts); return each row's spans as tuples.

    Raises AnnotationError naming the file, the row and what to do, on: a row count that differs,
    an index out of order, a fingerprint that differs (another split, or shifted rows), a span out
    of the answer's bounds, empty, unsorted or overlapping.
    """
    if len(rows) != len(answers):
        raise AnnotationError(
            f"{source}: {len(rows)} annotation rows but the dataset has {len(answers)} rows; "
            "the file was made for another split or dataset"
        )
    key = fingerprint_key(field)
    all_spans = []
    for position, (row, answer) in enumerate(zip(rows, answers)):
        where = f"{source} row {position}"
        if row["index"] != position:
            raise AnnotationError(
                f"{where}: index is {row['index']}, expected {position}; rows must be in dataset order"
            )
        if key not in row:
            raise AnnotationError(
                f"{where}: no {key}; spans of this dataset index its {field!r} field, the file was made "
                "for another kind of dataset"
            )
        if row[key] != fingerprint(answer):
            raise AnnotationError(
                f"{where}: {field} fingerprint differs from the dataset's {field} "
                f"({row[key][:10]}… vs {fingerprint(answer)[:10]}…): the file belongs to "
                "another split or its rows are shifted; regenerate it for this dataset"
            )
        spans = [(int(start), int(end)) for start, end in row["spans"]]
        previous_end = 0
        for start, end in spans:
            if not 0 <= start < end <= len(answer):
                raise AnnotationError(
                    f"{where}: span [{start}, {end}) is out of range for {_article(field)} {field} of "
                    f"{len(answer)} characters"
                )
            if start < previous_end:
                raise AnnotationError(
                    f"{where}: span [{start}, {end}) overlaps or precedes the previous span; "
                    "spans must be sorted and disjoint"
                )
            previous_end = end
        all_spans.append(spans)
    return all_spans


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"
