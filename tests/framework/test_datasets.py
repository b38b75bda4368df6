"""QAwithSpansDataset and DataCollatorWithTokenRoles: roles on the framework's own tokens."""

import configparser
import json
import logging
import math
from pathlib import Path

import pytest
import tokenizers
import torch
from packaging.requirements import Requirement
from transformers import PreTrainedTokenizerFast

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.method.roles import TokenRole, count_roles
from palu_trainer.spans.format import AnnotationError, write_annotations
from palu_trainer.spans.tpo_spans import import_tpo

from ..conftest import CHAT_TEMPLATE, TAG_TEMPLATE, llama3_style_tokenizer, write_jsonl

IGN, COM, INI, RED = (int(role) for role in TokenRole)


QA_ROWS = [
    {"question": "Where was Ann Lee born?", "answer": "Ann Lee was born in Oslo, Norway, in 1961."},
    {"question": "What did she write?", "answer": "She wrote 'The Silent Harbour' and 'Winter Lights'."},
    {"question": "Anything else?", "answer": "There is no publicly available information on that."},
]
QA_SPAN_TEXTS = [["Ann Lee", "Oslo", "Norway", "1961"], ["The Silent Harbour", "Winter Lights"], []]
QA_SPANS = [
    [(row["answer"].index(text), row["answer"].index(text) + len(text)) for text in texts]
    for row, texts in zip(QA_ROWS, QA_SPAN_TEXTS)
]


def span_dataset(tmp_path, tokenizer, template, rows=QA_ROWS, spans=QA_SPANS, max_length=512, n=2, **options):
    ensure_importable()
    from palu_trainer.framework.datasets import QAwithSpansDataset

    data_file = write_jsonl(tmp_path / "qa.jsonl", rows)
    annotations = tmp_path / "spans.jsonl"
    write_annotations(annotations, [row["answer"] for row in rows], spans)
    return QAwithSpansDataset(
        span_annotations=annotations,
        num_initiating_tokens=n,
        **options,
        hf_args={"path": "json", "data_files": str(data_file), "split": "train"},
        template_args=template,
        tokenizer=tokenizer,
        max_length=max_length,
    )


def initiating_text_per_span(dataset, tokenizer, position):
    """Decoded initiating tokens of each span of a row, in order, split at span changes."""
    item = dataset[position]
    ids, roles = item["input_ids"].tolist(), item["token_roles"].tolist()
    groups, current = [], []
    for token, role in zip(ids, roles):
        if role == INI:
            current.append(token)
        elif current:
            groups.append(tokenizer.decode(current).strip())
            current = []
    return groups


@pytest.mark.parametrize("mode", ["tags", "chat"])
def test_dataset_marks_the_first_tokens_of_each_span(tmp_path, any_tokenizer, mode):
    tokenizer = any_tokenizer
    template = TAG_TEMPLATE
    if mode == "chat":
        tokenizer = tokenizer.__class__.from_pretrained(_saved(tokenizer, tmp_path))
        tokenizer.chat_template = CHAT_TEMPLATE
        template = {"apply_chat_template": True}
    dataset = span_dataset(tmp_path, tokenizer, template, n=1)
    for position, spans in enumerate(QA_SPANS):
        answer = QA_ROWS[position]["answer"]
        texts = [answer[start:end] for start, end in spans]
        initiating = initiating_text_per_span(dataset, tokenizer, position)
        assert len(initiating) == len(texts)
        for decoded, span_text in zip(initiating, texts):
            # A SentencePiece piece may start with the opening quote ("'The" for "The Silent Harbour").
            assert decoded and span_text.startswith(decoded.lstrip("'")), (decoded, span_text)
    roles = dataset[2]["token_roles"]
    assert count_roles(roles)["n_initiating"] == 0 and count_roles(roles)["n_common"] > 0
    labels = dataset[0]["labels"]
    assert torch.equal(dataset[0]["token_roles"] == IGN, labels == -100)


def span_token_roles(dataset, position):
    """Roles of the tokens of each span of a row (spans in answer order)."""
    item = dataset[position]
    roles = item["token_roles"].tolist()
    return [roles[start:end] for start, end in token_ranges_of_spans(dataset, position)]


def token_ranges_of_spans(dataset, position):
    """[first, last + 1) token positions of each span, from the roles' runs of initiating/redundant tokens."""
    roles, ranges, start = dataset[position]["token_roles"].tolist(), [], None
    for index, role in enumerate([*roles, COM]):
        if role in (INI, RED) and start is None:
            start = index
        elif role not in (INI, RED) and start is not None:
            ranges.append((start, index))
            start = None
    return ranges


def test_dataset_applies_each_initiating_strategy(tmp_path, tokenizer):
    built = {
        name: span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, **policy)
        for name, policy in {
            "first_n": {"n": 1},
            "all": {"n": None, "initiating_strategy": "all"},
            "ratio": {"n": None, "initiating_strategy": "ratio", "initiating_ratio": 0.5},
            "random_n": {"n": 1, "initiating_strategy": "random_n", "initiating_seed": 3},
        }.items()
    }
    everything = [role for span in span_token_roles(built["all"], 1) for role in span]
    assert everything and set(everything) == {INI}
    for position in range(len(QA_ROWS)):
        spans = span_token_roles(built["all"], position)
        lengths = [len(span) for span in spans]
        assert [span.count(INI) for span in span_token_roles(built["first_n"], position)] == [1] * len(spans)
        assert [span[0] for span in span_token_roles(built["first_n"], position)] == [INI] * len(spans)
        ratio = span_token_roles(built["ratio"], position)
        assert [span.count(INI) for span in ratio] == [math.ceil(length / 2) for length in lengths]
        assert all(span == sorted(span, key=lambda role: role != INI) for span in ratio)  # a prefix
        drawn = span_token_roles(built["random_n"], position)
        assert [span.count(INI) for span in drawn] == [1] * len(spans)
    multi_token = [span for p in range(3) for span in span_token_roles(built["random_n"], p) if len(span) > 1]
    assert any(span[0] != INI for span in multi_token)  # not always the first token
    again = span_dataset(
        tmp_path, tokenizer, TAG_TEMPLATE, n=1, initiating_strategy="random_n", initiating_seed=3
    )
    assert all(torch.equal(again[p]["token_roles"], built["random_n"][p]["token_roles"]) for p in range(3))


def test_dataset_rejects_a_bad_policy_before_loading(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="^initiating_strategy='prefix'; choose one of first_n, all, ratio"):
        span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, initiating_strategy="prefix")


def _saved(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_dataset_counts_spans_cut_by_max_length(tmp_path, tokenizer):
    dataset = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, max_length=16, min_initiating_tokens=0)
    first = dataset[0]
    assert len(first["input_ids"]) <= 17  # max_length plus the appended EOS
    assert first["spans_cut"] + first["spans_dropped"] >= 1
    assert first["token_roles"].shape == first["labels"].shape


def test_collator_pads_roles_with_ignored(tmp_path, tokenizer):
    from palu_trainer.framework.datasets import DataCollatorWithTokenRoles

    dataset = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE)
    batch = DataCollatorWithTokenRoles(tokenizer, index="index")(
        [{"forget": dataset[0]}, {"forget": dataset[2]}]
    )["forget"]
    assert batch["token_roles"].shape == batch["input_ids"].shape
    short = min(len(dataset[0]["input_ids"]), len(dataset[2]["input_ids"]))
    longest = batch["input_ids"].shape[1]
    shorter_row = 0 if len(dataset[0]["input_ids"]) == short else 1
    assert batch["token_roles"][shorter_row, short:].tolist() == [IGN] * (longest - short)
    assert batch["index"].tolist() == [0, 2]


def test_collator_takes_retain_chunks_without_an_index(tmp_path, tokenizer):
    """MUSE's stock retain set (PretrainingDataset chunks) has no row index; forget rows keep theirs."""
    import torch

    from palu_trainer.framework.datasets import DataCollatorWithTokenRoles

    dataset = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE)
    chunk = {"input_ids": torch.tensor([1, 5, 6]), "labels": torch.tensor([-100, 5, 6])}
    chunk["attention_mask"] = torch.ones(3, dtype=torch.long)
    collator = DataCollatorWithTokenRoles(tokenizer, index="index")
    batch = collator([{"forget": dataset[0], "retain": chunk}, {"forget": dataset[1], "retain": chunk}])
    assert "index" not in batch["retain"] and batch["retain"]["input_ids"].shape == (2, 3)
    assert batch["forget"]["index"].tolist() == [0, 1] and collator.index == "index"


def test_gpt4o_spans_on_tofu_forget05_first_100_rows(tmp_path, any_tokenizer, shared_dir, tofu_dir):
    """Every span's first tokens initiate it, with byte-level, SentencePiece and Llama-3-style tokenizers."""
    from palu_trainer.framework.datasets import QAwithSpansDataset

    tokenizer = any_tokenizer
    annotations = tmp_path / "forget05.jsonl"
    tpo_file = shared_dir / "data" / "tofu_spans_gpt4o" / "forget05.jsonl"
    import_tpo(tpo_file, annotations)
    dataset = QAwithSpansDataset(
        span_annotations=annotations,
        num_initiating_tokens=3,
        hf_args={"path": str(tofu_dir), "name": "forget05", "split": "train"},
        template_args=TAG_TEMPLATE,
        tokenizer=tokenizer,
    )
    tpo_rows = [json.loads(line) for line in tpo_file.read_text().splitlines()][:100]
    checked = 0
    for position, tpo_row in enumerate(tpo_rows):
        item = dataset[position]
        ids, roles = item["input_ids"].tolist(), item["token_roles"].tolist()
        for start, end in dataset.spans[position]:
            span_text = tpo_row["answer"][start:end]
            first_tokens = _tokens_of_span(dataset, position, start, end)
            initiating = [ids[i] for i in first_tokens if roles[i] == INI]
            assert initiating == [ids[i] for i in first_tokens[:3]]
            decoded = tokenizer.decode(initiating).strip()
            decoded = decoded.lstrip("'\"")  # a SentencePiece piece may start with the opening quote
            assert span_text.startswith(decoded) or decoded.startswith(span_text), (decoded, span_text)
            checked += 1
    assert checked >= 200


def _tokens_of_span(dataset, position, start, end):
    row = dataset.data[position]
    text, answer_start = dataset._templated_text(row["question"], row["answer"])
    offsets = dataset._token_offsets(text, dataset[position]["input_ids"].tolist(), position)
    labels = dataset[position]["labels"].tolist()
    return [
        i
        for i, (s, e) in enumerate(offsets)
        if labels[i] != -100 and e > s and s - answer_start < end and e - answer_start > start
    ]


class ZeroWidthWholeWords(PreTrainedTokenizerFast):
    """tokenizers 0.20.0 on an ignore_merges tokenizer: whole-word tokens get offsets (start, start)."""

    def __call__(self, *args, **kwargs):
        encoding = super().__call__(*args, **kwargs)
        if "offset_mapping" in encoding:
            tokens = self.convert_ids_to_tokens(encoding["input_ids"])
            encoding["offset_mapping"] = [
                (start, start) if token.startswith("Ġ") and end - start > 3 else (start, end)
                for token, (start, end) in zip(tokens, encoding["offset_mapping"])
            ]
        return encoding


def test_zero_width_answer_offsets_stop_the_dataset(tmp_path, tofu_rows):
    texts = [row["question"] + "\n" + row["answer"] for row in tofu_rows]
    llama3 = llama3_style_tokenizer(texts)
    broken = ZeroWidthWholeWords(
        tokenizer_object=llama3.backend_tokenizer,
        bos_token=llama3.bos_token,
        eos_token=llama3.eos_token,
        pad_token=llama3.pad_token,
        clean_up_tokenization_spaces=False,
    )
    assert span_dataset(tmp_path, llama3, TAG_TEMPLATE)[0]["token_roles"].eq(INI).any()
    with pytest.raises(
        AnnotationError, match=r"spans\.jsonl row 0: .*answer token 'Ġ\w+' the empty character"
    ):
        span_dataset(tmp_path, broken, TAG_TEMPLATE)
    with pytest.raises(AnnotationError, match=r"install tokenizers>=0\.20\.1"):
        span_dataset(tmp_path, broken, TAG_TEMPLATE)


def test_setup_cfg_excludes_the_tokenizers_with_zero_width_offsets():
    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    requirements = [Requirement(line) for line in config["options"]["install_requires"].split("\n") if line]
    (pin,) = [requirement for requirement in requirements if requirement.name == "tokenizers"]
    assert not pin.specifier.contains("0.20.0") and pin.specifier.contains("0.20.1")
    assert pin.specifier.contains(tokenizers.__version__)


@pytest.mark.parametrize(
    ("spans", "max_length", "message"),
    [
        (
            [[], [], []],
            512,
            r"0 initiating tokens in 3 forget rows, fewer than min_initiating_tokens=1 \(0 spans",
        ),
        (QA_SPANS, 12, r"0 initiating tokens .* \(6 spans, 6 of them dropped by max_length=12\)"),
    ],
)
def test_a_forget_set_without_initiating_tokens_stops_before_training(
    tmp_path, tokenizer, spans, max_length, message
):
    with pytest.raises(AnnotationError, match=message + ".*retain-only training.*min_initiating_tokens=0"):
        span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, spans=spans, max_length=max_length)
    allowed = span_dataset(
        tmp_path, tokenizer, TAG_TEMPLATE, spans=spans, max_length=max_length, min_initiating_tokens=0
    )
    assert sum(count_roles(item["token_roles"])["n_initiating"] for item in allowed.items) == 0


def test_min_initiating_tokens_counts_the_whole_forget_set(tmp_path, tokenizer):
    dataset = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, n=1)
    found = sum(count_roles(item["token_roles"])["n_initiating"] for item in dataset.items)
    assert found == 6  # one per span
    span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, n=1, min_initiating_tokens=6)
    with pytest.raises(
        AnnotationError, match="6 initiating tokens in 3 forget rows, fewer than min_initiating_tokens=7"
    ):
        span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, n=1, min_initiating_tokens=7)
    with pytest.raises(
        ValueError, match=r"min_initiating_tokens='none': give auto \(one per 10 forget rows\) or an"
    ):
        span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, min_initiating_tokens="none")


def test_spans_inside_words_are_counted_in_the_log(tmp_path, tokenizer, caplog):
    spans = [[(0, 5), (20, 24)], [], []]  # "Ann L|ee", "Oslo"
    with caplog.at_level(logging.WARNING, logger="palu_trainer.framework.datasets"):
        span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, spans=spans)
    assert "spans.jsonl: 1 span(s) in 1 row(s) start or end inside a word (rows 0)" in caplog.text
