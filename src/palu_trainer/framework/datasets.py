"""Forget-set dataset with per-token PALU roles, and the collator that pads them."""

import logging
import math

import tokenizers
import torch

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.method.initiating import InitiatingPolicy
from palu_trainer.method.roles import TokenRole, assign_token_roles, count_roles
from palu_trainer.spans.format import (
    AnnotationError,
    read_annotations,
    validate_annotations,
    word_cut_warning,
)

ensure_importable()
from data.collators import DataCollatorForSupervisedDataset  # noqa: E402
from data.qa import QADataset  # noqa: E402
from data.utils import IGNORE_INDEX  # noqa: E402

logger = logging.getLogger(__name__)


class QAwithSpansDataset(QADataset):
    """open-unlearning's QADataset whose items also carry `token_roles` (T,) from span annotations.

    Spans are validated against the dataset and every row is tokenised once, here, so that a bad
    file or a template/tokenizer mismatch stops the run before training starts. The dataset owns the
    initiating policy (`palu_trainer.method.initiating.InitiatingPolicy`: N = `num_initiating_tokens`,
    `initiating_strategy`, `initiating_ratio`, `initiating_seed`, `merge_adjacent_spans`): roles are fixed
    here for the whole run.

    `min_initiating_tokens`: below this many initiating tokens over the whole forget set (no span in
    the file, or every span cut by `max_length`), PALU's forget loss is ~0 and the run would be retain-only
    training: it stops here. `auto` is one per 10 forget rows (rounded up); 0 allows it.
    """

    def __init__(
        self,
        span_annotations,
        num_initiating_tokens=3,
        initiating_strategy="first_n",
        initiating_ratio=0.5,
        initiating_seed=0,
        merge_adjacent_spans=False,
        min_initiating_tokens="auto",
        *args,
        **kwargs,
    ):
        self.initiating_policy = InitiatingPolicy(
            num_initiating_tokens,
            initiating_strategy,
            initiating_ratio,
            initiating_seed,
            merge_adjacent_spans,
        )
        super().__init__(*args, **kwargs)
        if self.fs_data is not None or self.predict_with_generate:
            raise ValueError("QAwithSpansDataset serves training rows only: no few-shot, no generation")
        self.span_annotations = str(span_annotations)
        rows = read_annotations(self.span_annotations)
        answers = self.data[self.answer_key]
        self.spans = validate_annotations(rows, answers, source=self.span_annotations)
        warning = word_cut_warning(answers, self.spans, self.span_annotations)
        if warning:
            logger.warning(warning)
        self.items = [self._item_with_roles(position) for position in range(len(self.data))]
        self._log_summary()
        self._check_initiating_tokens(min_initiating_tokens)

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
        is_label = (item["labels"] != IGNORE_INDEX).tolist()
        self._refuse_zero_width_offsets(item["input_ids"].tolist(), offsets, is_label, position)
        assignment = assign_token_roles(
            answer_offsets,
            is_label,
            self.spans[position],
            self.initiating_policy,
            row=int(row["index"]),
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

    def _refuse_zero_width_offsets(self, input_ids, offsets, is_label, position):
        """Every non-special answer token must cover characters, or it gets no span role.

        tokenizers 0.20.0 gives whole-word tokens of `ignore_merges` tokenizers (Llama-3) the offsets
        (start, start) (tokenizers #1553, fixed in 0.20.1).
        """
        special = set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)
        for token, (start, end), label in zip(input_ids, offsets, is_label):
            if label and start == end and token not in special:
                name = self.tokenizer.convert_ids_to_tokens(token)
                raise AnnotationError(
                    f"{self.span_annotations} row {position}: the tokenizer gives answer token {name!r} the "
                    f"empty character range ({start}, {end}), so span roles cannot be placed (tokenizers "
                    f"{tokenizers.__version__}; 0.20.0 does this to Llama-3-style tokenizers): install "
                    "tokenizers>=0.20.1"
                )

    def _check_initiating_tokens(self, min_initiating_tokens):
        source = "set"
        if min_initiating_tokens == "auto":
            min_initiating_tokens, source = math.ceil(len(self.items) / 10), "auto: one per 10 forget rows"
        if (
            isinstance(min_initiating_tokens, bool)
            or not isinstance(min_initiating_tokens, int)
            or min_initiating_tokens < 0
        ):
            raise ValueError(
                f"min_initiating_tokens must be auto or an integer >= 0, got {min_initiating_tokens!r}"
            )
        found = sum(count_roles(item["token_roles"])["n_initiating"] for item in self.items)
        logger.info(
            "min_initiating_tokens=%d (%s); the forget set has %d", min_initiating_tokens, source, found
        )
        if found < min_initiating_tokens:
            dropped = sum(item["spans_dropped"] for item in self.items)
            raise AnnotationError(
                f"{self.span_annotations}: {found} initiating tokens in {len(self.items)} forget rows, fewer "
                f"than min_initiating_tokens={min_initiating_tokens} ({sum(map(len, self.spans))} spans, "
                f"{dropped} of them dropped by max_length={self.max_length}): "
                "PALU's forget loss would be ~0 and the run retain-only training. Annotate the spans, raise "
                "max_length, or set min_initiating_tokens=0 to train anyway"
            )

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
