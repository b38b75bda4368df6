"""The MUSE-News subset: evaluation rows kept exactly when their text lies in the chosen articles."""

import pytest
from datasets import load_dataset

from palu_lab.benchmarks.muse_subset import SEPARATOR, make_muse_subset, select_articles
from palu_trainer.spans.format import read_annotations, validate_annotations

from ...conftest import read_jsonl


@pytest.fixture(scope="module")
def subset(muse_news_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("muse")
    return make_muse_subset(muse_news_dir, out / "data", 2, 2, 3, out / "spans.jsonl")


def test_windows_hold_their_evaluation_rows_and_nothing_else_is_kept(subset, muse_news_dir):
    articles = [row["text"] for row in read_jsonl(muse_news_dir / "raw" / "forget.jsonl")]
    source_text = SEPARATOR.join(articles)
    forget_rows = [row["text"] for row in read_jsonl(subset.muse_dir / "raw" / "forget.jsonl")]
    qa_rows = [text for text in forget_rows if text.startswith("Question: ")]
    excerpts = [text for text in forget_rows if not text.startswith("Question: ")]
    assert all(excerpt in source_text for excerpt in excerpts)  # verbatim forget text
    verbmem = read_jsonl(subset.muse_dir / "verbmem" / "forget.jsonl")
    privleak = read_jsonl(subset.muse_dir / "privleak" / "forget.jsonl")
    assert len(verbmem) >= 2 and len(privleak) >= 2  # one of each per window, at least
    assert excerpts == [f"{row['prompt']} {row['gt']}" for row in verbmem] + [row["text"] for row in privleak]
    # the windows' articles hold no other privleak excerpt than those kept
    kept = [int(number) for number in subset.description.split("(#")[1].split(")")[0].split(", #")]
    window_text = SEPARATOR.join(articles[index] for index in kept)
    source_privleak = read_jsonl(muse_news_dir / "privleak" / "forget.jsonl")
    assert len(privleak) == sum(row["text"] in window_text for row in source_privleak)
    # KnowMem pairs are stated in their side's corpus too; holdout excerpts are never trained on
    assert len(qa_rows) == subset.rows["knowmem/forget_qa"] > 0
    full = {row["text"] for row in read_jsonl(subset.muse_dir / "raw" / "full.jsonl")}
    assert not full & {row["text"] for row in read_jsonl(subset.muse_dir / "raw" / "holdout.jsonl")}


def test_the_folder_loads_like_the_hub_dataset_and_spans_validate(subset):
    for config, split in (("raw", "retain1"), ("knowmem", "retain_qa_icl"), ("privleak", "holdout")):
        rows = load_dataset(str(subset.muse_dir), name=config, split=split)
        assert len(rows) == subset.rows[f"{config}/{split}"]
    texts = [row["text"] for row in read_jsonl(subset.muse_dir / "raw" / "forget.jsonl")]
    spans = validate_annotations(read_annotations(subset.span_annotations, "text"), texts, "spans", "text")
    assert sum(map(len, spans)) > 50 * len(texts[:4])
    assert subset.annotator_agreement.f1 > 0.85


def test_selection_refuses_more_windows_than_exist():
    articles = ["a b c", "d e f", "g h i"]
    assert select_articles(articles, ["a b c\n\nd e"], ["c\n\nd e f"], 1) == [0, 1]
    with pytest.raises(ValueError, match="only 1 article runs"):
        select_articles(articles, ["a b c\n\nd e"], ["c\n\nd e f"], 2)
