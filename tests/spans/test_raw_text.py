"""The annotator's raw-text mode (news prose): gold F1 on held-out synthetic news, determinism, CLI."""

import pytest

from palu_lab.benchmarks.synthetic_news import synthetic_news
from palu_trainer.spans.agreement import word_agreement
from palu_trainer.spans.annotator import Background, annotate_text, annotate_texts
from palu_trainer.spans.cli import main
from palu_trainer.spans.format import read_annotations, validate_annotations

from ..conftest import read_jsonl

# docs/muse.md, "Raw text with spans": measured once, after tuning on the tuning part only
HELD_OUT_WORD_F1 = 0.906


@pytest.fixture(scope="module")
def news_background(muse_news_dir):
    """Word statistics from other BBC articles (sust/forget_2), never the evaluation sets."""
    return Background(row["text"] for row in read_jsonl(muse_news_dir / "sust" / "forget_2.jsonl"))


def marked(text, spans):
    return [text[start:end] for start, end in spans]


def test_news_sentence_gets_names_places_dates_amounts_and_titles(news_background):
    text = (
        "Greek Prime Minister Kyriakos Mitsotakis said on Sunday that the £4.5m report, 'Safe Tracks', "
        "found costs rose by 12 per cent in Larissa."
    )
    assert marked(text, annotate_text(text, news_background)) == [
        "Greek Prime Minister Kyriakos Mitsotakis",
        "Sunday",
        "£4.5m",
        "Safe Tracks",
        "12 per cent",
        "Larissa",
    ]


def test_held_out_synthetic_news_word_f1(news_background):
    articles = synthetic_news(200, "held_out")
    texts = [article.text for article in articles]
    agreement = word_agreement(texts, [a.spans for a in articles], annotate_texts(texts, news_background))
    assert agreement.f1 >= HELD_OUT_WORD_F1 - 0.01
    assert min(agreement.precision, agreement.recall) >= 0.85


def test_synthetic_news_parts_share_no_vocabulary_and_gold_spans_are_facts():
    tuning, held_out = synthetic_news(50, "tuning"), synthetic_news(50, "held_out")
    tuning_facts = {a.text[s:e] for a in tuning for s, e in a.spans}
    held_out_facts = {a.text[s:e] for a in held_out for s, e in a.spans}
    words = lambda facts: {word for fact in facts for word in fact.split() if not word[0].isdigit()}  # noqa: E731
    assert not {w for w in words(tuning_facts) & words(held_out_facts) if w[0].isupper() and len(w) > 3} - {
        *"January February March April May June July August September October November December".split(),
        *"Monday Tuesday Wednesday Thursday Friday Saturday Sunday Court Magistrates' Crown".split(),
    }
    assert synthetic_news(5, "tuning", seed=1)[0].text == synthetic_news(5, "tuning", seed=1)[0].text
    for article in held_out:
        assert all(article.text[s:e].strip() == article.text[s:e] != "" for s, e in article.spans)


def test_annotator_is_deterministic_and_regenerates_the_shipped_file(muse_news_dir, news_background):
    from palu_trainer.framework.checkout import PROJECT_ROOT

    texts = [row["text"] for row in read_jsonl(muse_news_dir / "raw" / "forget.jsonl")]
    shipped = read_annotations(PROJECT_ROOT / "span_annotations" / "muse_news_forget.jsonl", "text")
    spans = validate_annotations(shipped, texts, "muse_news_forget.jsonl", field="text")
    first = annotate_texts(texts[:40], news_background)
    assert first == annotate_texts(texts[:40], news_background) == spans[:40]
    density = sum(e - s for row in spans for s, e in row) / sum(map(len, texts))
    assert 0.2 < density < 0.35  # README: 27.5% of the characters of real News


def test_cli_raw_text_mode_writes_text_sha1_and_refuses_evaluation_sets(tmp_path, muse_news_dir, capsys):
    from ..conftest import write_jsonl

    rows = [{"text": "Ann Lee moved to Oslo in 1961.\n\nShe paid £40m for it."}]
    dataset = write_jsonl(tmp_path / "raw.jsonl", rows)
    out = tmp_path / "spans.jsonl"
    main(["annotate", "--dataset", str(dataset), "--text-key", "text", "--out", str(out)])
    assert [row["spans"] for row in read_annotations(out, "text")] == [[[0, 7], [17, 21], [25, 29], [41, 45]]]
    main(["validate", "--dataset", str(dataset), "--text-key", "text", str(out)])
    assert "1 rows match the dataset" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        qa_mode = ["--question-key", "text", "--answer-key", "text"]  # QA mode reads answer_sha1 files
        main(["validate", "--dataset", str(dataset), *qa_mode, str(out)])
    assert exit_info.value.code == 1
    assert "spans.jsonl line 1: missing field(s) ['answer_sha1'] (it has text_sha1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            [
                "annotate",
                "--dataset",
                str(muse_news_dir),
                "--name",
                "knowmem",
                "--split",
                "forget_qa",
                "--text-key",
                "question",
                "--out",
                str(tmp_path / "x.jsonl"),
            ]
        )
    assert "'knowmem' is an evaluation set" in capsys.readouterr().err
