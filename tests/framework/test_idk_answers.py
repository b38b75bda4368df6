"""The local "I don't know" file is what the framework's QAwithIdkDataset (DPO's forget set) reads."""

from transformers import AutoTokenizer

from palu_lab.benchmarks.dataset_folders import IDK_ANSWERS, write_idk_answers
from palu_trainer.framework.checkout import ensure_importable

from ..conftest import TAG_TEMPLATE, write_jsonl
from .test_datasets import QA_ROWS


def test_dpo_forget_rows_pair_each_answer_with_a_local_idk_answer(tmp_path, tiny_model_dir):
    ensure_importable()
    from data.qa import QAwithIdkDataset

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = QAwithIdkDataset(
        idk_path=str(write_idk_answers(tmp_path)),
        hf_args={
            "path": "json",
            "data_files": str(write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)),
            "split": "train",
        },
        template_args=TAG_TEMPLATE,
        tokenizer=tokenizer,
        max_length=256,
    )
    assert [line.strip() for line in dataset.idk_responses] == list(IDK_ANSWERS)
    for position, row in enumerate(QA_ROWS):
        item = dataset[position]
        for part, expected in (("original", [row["answer"]]), ("alternate", IDK_ANSWERS)):
            labels = item[part]["labels"]
            answer = tokenizer.decode(labels[labels != -100], skip_special_tokens=True).strip()
            assert answer in expected, (part, answer)
