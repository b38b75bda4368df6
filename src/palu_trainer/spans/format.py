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
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise AnnotationError(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); span-annotation files are JSON "
            "lines, one object per row: is this the right file?"
        ) from None
    if text.lstrip().startswith("["):
        raise AnnotationError(
            f"{path}: a JSON array; annotation files are JSON lines, one object per row "
            '(`{"index": 0, "answer_sha1": "...", "spans": [[21, 31]]}`)'
        )
    rows = []
    key = f"{field}_sha1"  # the fingerprint of the annotated field: answer_sha1, text_sha1
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise AnnotationError(f"{path} line {line_number}: not JSON ({error})") from None
        except RecursionError:
            raise AnnotationError(
                f"{path} line {line_number}: JSON nested too deeply to be a row of this format"
            ) from None
        if not isinstance(row, dict):
            raise AnnotationError(f"{path} line {line_number}: a {type(row).__name__}, not a JSON object")
        missing, spans = {"index", key, "spans"} - row.keys(), row.get("spans")
        tpo_style = "answer" in row and isinstance(spans, list) and all(isinstance(s, dict) for s in spans)
        if missing and tpo_style:
            raise AnnotationError(
                f"{path} line {line_number}: a TPO-style row (the answer with {{start, end}} spans), not "
                f"this format (index, {key}, [start, end] spans): convert the file with "
                f"`palu-annotate import-tpo {path} <out.jsonl>` and use <out.jsonl>"
            )
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
    rows = [
        {"index": index, f"{field}_sha1": fingerprint(answer), "spans": sorted([s, e] for s, e in row_spans)}
        for index, (answer, row_spans) in enumerate(zip(answers, spans, strict=True))
    ]
    validate_annotations(rows, answers, source=str(path), field=field)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def validate_annotations(
    rows: Sequence[dict], answers: Sequence[str], source: str, field: str = "answer"
) -> list[list[Span]]:
    """Check rows against the dataset's `field` values (answers, texts); return each row's spans as tuples.
    The first mismatch raises an AnnotationError naming the file, the row and what to do."""
    if len(rows) != len(answers):
        raise AnnotationError(
            f"{source}: {len(rows)} annotation rows but the dataset has {len(answers)} rows; "
            "the file was made for another split or dataset"
        )
    all_spans = []
    for position, (row, answer) in enumerate(zip(rows, answers)):
        where = f"{source} row {position}"
        check_row_identity(row, position, answer, where, field)
        check_span_shapes(row["spans"], f"{where}, field 'spans'")
        spans = [(start, end) for start, end in row["spans"]]
        check_span_bounds(spans, len(answer), where, field)
        all_spans.append(spans)
    return all_spans


def check_row_identity(row: dict, position: int, answer: str, where: str, field: str) -> None:
    """The row is the dataset's row `position`: its index, and the fingerprint of its `field` value."""
    key = f"{field}_sha1"
    if not _is_int(row["index"]):
        raise AnnotationError(f"{where}, field 'index': {excerpt(row['index'])} is not an integer")
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


def check_span_shapes(spans, field_spans: str) -> None:
    """`spans` is a list of [start, end] pairs of integers."""
    if not isinstance(spans, list):
        raise AnnotationError(
            f'{field_spans}: {excerpt(spans)} is not a list; a row without spans has `"spans": []`'
        )
    for number, span in enumerate(spans):
        if isinstance(span, dict):
            raise AnnotationError(
                f"{field_spans}[{number}]: {excerpt(span)} is an object; spans are [start, end] pairs "
                "(convert TPO-style {start, end} rows with `palu-annotate import-tpo`)"
            )
        if not (isinstance(span, list) and len(span) == 2 and all(map(_is_int, span))):
            raise AnnotationError(
                f"{field_spans}[{number}]: {excerpt(span)} is not a [start, end] pair of integer "
                "character offsets"
            )


def check_span_bounds(spans: list[Span], length: int, where: str, field: str) -> None:
    """Each span is non-empty, within the `length` characters of its `field` value, after the previous one."""
    previous_end = 0
    for start, end in spans:
        if start >= end:
            raise AnnotationError(
                f"{where}, field 'spans': span [{start}, {end}) is empty or reversed (start >= end)"
            )
        if not 0 <= start < end <= length:
            article = "an" if field[0] in "aeiou" else "a"
            raise AnnotationError(
                f"{where}: span [{start}, {end}) is out of range for {article} {field} of {length} characters"
            )
        if start < previous_end:
            raise AnnotationError(
                f"{where}: span [{start}, {end}) overlaps or precedes the previous span; "
                "spans must be sorted and disjoint"
            )
        previous_end = end


EXCERPT_CHARACTERS = 80


def excerpt(value) -> str:
    """`value`'s repr, cut to `EXCERPT_CHARACTERS` with its length said: a message names a bad value, not all
    of a huge one."""
    text = repr(value)
    if len(text) <= EXCERPT_CHARACTERS:
        return text
    return f"{text[:EXCERPT_CHARACTERS]}… ({len(text):,} characters)"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def spans_inside_words(answer: str, spans: Iterable[Span]) -> int:
    """Spans whose start or end falls inside a word ("Kuwait" in "Al-Kuwaiti"), where a token straddles it."""
    inside = {i for i in range(1, len(answer)) if answer[i - 1].isalnum() and answer[i].isalnum()}
    return sum(start in inside or end in inside for start, end in spans)


def word_cut_warning(answers: Sequence[str], spans: Sequence[Sequence[Span]], source: str) -> str | None:
    """A warning counting spans that cut through a word, naming the first rows; None when there are none."""
    cut_rows = {row: n for row, (a, s) in enumerate(zip(answers, spans)) if (n := spans_inside_words(a, s))}
    if not cut_rows:
        return None
    shown = ", ".join(str(row) for row in list(cut_rows)[:10]) + (", ..." if len(cut_rows) > 10 else "")
    return (
        f"{source}: {sum(cut_rows.values())} span(s) in {len(cut_rows)} row(s) start or end inside a word "
        f"(rows {shown}); the token straddling the boundary gets the span's role. Move the boundary to the "
        "word's edge if that is not intended"
    )


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
