"""`palu-annotate`: make, check and compare span-annotation files."""

import argparse
import json
import os
import sys
from pathlib import Path

from palu_trainer.spans.agreement import span_agreement, word_agreement
from palu_trainer.spans.annotator import Background, annotate, annotate_texts, load_qa_rows
from palu_trainer.spans.format import (
    AnnotationError,
    excerpt,
    read_annotations,
    validate_annotations,
    word_cut_warning,
    write_annotations,
)
from palu_trainer.spans.tpo_spans import import_tpo, read_tpo


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="palu-annotate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    tpo = commands.add_parser("import-tpo", help="convert TPO-style span annotations (char offsets)")
    tpo.add_argument("tpo_file", help="JSON lines with `answer` and `spans: [{start, end}]`")
    tpo.add_argument("out_file", help="annotation file to write (span_annotations/ format)")
    tpo.set_defaults(run=_run_import_tpo)

    annotate = commands.add_parser(
        "annotate", help="mark the sensitive spans of a QA dataset's answers, or of raw texts (--text-key)"
    )
    _add_dataset_arguments(annotate, required=True)
    annotate.add_argument(
        "--background",
        help="dataset giving word statistics, about other subjects (TOFU: the retain split; MUSE-News: "
        "sust/forget_2); default: the dataset itself",
    )
    annotate.add_argument("--background-name", help="configuration of the background dataset")
    annotate.add_argument("--background-split", default="train")
    annotate.add_argument("--out", required=True, help="annotation file to write")
    annotate.set_defaults(run=_run_annotate)

    score = commands.add_parser(
        "score", help="word-token and exact-span precision/recall/F1 of a candidate file against a reference"
    )
    score.add_argument("--reference", required=True, help="TPO-style file or annotation file")
    score.add_argument("candidate", help="TPO-style file or annotation file")
    _add_dataset_arguments(score, required=False)
    score.set_defaults(run=_run_score)

    validate = commands.add_parser("validate", help="check an annotation file against its dataset")
    _add_dataset_arguments(validate, required=True)
    validate.add_argument("file", help="annotation file")
    validate.set_defaults(run=_run_validate)

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except AnnotationError as error:
        parser.exit(1, f"palu-annotate {args.command}: {error}\n")


def _add_dataset_arguments(parser, required: bool):
    parser.add_argument(
        "--dataset",
        required=required,
        help="Hugging Face dataset id, local dataset folder, or JSON (lines) file with question/answer rows",
    )
    parser.add_argument("--name", help="dataset configuration, e.g. forget05")
    parser.add_argument("--split", default="train")
    parser.add_argument("--question-key", default="question")
    parser.add_argument("--answer-key", default="answer")
    parser.add_argument(
        "--text-key",
        help="raw-text mode: rows are documents with this field (MUSE: text), no question; spans index it",
    )


def _check_out(path: str, option: str) -> None:
    """The file to write: refused before any work when it is a folder or its folder cannot be made."""
    out = Path(path)
    if out.is_dir():
        raise AnnotationError(f"{option} {path} is a folder; name a file in it, e.g. {out / 'spans.jsonl'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise AnnotationError(f"{option} {path}: cannot create its folder ({error.strerror})") from None
    if not os.access(out.parent, os.W_OK):
        raise AnnotationError(f"{option} {path}: its folder {out.parent} is not writable")


def _run_import_tpo(args):
    _check_out(args.out_file, "out_file")
    rows = import_tpo(args.tpo_file, args.out_file)
    print(f"wrote {rows} rows to {args.out_file}")


def _run_annotate(args):
    _check_out(args.out, "--out")
    rows = _dataset_rows(args)
    background_rows = (
        _load_rows(args.background, args.background_name, args.background_split) if args.background else rows
    )
    if args.text_key:
        for dataset, name in ((args.dataset, args.name), (args.background, args.background_name)):
            if name in EVALUATION_CONFIGS:
                raise AnnotationError(
                    f"{dataset} config {name!r} is an evaluation set (MUSE's "
                    f"{', '.join(EVALUATION_CONFIGS)}): annotating or reading it would tune spans on what "
                    "measures the unlearning"
                )
        texts = [row[args.text_key] for row in rows]
        spans = annotate_texts(texts, Background(row[args.text_key] for row in background_rows))
    else:
        qa = (f"{row[args.question_key]}\n{row[args.answer_key]}" for row in background_rows)
        spans = annotate(rows, Background(qa), args.question_key, args.answer_key)
        texts = [row[args.answer_key] for row in rows]
    write_annotations(args.out, texts, spans, field=args.text_key or "answer")
    empty = sum(not row_spans for row_spans in spans)
    in_spans = sum(end - start for row_spans in spans for start, end in row_spans)
    density = in_spans / max(sum(map(len, texts)), 1)
    print(
        f"wrote {len(rows)} rows ({empty} without spans, {density:.1%} of characters in spans) to {args.out}"
    )


def _run_score(args):
    dataset_answers = _dataset_answers(args) if args.dataset else None
    tpo_answers = [_read_tpo_or_none(path) for path in (args.reference, args.candidate)]
    answers = dataset_answers or next((found[0] for found in tpo_answers if found), None)
    if answers is None:
        raise AnnotationError(
            "neither file has the answers (TPO format): pass --dataset to define the answers' words"
        )
    reference, candidate = (
        _spans_for(args, path, found, answers)
        for path, found in zip((args.reference, args.candidate), tpo_answers)
    )
    span_counts = f"{sum(map(len, reference))} reference and {sum(map(len, candidate))} candidate spans"
    print(f"{len(answers)} rows, {span_counts}")
    print(f"word tokens  {word_agreement(answers, reference, candidate)}")
    print(f"exact spans  {span_agreement(reference, candidate)}")


def _run_validate(args):
    answers = _dataset_answers(args)
    spans = _spans_for(args, args.file, None, answers)
    print(f"{args.file}: {len(answers)} rows match the dataset")
    if warning := word_cut_warning(answers, spans, args.file):
        print(f"palu-annotate validate: warning: {warning}", file=sys.stderr)


EVALUATION_CONFIGS = ("knowmem", "verbmem", "privleak")


def _load_rows(dataset, name, split) -> list[dict]:
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # stderr is for errors
    local = Path(dataset).suffix in (".json", ".jsonl") or dataset.startswith((".", "/", "~"))
    if local and not Path(dataset).expanduser().exists():
        raise AnnotationError(
            f"{dataset}: no such file or folder; give a local dataset folder, a JSON (lines) file or a "
            "Hugging Face dataset id"
        )
    try:
        return load_qa_rows(str(Path(dataset).expanduser()) if local else dataset, name, split)
    except Exception as error:  # datasets raises many types (FileNotFoundError, ValueError, ConnectionError)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise AnnotationError(
            f"{dataset} (--name {name}, --split {split}) could not be loaded: {reason}. Check the path, "
            "--name and --split (a local folder needs the hub README listing its configs)"
        ) from None


def _dataset_rows(args) -> list[dict]:
    rows = _load_rows(args.dataset, args.name, args.split)
    if not rows:
        raise AnnotationError(f"{args.dataset}: no rows (empty file or split); nothing to annotate")
    keys = {args.text_key} if args.text_key else {args.question_key, args.answer_key}
    if missing := keys - set(rows[0]):
        raise AnnotationError(
            f"{args.dataset}: rows have no {sorted(missing)}; name the keys with "
            + ("--text-key" if args.text_key else "--question-key/--answer-key")
        )
    for position, row in enumerate(rows):
        for key in sorted(keys):
            if not isinstance(row[key], str):
                raise AnnotationError(
                    f"{args.dataset} row {position}, field {key!r}: {excerpt(row[key])} is not text; "
                    "fix or drop the row"
                )
    return rows


def _dataset_answers(args) -> list[str]:
    return [row[args.text_key or args.answer_key] for row in _dataset_rows(args)]


def _read_tpo_or_none(path) -> tuple[list[str], list] | None:
    """The file's answers and spans when it is TPO-style (rows carry the answer), else None."""
    with open(path, encoding="utf-8") as handle:
        first = next((line for line in handle if line.strip()), "{}")
    return read_tpo(path) if "answer" in json.loads(first) else None


def _spans_for(args, path, tpo, answers):
    """A file's spans, checked against the answers: fingerprints for an annotation file, text for TPO."""
    if tpo is None:
        field = args.text_key or "answer"
        return validate_annotations(read_annotations(path, field), answers, source=str(path), field=field)
    tpo_answers, spans = tpo
    if len(tpo_answers) != len(answers):
        raise AnnotationError(f"{path}: {len(tpo_answers)} rows but {len(answers)} answers to score on")
    for position, (own, expected) in enumerate(zip(tpo_answers, answers)):
        if own != expected:
            raise AnnotationError(f"{path} row {position}: the answer differs from the one to score on")
    return spans
