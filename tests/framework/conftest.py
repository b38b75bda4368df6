"""Fixtures of the framework tests: a PALU (or TPO) trainer on the tiny model in-process, and a TOFU mirror
for palu-train runs."""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from palu_lab.trainer_config import tokenizer_keyword
from palu_trainer.framework.checkout import ensure_importable

from ..conftest import TAG_TEMPLATE
from .test_datasets import QA_ROWS, QA_SPANS, span_dataset

ensure_importable()
from data.unlearn import ForgetRetainDataset  # noqa: E402

from palu_trainer.framework.datasets import DataCollatorWithTokenRoles  # noqa: E402
from palu_trainer.framework.trainers.palu import PALUTrainer  # noqa: E402


@pytest.fixture
def make_trainer(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def build(
        max_steps=3,
        num_initiating_tokens=3,
        collator=DataCollatorWithTokenRoles,
        policy=None,
        trainer_class=PALUTrainer,
        gradient_accumulation_steps=1,
        model=None,
        training_arguments=None,
        **method_args,
    ):
        model = model or AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        forget = span_dataset(
            tmp_path, tokenizer, TAG_TEMPLATE, QA_ROWS, QA_SPANS, n=num_initiating_tokens, **(policy or {})
        )
        retain = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, QA_ROWS, QA_SPANS)
        args = TrainingArguments(
            **{
                "output_dir": str(tmp_path / "out"),
                "max_steps": max_steps,
                "per_device_train_batch_size": 3,
                "gradient_accumulation_steps": gradient_accumulation_steps,
                "learning_rate": 1e-2,
                "logging_steps": 1,
                "report_to": [],
                "save_strategy": "no",
                "use_cpu": True,
                "remove_unused_columns": False,
                **(training_arguments or {}),
            }
        )
        return trainer_class(
            model=model,
            args=args,
            train_dataset=ForgetRetainDataset(forget=forget, retain=retain),
            **tokenizer_keyword(tokenizer),
            data_collator=collator(tokenizer, index="index"),
            template_args=TAG_TEMPLATE,
            **method_args,
        )

    return build
