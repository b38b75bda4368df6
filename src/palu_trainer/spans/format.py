"""Span-annotation files: one JSON line per forget row, offsets and a fingerprint, never text.

    {"index": 0, "answer_sha1": "<sha1 of the answer>", "spans": [[21, 31], [47, 60]]}

`spans` are sorted, non-overlapping character ranges `[start, end)` into the row's answer.
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


def read_annotations(path: str | Path) -> list[dict]:
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
            missing = {"index", "answer_sha1", "spans"} - row.keys()
            if missing:
                raise AnnotationError(
                    f"{path} line {line_number}: missing field(s) {sorted(missing)}; "
                    "each line needs index, answer_sha1 and spans"
                )
            rows.append(row)
    return rows


def write_annotations(path: str | Path, answers: Sequence[str], spans: Sequence[Iterable[Span]]):
    """Write one row per answer; spans are sorted and validated against their answer first."""
    rows = []
    for index, (answer, row_spans) in enumerate(zip(answers, spans, strict=True)):
        row = {
            "index": index,
            "answer_sha1": fingerprint(answer),
            "spans": sorted([int(start), int(end)] for start, end in row_spans),
        }
        rows.append(row)
    validate_annotations(rows, answers, source=str(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def validate_annotations(rows: Sequence[dict], answers: Sequence[str], source: str) -> list[list[Span]]:
    """Check rows against the dataset's answers; return each row's spans as tuples.

    Raises AnnotationError naming the file, the row and what to do, on: a row count that differs,
    an index out of order, a fingerprint that differs (another split, or shifted rows), a span out
    of the answer's bounds, empty, unsorted or overlapping.
    """
    if len(rows) != len(answers):
        raise AnnotationError(
            f"{source}: {len(rows)} annotation rows but the dataset has {len(answers)} rows; "
            "the file was made for another split or dataset"
        )
    all_spans = []
    for position, (row, answer) in enumerate(zip(rows, answers)):
        where = f"{source} row {position}"
        if row["index"] != position:
            raise AnnotationError(
                f"{where}: index is {row['index']}, expected {position}; rows must be in dataset order"
            )
        if row["answer_sha1"] != fingerprint(answer):
            raise AnnotationError(
                f"{where}: answer fingerprint differs from the dataset's answer "
                f"({row['answer_sha1'][:10]}… vs {fingerprint(answer)[:10]}…): the file belongs to "
                "another split or its rows are shifted; regenerate it for this dataset"
            )
        spans = [(int(start), int(end)) for start, end in row["spans"]]
        previous_end = 0
        for start, end in spans:
            if not 0 <= start < end <= len(answer):
                raise AnnotationError(
                    f"{where}: span [{start}, {end}) is out of range for an answer of "
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
