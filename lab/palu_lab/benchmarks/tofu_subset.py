"""A subset of real TOFU as a local benchmark: some forget05 authors plus retain authors, and a holdout.

The default layout (`TofuLayout()`): `full` = authors 0-19 + 190-199, `forget05` = 190-199, `holdout05` =
170-179 (never trained on: the MIA/privleak holdout). retain_perturbed keeps the rows of the trained retain
authors; real authors and world facts are TOFU's own. A smaller layout (the real-model experiment's) keeps
fewer authors of each and caps the rows of the evaluation-only sets (`eval_rows`), which bounds the
evaluator's generation time. The configs keep TOFU's names (`forget05`, `holdout05`): the subset stands in
for forget05 with fewer rows.
"""

import shutil
from dataclasses import dataclass
from pathlib import Path

from palu_lab.benchmarks.dataset_folders import (
    TofuBenchmark,
    read_jsonl,
    write_idk_answers,
    write_jsonl,
    write_readme,
)
from palu_trainer.spans.format import read_annotations, validate_annotations, write_annotations
from palu_trainer.spans.tpo_spans import read_tpo

# Real-TOFU answers are longer than the synthetic ones: more new tokens when generating.
MAX_NEW_TOKENS = 96
FORGET05_AUTHORS = range(190, 200)
ROWS_PER_AUTHOR = 20
EVAL_ONLY_SETS = ("retain_perturbed", "real_authors_perturbed", "world_facts_perturbed")


@dataclass(frozen=True, kw_only=True)
class TofuLayout:
    """Which TOFU authors the subset keeps: forget authors within forget05's (190-199, so that forget05's
    span annotations, the project's and GPT-4o's, cover them), trained retain authors, never-trained holdout
    authors, the first `rows_per_author` rows of each (a smoke run's few rows); `eval_rows`: at most this
    many rows of each evaluation-only set (None: all)."""

    forget_authors: range = FORGET05_AUTHORS
    retain_authors: range = range(0, 20)
    holdout_authors: range = range(170, 180)
    rows_per_author: int = ROWS_PER_AUTHOR
    eval_rows: int | None = None
    max_new_tokens: int = MAX_NEW_TOKENS

    @property
    def forget_rows(self) -> int:
        return len(self.forget_authors) * self.rows_per_author

    def positions(self, authors: range, first_author: int = 0) -> list[int]:
        """The rows kept of `authors` in a file whose rows start with author `first_author`."""
        return [
            (author - first_author) * ROWS_PER_AUTHOR + row
            for author in authors
            for row in range(self.rows_per_author)
        ]

    def forget05_positions(self) -> list[int]:
        """The forget rows within forget05 (and its perturbed set and span annotations)."""
        if not set(self.forget_authors) <= set(FORGET05_AUTHORS):
            raise ValueError(f"forget authors {self.forget_authors} are not all forget05's (190-199)")
        return self.positions(self.forget_authors, FORGET05_AUTHORS.start)


def author_rows(rows: list[dict], authors: range) -> list[dict]:
    return rows[authors.start * ROWS_PER_AUTHOR : authors.stop * ROWS_PER_AUTHOR]


def pick(rows: list, positions: list[int]) -> list:
    return [rows[position] for position in positions]


def subset_spans(spans_file: Path, forget05_answers: list[str], positions: list[int], out: Path) -> Path:
    """forget05's span annotations (a TPO-style file such as GPT-4o's, or this project's format) for the
    rows `positions` of forget05, in this project's format at `out`."""
    if "answer_sha1" in read_jsonl(spans_file)[0]:  # this project's format: checked against forget05
        spans = validate_annotations(read_annotations(spans_file), forget05_answers, str(spans_file))
    else:
        answers, spans = read_tpo(spans_file)
        if answers != forget05_answers:
            raise ValueError(f"{spans_file}: its answers are not forget05's, in forget05's order")
    write_annotations(out, pick(forget05_answers, positions), pick(spans, positions))
    return out


def make_tofu_subset(
    source_dir: Path,
    spans_file: Path,
    data_dir: Path,
    layout: TofuLayout = TofuLayout(),
    other_spans: dict[str, Path] | None = None,
) -> TofuBenchmark:
    """Write the subset of the TOFU folder `source_dir` to `data_dir`.

    Span annotations of forget05 come from a TPO-style file (e.g. GPT-4o's) or a file in this project's
    format (e.g. span_annotations/tofu_forget05.jsonl). `other_spans` (label -> such a file) are written
    beside them as `span_annotations/<label>.jsonl`, for the same forget rows.
    """
    full = read_jsonl(source_dir / "full.json")
    forget05, retain = (
        author_rows(full, FORGET05_AUTHORS),
        pick(full, layout.positions(layout.retain_authors)),
    )
    forget05_perturbed = read_jsonl(source_dir / "forget05_perturbed.json")
    if [row["question"] for row in forget05_perturbed] != [row["question"] for row in forget05]:
        raise ValueError(f"{source_dir}: forget05 is not authors 190-199 of full.json")
    positions = layout.forget05_positions()
    forget = pick(forget05, positions)
    retain_questions = {row["question"] for row in retain}
    retain_perturbed = [
        row for row in read_jsonl(source_dir / "retain_perturbed.json") if row["question"] in retain_questions
    ]
    data_dir.mkdir(parents=True, exist_ok=True)
    configs = {
        "full": retain + forget,
        "forget05": forget,
        "forget05_perturbed": pick(forget05_perturbed, positions),
        "retain_subset": retain,
        "holdout05": pick(full, layout.positions(layout.holdout_authors)),
        "retain_perturbed": retain_perturbed,
    }
    for name in ("real_authors_perturbed", "world_facts_perturbed"):
        configs[name] = read_jsonl(source_dir / f"{name}.json")
    for name in EVAL_ONLY_SETS:
        configs[name] = configs[name][: layout.eval_rows]
    for name, rows in configs.items():
        write_jsonl(data_dir / f"{name}.json", rows, list(rows[0]))
    for name in ("real_authors", "world_facts"):
        shutil.copyfile(source_dir / f"{name}.json", data_dir / f"{name}.json")
        configs[name] = []
    write_readme(
        data_dir, list(configs), f"Subset of TOFU from {source_dir} (palu_lab.benchmarks.tofu_subset)."
    )
    write_idk_answers(data_dir)
    answers = [row["answer"] for row in forget05]
    spans_dir = data_dir / "span_annotations"
    annotations = subset_spans(spans_file, answers, positions, spans_dir / "forget05.jsonl")
    for label, path in (other_spans or {}).items():
        subset_spans(path, answers, positions, spans_dir / f"{label}.jsonl")
    authors = layout.forget_authors
    capped = f", evaluation-only sets capped at {layout.eval_rows} rows" if layout.eval_rows else ""
    if layout.rows_per_author < ROWS_PER_AUTHOR:
        capped += f", the first {layout.rows_per_author} rows of each author"
    return TofuBenchmark(
        data_dir,
        "forget05",
        "retain_subset",
        "holdout05",
        annotations,
        layout.max_new_tokens,
        f"real TOFU subset: {len(authors)} forget05 authors ({authors.start}-{authors.stop - 1}, "
        f"{layout.forget_rows} rows) + {len(layout.retain_authors)} retain authors, holdout = authors "
        f"{layout.holdout_authors.start}-{layout.holdout_authors.stop - 1}{capped}",
    )
