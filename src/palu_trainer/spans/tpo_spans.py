"""Import TPO-style span annotations: rows carry their `answer` and character `spans` as {start, end}."""

import json
from pathlib import Path

from palu_trainer.spans.format import AnnotationError, Span, excerpt, merge_spans, write_annotations


def read_tpo(tpo_path: str | Path) -> tuple[list[str], list[list[Span]]]:
    """Answers and spans of a TPO-style file, spans merged."""
    answers, spans = [], []
    with open(tpo_path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            row, where = json.loads(line), f"{tpo_path} line {line_number}"
            if "answer" not in row or "spans" not in row:
                raise AnnotationError(f"{where}: TPO rows need 'answer' and 'spans'")
            answers.append(row["answer"])
            spans.append(merge_spans(_checked_span(row["answer"], span, where) for span in row["spans"]))
    return answers, spans


def import_tpo(tpo_path: str | Path, out_path: str | Path) -> int:
    """Convert TPO-style annotations to this format, overlapping or touching spans merged; rows written."""
    if Path(out_path).resolve() == Path(tpo_path).resolve():
        raise AnnotationError(
            f"{out_path}: the output is the input file; writing it would overwrite the TPO annotations. "
            "Name another output file"
        )
    answers, spans = read_tpo(tpo_path)
    write_annotations(out_path, answers, spans)
    return len(answers)


def _checked_span(answer: str, span: dict, where: str) -> Span:
    """(start, end) of a TPO span, checked against its `text` when it has one (offsets shifted otherwise)."""
    start, end = span["start"], span["end"]
    text = span.get("text")
    if text is not None and answer[start:end] != text:
        found = answer.find(text)
        shifted = f"the text is at offset {found} (shifted by {found - start:+d})"
        hint = shifted if found >= 0 else "the text is not in the answer"
        raise AnnotationError(
            f"{where}: span [{start}, {end}) covers {excerpt(answer[start:end])} but its text is "
            f"{excerpt(text)}; {hint}. "
            "Fix the offsets (or the text) in the TPO file and import it again"
        )
    return start, end
