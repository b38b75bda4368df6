"""A subset of MUSE-News as a local benchmark in the hub's layout, small enough for a tiny model on CPU.

MUSE's evaluation rows are windows on the forget corpus joined with blank lines: a `privleak/forget`
excerpt (~8 KB) or a `verbmem` prompt with its continuation spans two to six consecutive articles. The
subset takes the `num_windows` cheapest runs of consecutive articles that hold one privleak excerpt and
one verbmem row each, and keeps exactly the evaluation rows whose text lies inside those runs.

The forget corpus (`raw/forget`) is those rows' excerpts: each verbmem prompt with its continuation and
each privleak excerpt, verbatim forget text. A 1M-parameter model memorises a sequence from where it
starts: trained on the whole articles, cut into the framework's fixed chunks, it did not reproduce a
verbmem continuation from an excerpt that starts elsewhere (measured in the demo: VerbMem 0.19 for
Original against 0.10 for Retain). A 7B model does; a model this small needs the excerpt as a sequence.

The retain side here has no articles, only `privleak/retain` excerpts: the first `num_retain` of them are
the retain corpus (`raw/retain1`, plus the `privleak/retain` MIA rows); `num_holdout` `privleak/holdout`
excerpts, never trained on, are `raw/holdout` and the MIA holdout.

KnowMem asks questions, and a model trained from scratch has never seen a question: each kept `knowmem`
pair (answer verbatim in its side's articles or excerpts) is also written as one `Question: …\nAnswer:\n…`
row of its side's corpus, the prompt format of `model=tiny-llama`. Forget-side pairs are then part of what
is unlearned, retain-side pairs of what is kept, and KnowMem asks for facts the corpora state.
"""

import bisect
import shutil
from dataclasses import dataclass
from pathlib import Path

from palu_lab.benchmarks.dataset_folders import read_jsonl, write_configs_readme, write_jsonl
from palu_lab.benchmarks.synthetic_news import synthetic_news
from palu_trainer.spans.agreement import Agreement, word_agreement
from palu_trainer.spans.annotator import Background, annotate_texts
from palu_trainer.spans.format import write_annotations

SEPARATOR = "\n\n"  # how MUSE's evaluation excerpts join consecutive forget articles
QA_TEMPLATE = "Question: {question}\nAnswer:\n{answer}"  # model=tiny-llama's template_args
SYNTHETIC_ARTICLES = 200  # held-out synthetic news articles the annotator is scored on
# config -> split -> rows; the hub's `configs` (README) list each split's file as <config>/<split>.jsonl
COPIED_AS_IS = {"knowmem": ("forget_qa_icl", "retain_qa_icl")}


@dataclass(frozen=True)
class MuseBenchmark:
    """A local MUSE-format folder (`MUSE_DIR`): raw forget/retain1/holdout/full, evaluation rows, spans."""

    muse_dir: Path
    span_annotations: Path
    rows: dict[str, int]  # "<config>/<split>" -> rows written
    description: str
    annotator_agreement: Agreement  # the same annotator against gold spans of held-out synthetic news

    def texts(self) -> list[str]:
        """Every string of every row (corpora and evaluation), to train a tokenizer on."""
        return [
            value
            for path in sorted(self.muse_dir.glob("*/*.jsonl"))
            for row in read_jsonl(path)
            for value in row.values()
            if isinstance(value, str)
        ]


def _windows(articles: list[str], excerpts: list[str]) -> list[frozenset[int] | None]:
    """For each excerpt, the articles of the joined forget corpus it covers (None: not in it)."""
    joined = SEPARATOR.join(articles)
    starts, position = [], 0
    for article in articles:
        starts.append(position)
        position += len(article) + len(SEPARATOR)
    windows = []
    for excerpt in excerpts:
        found = joined.find(excerpt)
        if found < 0:
            windows.append(None)
            continue
        first = bisect.bisect_right(starts, found) - 1
        last = bisect.bisect_right(starts, found + len(excerpt) - 1) - 1
        windows.append(frozenset(range(first, last + 1)))
    return windows


def select_articles(articles: list[str], privleak: list[str], verbmem: list[str], num_windows: int):
    """The `num_windows` cheapest (fewest characters) disjoint article runs holding a privleak excerpt
    and a verbmem row each; returns the sorted article indices."""
    privleak_windows = [w for w in _windows(articles, privleak) if w]
    verbmem_windows = [w for w in _windows(articles, verbmem) if w]
    candidates = []
    for window in privleak_windows:
        joined = [window | other for other in verbmem_windows if other & window]
        for run in joined:
            if max(run) - min(run) + 1 == len(run):  # consecutive articles only
                candidates.append((sum(len(articles[index]) for index in run), sorted(run)))
    chosen: set[int] = set()
    for _, run in sorted(candidates):
        if not chosen & set(range(min(run) - 1, max(run) + 2)):
            chosen |= set(run)
            num_windows -= 1
            if num_windows == 0:
                return sorted(chosen)
    raise ValueError(f"only {len(candidates)} article runs hold both a privleak and a verbmem row")


def _in_text(rows: list[dict], key: str, text: str) -> list[dict]:
    return [row for row in rows if row[key] in text]


def make_muse_subset(
    source_dir: Path,
    data_dir: Path,
    num_windows: int,
    num_retain: int,
    num_holdout: int,
    spans_path: Path,
) -> MuseBenchmark:
    """Write the subset of the MUSE-News folder `source_dir` (hub layout) to `data_dir`, and span
    annotations of its raw/forget rows to `spans_path`."""
    read = lambda config, split: read_jsonl(source_dir / config / f"{split}.jsonl")  # noqa: E731
    articles = [row["text"] for row in read("raw", "forget")]
    verbmem = read("verbmem", "forget")
    verbmem_texts = [f"{row['prompt']} {row['gt']}" for row in verbmem]  # MUSE_forget_verbmem: insert_space
    kept = select_articles(
        articles, [row["text"] for row in read("privleak", "forget")], verbmem_texts, num_windows
    )
    forget_text = SEPARATOR.join(articles[index] for index in kept)
    retain = read("privleak", "retain")[:num_retain]
    retain_text = SEPARATOR.join(row["text"] for row in retain)
    forget_qa = _in_text(read("knowmem", "forget_qa"), "answer", forget_text)
    retain_qa = _in_text(read("knowmem", "retain_qa"), "answer", retain_text)
    qa_rows = lambda pairs: [{"text": QA_TEMPLATE.format(**pair)} for pair in pairs]  # noqa: E731
    verbmem_kept = [row for row, text in zip(verbmem, verbmem_texts, strict=True) if text in forget_text]
    privleak_kept = _in_text(read("privleak", "forget"), "text", forget_text)
    excerpts = [f"{row['prompt']} {row['gt']}" for row in verbmem_kept] + [
        row["text"] for row in privleak_kept
    ]
    forget_rows = [{"text": text} for text in excerpts] + qa_rows(forget_qa)
    retain_rows = [{"text": row["text"]} for row in retain] + qa_rows(retain_qa)
    holdout = read("privleak", "holdout")[:num_holdout]
    splits = {
        "raw": {
            "forget": forget_rows,
            "retain1": retain_rows,
            "holdout": [{"text": row["text"]} for row in holdout],
            "full": forget_rows + retain_rows,  # what Original trains on (as MUSE-News-Train's `full`)
        },
        "verbmem": {"forget": verbmem_kept},
        "knowmem": {"forget_qa": forget_qa, "retain_qa": retain_qa},
        "privleak": {
            "forget": privleak_kept,
            "retain": retain,
            "holdout": holdout,
        },
    }
    for config, names in COPIED_AS_IS.items():
        splits[config].update({name: read(config, name) for name in names})
    shutil.rmtree(data_dir, ignore_errors=True)
    for config, config_splits in splits.items():
        (data_dir / config).mkdir(parents=True, exist_ok=True)
        for split, rows in config_splits.items():
            write_jsonl(data_dir / config / f"{split}.jsonl", rows, list(rows[0]))
    _write_hub_readme(data_dir, splits, source_dir, kept)

    # Spans by the annotator's raw-text mode, word statistics from other BBC articles (never evaluation sets)
    background = Background(row["text"] for row in read("sust", "forget_2"))
    texts = [row["text"] for row in forget_rows]
    write_annotations(spans_path, texts, annotate_texts(texts, background), field="text")
    synthetic = synthetic_news(SYNTHETIC_ARTICLES, "held_out")
    synthetic_texts = [article.text for article in synthetic]
    agreement = word_agreement(
        synthetic_texts, [article.spans for article in synthetic], annotate_texts(synthetic_texts, background)
    )
    rows = {f"{config}/{split}": len(r) for config, s in splits.items() for split, r in s.items()}
    return MuseBenchmark(
        data_dir,
        spans_path,
        rows,
        f"MUSE-News subset: the {len(excerpts)} verbmem/privleak excerpts of {len(kept)} forget articles "
        f"(#{', #'.join(map(str, kept))}) + {len(forget_qa)} forget QA rows; {num_retain} privleak/retain "
        f"excerpts + {len(retain_qa)} retain QA rows; {num_holdout} holdout excerpts",
        agreement,
    )


def _write_hub_readme(data_dir: Path, splits: dict, source_dir: Path, kept: list[int]) -> None:
    configs = [
        {
            "config_name": config,
            "data_files": [{"split": split, "path": f"{config}/{split}.jsonl"} for split in config_splits],
        }
        for config, config_splits in splits.items()
    ]
    description = (
        f"Subset of MUSE-News from {source_dir} (palu_lab.benchmarks.muse_subset): raw/forget articles "
        f"{kept} of the source and its evaluation rows whose text lies in them."
    )
    write_configs_readme(data_dir, configs, description)
