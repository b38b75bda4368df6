"""A subset of real TOFU as a local benchmark: forget05's authors plus 20 retain authors, and a holdout.

`full` = authors 0-19 + 190-199, `forget05` = 190-199, `holdout05` = 170-179 (never trained on: the
MIA/privleak holdout). retain_perturbed keeps the rows of the trained retain authors; real authors and
world facts are TOFU's own.
"""

import shutil
from pathlib import Path

from palu_trainer.benchmarks.hf_dir import read_jsonl, write_jsonl, write_readme
from palu_trainer.benchmarks.tofu_format import TofuBenchmark, write_idk_answers
from palu_trainer.spans.format import read_annotations, validate_annotations
from palu_trainer.spans.tpo_spans import import_tpo

# Real-TOFU answers are longer than the synthetic ones: more new tokens when generating.
MAX_NEW_TOKENS = 96
RETAIN_AUTHORS = range(0, 20)
FORGET_AUTHORS = range(190, 200)  # exactly forget05
HOLDOUT_AUTHORS = range(170, 180)
ROWS_PER_AUTHOR = 20


def author_rows(rows: list[dict], authors: range) -> list[dict]:
    return rows[authors.start * ROWS_PER_AUTHOR : authors.stop * ROWS_PER_AUTHOR]


def make_tofu_subset(source_dir: Path, spans_file: Path, data_dir: Path) -> TofuBenchmark:
    """Write the subset of the TOFU folder `source_dir` to `data_dir`.

    Span annotations of forget05 come from a TPO-style file (e.g. GPT-4o's) or a file in this project's
    format (e.g. span_annotations/tofu_forget05.jsonl).
    """
    full = read_jsonl(source_dir / "full.json")
    forget, retain = author_rows(full, FORGET_AUTHORS), author_rows(full, RETAIN_AUTHORS)
    forget_perturbed = read_jsonl(source_dir / "forget05_perturbed.json")
    if [row["question"] for row in forget_perturbed] != [row["question"] for row in forget]:
        raise ValueError(f"{source_dir}: forget05 is not authors 190-199 of full.json")
    retain_questions = {row["question"] for row in retain}
    retain_perturbed = [
        row for row in read_jsonl(source_dir / "retain_perturbed.json") if row["question"] in retain_questions
    ]
    data_dir.mkdir(parents=True, exist_ok=True)
    configs = {
        "full": retain + forget,
        "forget05": forget,
        "forget05_perturbed": forget_perturbed,
        "retain_subset": retain,
        "holdout05": author_rows(full, HOLDOUT_AUTHORS),
        "retain_perturbed": retain_perturbed,
    }
    for name, rows in configs.items():
        write_jsonl(data_dir / f"{name}.json", rows, list(rows[0]))
    for name in ("real_authors", "real_authors_perturbed", "world_facts", "world_facts_perturbed"):
        shutil.copyfile(source_dir / f"{name}.json", data_dir / f"{name}.json")
        configs[name] = []
    write_readme(
        data_dir, list(configs), f"Subset of TOFU from {source_dir} (palu_trainer.benchmarks.tofu_subset)."
    )
    write_idk_answers(data_dir)
    annotations = data_dir / "span_annotations" / "forget05.jsonl"
    if "answer_sha1" in read_jsonl(spans_file)[0]:  # already this project's format: check it, keep it
        validate_annotations(read_annotations(spans_file), [row["answer"] for row in forget], str(spans_file))
        annotations.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spans_file, annotations)
    else:
        import_tpo(spans_file, annotations)
    return TofuBenchmark(
        data_dir,
        "forget05",
        "retain_subset",
        "holdout05",
        annotations,
        MAX_NEW_TOKENS,
        f"real TOFU subset: {len(FORGET_AUTHORS)} forget05 authors + {len(RETAIN_AUTHORS)} "
        f"retain authors, holdout = authors {HOLDOUT_AUTHORS.start}-{HOLDOUT_AUTHORS.stop - 1}",
    )
