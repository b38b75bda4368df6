"""QAwithSpansDataset and DataCollatorWithTokenRoles: roles on the framework's own tokens."""

import json

import pytest
import torch

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.method.roles import TokenRole, count_roles
from palu_trainer.spans.format import write_annotations
from palu_trainer.spans.tpo import import_tpo

from ..conftest import CHAT_TEMPLATE, TAG_TEMPLATE, write_jsonl

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


def span_dataset(tmp_path, tokenizer, template, rows=QA_ROWS, spans=QA_SPANS, max_length=512, n=2):
    ensure_importable()
    from palu_trainer.framework.datasets import QAwithSpansDataset

    data_file = write_jsonl(tmp_path / "qa.jsonl", rows)
    annotations = tmp_path / "spans.jsonl"
    write_annotations(annotations, [row["answer"] for row in rows], spans)
    return QAwithSpansDataset(
        span_annotations=annotations,
        num_initiating_tokens=n,
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
def test_dataset_marks_the_first_tokens_of_each_span(tmp_path, tokenizer, mode):
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
            assert decoded and span_text.startswith(decoded), (decoded, span_text)
    roles = dataset[2]["token_roles"]
    assert count_roles(roles)["n_initiating"] == 0 and count_roles(roles)["n_common"] > 0
    labels = dataset[0]["labels"]
    assert torch.equal(dataset[0]["token_roles"] == IGN, labels == -100)


def _saved(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_dataset_counts_spans_cut_by_max_length(tmp_path, tokenizer):
    dataset = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, max_length=16)
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


def test_gpt4o_spans_on_tofu_forget05_first_20_rows(tmp_path, tokenizer, shared_dir, tofu_dir):
    from palu_trainer.framework.datasets import QAwithSpansDataset

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
    tpo_rows = [json.loads(line) for line in tpo_file.read_text().splitlines()][:20]
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
            assert span_text.startswith(decoded) or decoded.startswith(span_text), (decoded, span_text)
            checked += 1
    assert checked >= 20


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
