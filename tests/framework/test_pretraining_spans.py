"""PretrainingWithSpansDataset: roles through the framework's join -> chunk -> decode -> re-tokenize path."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from palu_lab.tiny import BOS, EOS, PAD, as_llama_style, train_bpe_tokenizer
from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.method.roles import TokenRole
from palu_trainer.spans.format import AnnotationError, read_annotations, write_annotations

from ..conftest import read_jsonl, write_jsonl

IGN, COM, INI, RED = (int(role) for role in TokenRole)
ARTICLES = 12
MAX_LENGTH = 96  # short chunks: many chunk edges, inside words, spans and multi-byte characters


def sentencepiece_style_tokenizer(texts, vocab_size=600) -> PreTrainedTokenizerFast:
    """Llama-2 style: BPE over "▁"-marked words (Metaspace), rare characters as <0xNN> byte tokens."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], limit_alphabet=60, show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    spec = json.loads(tokenizer.to_str())
    for byte in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return as_llama_style(tokenizer)


@pytest.fixture(scope="module")
def news(muse_news_dir, tmp_path_factory):
    """The first News articles, their shipped spans, as a local dataset file and a text_sha1 file."""
    from palu_trainer.framework.checkout import PROJECT_ROOT

    rows = read_jsonl(muse_news_dir / "raw" / "forget.jsonl")[:ARTICLES]
    shipped = read_annotations(PROJECT_ROOT / "span_annotations" / "muse_news_forget.jsonl", "text")
    directory = tmp_path_factory.mktemp("news")
    data_file = write_jsonl(directory / "forget.jsonl", rows)
    spans_file = directory / "spans.jsonl"
    texts = [row["text"] for row in rows]
    write_annotations(spans_file, texts, [row["spans"] for row in shipped[:ARTICLES]], field="text")
    return texts, data_file, spans_file


@pytest.fixture(scope="module", params=["byte-level BPE", "SentencePiece-style BPE"])
def tokenizer(request, news):
    texts = news[0]
    if request.param == "byte-level BPE":
        return train_bpe_tokenizer(texts, vocab_size=800)
    return sentencepiece_style_tokenizer(texts)


def pretraining_dataset(tokenizer, data_file, spans_file, n=2):
    ensure_importable()
    from palu_trainer.framework.datasets import PretrainingWithSpansDataset

    return PretrainingWithSpansDataset(
        hf_args={"path": "json", "data_files": str(data_file), "split": "train"},
        template_args={},
        tokenizer=tokenizer,
        span_annotations=spans_file,
        num_initiating_tokens=n,
        max_length=MAX_LENGTH,
    )


def decoded_pieces(tokenizer, ids):
    """Each token's text by decoding growing prefixes; None where a prefix does not extend (split bytes)."""
    pieces, previous = [None], ""
    for end in range(2, len(ids) + 1):
        text = tokenizer.decode(ids[1:end])
        pieces.append(text[len(previous) :] if text.startswith(previous) else None)
        previous = text
    return pieces


def test_roles_match_the_spans_on_the_frameworks_final_tokens(news, tokenizer):
    texts, data_file, spans_file = news
    dataset = pretraining_dataset(tokenizer, data_file, spans_file)
    ensure_importable()
    from data.pretraining import PretrainingDataset

    stock = PretrainingDataset(
        hf_args={"path": "json", "data_files": str(data_file), "split": "train"},
        template_args={},
        tokenizer=tokenizer,
        max_length=MAX_LENGTH,
    )
    assert len(dataset) == len(stock) > 2 * ARTICLES
    joined = "\n\n".join(texts)
    in_span = [False] * len(joined)
    offset = 0
    for text, row in zip(texts, read_annotations(spans_file, "text")):
        for start, end in row["spans"]:
            in_span[offset + start : offset + end] = [True] * (end - start)
        offset += len(text) + 2

    checked, unplaced, cursor = 0, 0, 0
    for index in range(len(dataset)):
        item, framework_item = dataset[index], stock[index]
        assert item["input_ids"].tolist() == list(framework_item["input_ids"])  # the framework's own tokens
        assert item["labels"].tolist() == list(framework_item["labels"])
        ids, roles = item["input_ids"].tolist(), item["token_roles"].tolist()
        previous_in_span = False
        for position, piece in enumerate(decoded_pieces(tokenizer, ids)):
            if item["labels"][position] == -100:
                assert roles[position] == IGN
                continue
            if (
                piece is None or "\ufffd" in piece
            ):  # part of a multi-byte character: the oracle cannot place it
                unplaced += roles[position] == IGN
                previous_in_span = None  # unknown: the next token's initiating role is not checked
                continue
            if not piece:  # a chunk's leading "▁", stripped on decode: it belongs to the word after it
                unplaced += roles[position] == IGN
                continue
            assert roles[position] != IGN, (index, position, piece)  # text that can be placed is placed
            text = piece.strip() or piece  # whitespace tokens stand where they are
            found = joined.find(text, cursor)
            assert 0 <= found - cursor <= 16, (index, position, piece)  # after unplaceable bytes
            token_in_span = any(in_span[found : found + len(text)])
            cursor = found + len(text)
            assert (roles[position] in (INI, RED)) == token_in_span, (index, position, piece)
            if token_in_span and previous_in_span is False:
                assert roles[position] == INI, (index, position, piece)  # a span's first token initiates it
            previous_in_span = token_in_span
            checked += 1
    assert checked > 0.95 * sum(len(item["input_ids"]) - 1 for item in dataset.items)
    assert unplaced == dataset.stats["tokens_unplaced"]
    roles = [role for item in dataset.items for role in item["token_roles"].tolist()]
    assert roles.count(INI) > 100 and roles.count(RED) > 100 and roles.count(COM) > roles.count(INI)
    assert dataset.stats["spans_split"] > 0  # chunk edges cut spans, and are counted


def test_byte_fallback_cuts_at_chunk_edges_are_counted_not_guessed(news):
    texts, data_file, spans_file = news
    dataset = pretraining_dataset(sentencepiece_style_tokenizer(texts), data_file, spans_file)
    assert dataset.stats["chunks_realigned"] > 0  # Metaspace drops each chunk's leading space on decode
    ignored_labels = sum(
        int(((item["token_roles"] == IGN) & (item["labels"] != -100)).sum()) for item in dataset.items
    )
    assert ignored_labels == dataset.stats["tokens_unplaced"]


def test_a_qa_annotation_file_is_refused_naming_file_row_and_problem(news, tmp_path):
    texts, data_file, _ = news
    qa_file = tmp_path / "qa_spans.jsonl"
    write_annotations(qa_file, texts, [[] for _ in texts])  # answer_sha1: made for QA rows
    with pytest.raises(
        AnnotationError,
        match=r"qa_spans\.jsonl line 1: missing field\(s\) \['text_sha1'\] \(it has answer_sha1",
    ):
        pretraining_dataset(train_bpe_tokenizer(texts, vocab_size=400), data_file, qa_file)
    shifted = tmp_path / "shifted.jsonl"
    write_annotations(shifted, texts[1:] + texts[:1], [[] for _ in texts], field="text")
    with pytest.raises(AnnotationError, match=r"shifted\.jsonl row 0: text fingerprint differs"):
        pretraining_dataset(train_bpe_tokenizer(texts, vocab_size=400), data_file, shifted)
