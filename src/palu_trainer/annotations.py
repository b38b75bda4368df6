"""Span-annotation files: one JSON line per forget row, offsets and a fingerprint, never text.

    {"index": 0, "answer_sha1": "<sha1 of the answer>", "spans": [[21, 31], [47, 60]]}

`spans` are sorted, non-overlapping character ranges `[start, end)` into the row's answer.
"""

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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


def read_tpo(tpo_path: str | Path) -> tuple[list[str], list[list[Span]]]:
    """Answers and spans of a TPO-style file (`answer` and `spans` with `start`/`end`), spans merged."""
    answers, spans = [], []
    with open(tpo_path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "answer" not in row or "spans" not in row:
                raise AnnotationError(f"{tpo_path} line {line_number}: TPO rows need 'answer' and 'spans'")
            answers.append(row["answer"])
            spans.append(merge_spans((span["start"], span["end"]) for span in row["spans"]))
    return answers, spans


def import_tpo(tpo_path: str | Path, out_path: str | Path) -> int:
    """Convert TPO-style annotations to this format; overlapping or touching spans are merged.

    Returns the number of rows written.
    """
    answers, spans = read_tpo(tpo_path)
    write_annotations(out_path, answers, spans)
    return len(answers)


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Agreement:
    """Precision, recall and F1 of a candidate against a reference, micro-averaged over all rows."""

    true_positives: int
    false_positives: int
    false_negatives: int

    @property
    def precision(self) -> float:
        return self.true_positives / max(self.true_positives + self.false_positives, 1)

    @property
    def recall(self) -> float:
        return self.true_positives / max(self.true_positives + self.false_negatives, 1)

    @property
    def f1(self) -> float:
        total = self.precision + self.recall
        return 2 * self.precision * self.recall / total if total else 0.0

    def __str__(self) -> str:
        return f"precision {self.precision:.3f}  recall {self.recall:.3f}  F1 {self.f1:.3f}"


def word_agreement(
    answers: Sequence[str], reference: Sequence[Sequence[Span]], candidate: Sequence[Sequence[Span]]
) -> Agreement:
    """Agreement on word tokens (maximal runs of letters, digits and underscores, `\\w+`).

    A word is marked by a file when any of its characters lies in one of the row's spans.
    """
    counts = Counter()
    for answer, reference_spans, candidate_spans in zip(answers, reference, candidate, strict=True):
        for word in WORD.finditer(answer):
            counts[_covers(reference_spans, word), _covers(candidate_spans, word)] += 1
    return Agreement(counts[True, True], counts[False, True], counts[True, False])


def span_agreement(reference: Sequence[Sequence[Span]], candidate: Sequence[Sequence[Span]]) -> Agreement:
    """Agreement on spans: a candidate span counts only where the reference has exactly the same span."""
    true_positives = false_positives = false_negatives = 0
    for reference_spans, candidate_spans in zip(reference, candidate, strict=True):
        reference_set, candidate_set = set(map(tuple, reference_spans)), set(map(tuple, candidate_spans))
        true_positives += len(reference_set & candidate_set)
        false_positives += len(candidate_set - reference_set)
        false_negatives += len(reference_set - candidate_set)
    return Agreement(true_positives, false_positives, false_negatives)


def _covers(spans: Iterable[Span], word: re.Match) -> bool:
    return any(start < word.end() and word.start() < end for start, end in spans)
