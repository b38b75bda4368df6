"""Forget-set dataset with per-token PALU roles, and the collator that pads them."""

import logging

import torch

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.method.initiating import InitiatingPolicy
from palu_trainer.method.roles import TokenRole, assign_token_roles, count_roles
from palu_trainer.spans.format import AnnotationError, read_annotations, validate_annotations

ensure_importable()
from data.collators import DataCollatorForSupervisedDataset  # noqa: E402
from data.qa import QADataset  # noqa: E402
from data.utils import IGNORE_INDEX  # noqa: E402

logger = logging.getLogger(__name__)


class QAwithSpansDataset(QADataset):
    """open-unlearning's QADataset whose items also carry `token_roles` (T,) from span annotations.

    Spans are validated against the dataset and every row is tokenised once, here, so that a bad
    file or a template/tokenizer mismatch stops the run before training starts. The dataset owns the
    initiating policy (N = `num_initiating_tokens`): roles are fixed here for the whole run.
    """

    def __init__(self, span_annotations, num_initiating_tokens=3, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.fs_data is not None or self.predict_with_generate:
            raise ValueError("QAwithSpansDataset serves training rows only: no few-shot, no generation")
        self.span_annotations = str(span_annotations)
        self.initiating_policy = InitiatingPolicy(num_initiating_tokens)
        rows = read_annotations(self.span_annotations)
        self.spans = validate_annotations(rows, self.data[self.answer_key], source=self.span_annotations)
        self.items = [self._item_with_roles(position) for position in range(len(self.data))]
        self._log_summary()

    def __getitem__(self, idx):
        return self.items[idx]

    def _item_with_roles(self, position: int) -> dict:
        row = self.data[position]
        item = self._process_sample(
            question=row[self.question_key], answer=row[self.answer_key], index=row["index"]
        )
        text, answer_start = self._templated_text(row[self.question_key], row[self.answer_key])
        offsets = self._token_offsets(text, item["input_ids"].tolist(), position)
        answer_offsets = [(start - answer_start, end - answer_start) for start, end in offsets]
        assignment = assign_token_roles(
            answer_offsets,
            (item["labels"] != IGNORE_INDEX).tolist(),
            self.spans[position],
            self.initiating_policy,
        )
        item["token_roles"] = assignment.roles
        item["spans_cut"] = assignment.spans_cut
        item["spans_dropped"] = assignment.spans_dropped
        return item

    def _templated_text(self, question: str, answer: str) -> tuple[str, int]:
        """The text the framework tokenises for this row and where the answer starts in it."""
        template = self.template_args
        if not template["apply_chat_template"]:
            text = (
                (template.get("system_prompt_with_special_tokens") or "")
                + template["user_start_tag"]
                + question
                + template["user_end_tag"]
                + template["asst_start_tag"]
                + answer
            )
            return text, len(text) - len(answer)
        chat = (
            [{"role": "system", "content": template["system_prompt"]}]
            if template.get("system_prompt")
            else []
        )
        chat += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        date = {"date_string": template["date_string"]} if template.get("date_string") else {}
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False, **date)
        # Chat templates may trim the message; spans stay in the untrimmed answer's coordinates.
        leading = len(answer) - len(answer.lstrip())
        return text, text.rfind(answer.strip()) - leading

    def _token_offsets(self, text: str, input_ids: list[int], position: int) -> list[tuple[int, int]]:
        """Character range of each of the framework's tokens, checked to be the same tokens."""
        chat_mode = self.template_args["apply_chat_template"]
        encoding = self.tokenizer(
            text,
            add_special_tokens=not chat_mode,
            truncation=not chat_mode,
            max_length=self.max_length,
            return_offsets_mapping=True,
        )
        ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
        appended_eos = len(input_ids) == len(ids) + 1 and input_ids[-1] == self.tokenizer.eos_token_id
        if input_ids[: len(ids)] != ids or not (len(input_ids) == len(ids) or appended_eos):
            raise AnnotationError(
                f"{self.span_annotations} row {position}: tokenising the templated text with offsets "
                "gave other tokens than the framework's preprocessing; check template_args and the tokenizer"
            )
        return list(offsets) + [(0, 0)] * (len(input_ids) - len(ids))

    def _log_summary(self):
        roles = torch.cat([item["token_roles"] for item in self.items])
        counts = count_roles(roles)
        logger.info(
            "%s: %d rows, %d spans (%d rows without a span), %d spans cut and %d dropped by max_length=%d; "
            "%s; tokens: %d initiating, %d common, %d redundant",
            self.span_annotations,
            len(self.items),
            sum(len(spans) for spans in self.spans),
            sum(1 for spans in self.spans if not spans),
            sum(item["spans_cut"] for item in self.items),
            sum(item["spans_dropped"] for item in self.items),
            self.max_length,
            self.initiating_policy,
            counts["n_initiating"],
            counts["n_common"],
            counts["n_redundant"],
        )


class DataCollatorWithTokenRoles(DataCollatorForSupervisedDataset):
    """The framework's collator, also padding `token_roles` with IGNORED and keeping row indices.

    PALU's reference cache looks batch rows up by their dataset `index`, so it is kept by default.
    """

    def __init__(self, tokenizer, padding_side="right", index="index"):
        super().__init__(tokenizer, padding_side=padding_side, index=index)

    def __call__(self, instances):
        batch = super().__call__(instances)
        if "token_roles" in instances[0]:
            roles = [instance["token_roles"] for instance in instances]
            batch["token_roles"] = self._pad_tokens(roles, int(TokenRole.IGNORED))
        return batch


def require_token_roles(trainer, method: str, experiment: str) -> None:
    """Stop before training when a span-based trainer's forget batches carry no `token_roles`."""
    forget = getattr(trainer.train_dataset, "forget", None)
    if forget is None or len(forget) == 0:
        return
    if "token_roles" not in trainer.data_collator([forget[0]]):
        raise ValueError(
            f"{method} needs token roles in the forget batches: use the QAwithSpansDataset handler for the "
            f"forget set and the DataCollatorWithTokenRoles collator ({experiment} does)"
        )
