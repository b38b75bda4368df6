"""Forget-set datasets with per-token PALU roles (QA rows, raw text), and the collator that pads them."""

import difflib
import logging
import math

import tokenizers
import torch
from pydantic import ConfigDict

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.method.initiating import InitiatingOptions, InitiatingPolicy
from palu_trainer.method.roles import TokenRole, assign_token_roles, count_roles
from palu_trainer.spans.format import (
    AnnotationError,
    read_annotations,
    validate_annotations,
    word_cut_warning,
)
from palu_trainer.training.run_guard import RunStopped
from palu_trainer.validation import Checked, Integer, Options

ensure_importable()
from data.collators import DataCollatorForSupervisedDataset  # noqa: E402
from data.pretraining import PretrainingDataset  # noqa: E402
from data.qa import QADataset  # noqa: E402
from data.utils import IGNORE_INDEX, load_hf_dataset  # noqa: E402

logger = logging.getLogger(__name__)


def initiating_minimum(value):
    if value == "auto" or (type(value) is int and value >= 0):
        return value
    raise ValueError(
        "give auto (one per 10 forget rows) or an integer >= 0 (0: train whatever the spans give)"
    )


class DatasetArguments(Options):
    """The dataset `args` this plugin checks, before loading (`checks.CONFIG_CHECKS`) and in its datasets."""

    model_config = ConfigDict(extra="ignore")  # the framework's own arguments
    OWNER = "a dataset"

    max_length: Integer(
        "tokens kept per row or chunk; 0 does not mean 'no truncation': give the longest row's length or "
        "more, e.g. the default 512",
        ge=1,
    ) = 512
    min_initiating_tokens: Checked("stop below this many initiating tokens", initiating_minimum) = "auto"


class SpanRoles:
    """What QA and raw-text forget sets share: the annotation file, N, the items with roles, the log line.

    The dataset owns the initiating policy (`InitiatingPolicy`): roles are fixed when it is built, for the
    whole run.
    """

    def _read_spans(self, span_annotations, policy: InitiatingPolicy, texts, field) -> None:
        """Validate the file against the dataset's `field` values (answers or texts); keep their spans."""
        self.span_annotations = str(span_annotations)
        self.initiating_policy = policy
        rows = read_annotations(self.span_annotations, field)
        self.spans = validate_annotations(rows, texts, source=self.span_annotations, field=field)
        if warning := word_cut_warning(texts, self.spans, self.span_annotations):
            logger.warning(warning)

    def _with_roles(self, item: dict, offsets, spans, row: int, unplaced=()) -> dict:
        """`item` with its tokens' roles (character ranges `offsets`) from `spans`; `unplaced` IGNORED."""
        is_label = (item["labels"] != IGNORE_INDEX).tolist()
        assignment = assign_token_roles(offsets, is_label, spans, self.initiating_policy, row=row)
        assignment.roles[list(unplaced)] = int(TokenRole.IGNORED)
        item["token_roles"] = assignment.roles
        item["spans_cut"] = assignment.spans_cut
        item["spans_dropped"] = assignment.spans_dropped
        return item

    def __getitem__(self, idx):
        return self.items[idx]

    def __len__(self):
        return len(self.items)

    def _summarize(self, unit: str, minimum, extra: str = ""):
        """Log the forget set's counts; stop below `minimum` initiating tokens (`min_initiating_tokens`; auto:
        one per 10 items, rounded up), where PALU's forget loss would be ~0 and the run retain-only."""
        counts = count_roles(torch.cat([item["token_roles"] for item in self.items]))
        dropped = sum(item["spans_dropped"] for item in self.items)
        logger.info(
            "%s: %d %s, %d spans (%d rows without a span), %d spans cut and %d dropped by max_length=%d%s; "
            "%s; tokens: %d initiating, %d common, %d redundant",
            self.span_annotations,
            len(self.items),
            unit,
            sum(len(spans) for spans in self.spans),
            sum(1 for spans in self.spans if not spans),
            sum(item["spans_cut"] for item in self.items),
            dropped,
            self.max_length,
            extra,
            self.initiating_policy,
            counts["n_initiating"],
            counts["n_common"],
            counts["n_redundant"],
        )
        source, found = "set", counts["n_initiating"]
        if minimum == "auto":
            minimum, source = math.ceil(len(self.items) / 10), "auto: one per 10 forget rows"
        logger.info("min_initiating_tokens=%d (%s); the forget set has %d", minimum, source, found)
        if found < minimum:
            raise AnnotationError(
                f"{self.span_annotations}: {found} initiating tokens in {len(self.items)} forget rows, fewer "
                f"than min_initiating_tokens={minimum} ({sum(map(len, self.spans))} spans, "
                f"{dropped} of them dropped by max_length={self.max_length}): "
                "PALU's forget loss would be ~0 and the run retain-only training. Annotate the spans, raise "
                "max_length, or set min_initiating_tokens=0 to train anyway"
            )


class QAwithSpansDataset(SpanRoles, QADataset):
    """open-unlearning's QADataset whose items also carry `token_roles` (T,) from span annotations.

    Spans are validated against the dataset and every row is tokenised once, here, so that a bad
    file or a template/tokenizer mismatch stops the run before training starts.
    """

    def __init__(self, span_annotations, min_initiating_tokens="auto", *args, **kwargs):
        policy = InitiatingOptions.take(kwargs).policy()
        DatasetArguments.parse({**kwargs, "min_initiating_tokens": min_initiating_tokens})
        super().__init__(*args, **kwargs)
        if self.fs_data is not None or self.predict_with_generate:
            raise ValueError("QAwithSpansDataset serves training rows only: no few-shot, no generation")
        self._read_spans(span_annotations, policy, self.data[self.answer_key], field="answer")
        self.items = [self._item_with_roles(position) for position in range(len(self.data))]
        self._summarize("rows", min_initiating_tokens)

    def _item_with_roles(self, position: int) -> dict:
        row, item = self.data[position], QADataset.__getitem__(self, position)
        text, answer_start = self._templated_text(row[self.question_key], row[self.answer_key])
        input_ids = item["input_ids"].tolist()
        offsets = self._token_offsets(text, input_ids, position)
        # Every non-special answer token must cover characters, or it gets no span role. tokenizers 0.20.0
        # gives whole-word tokens of `ignore_merges` tokenizers (Llama-3) the offsets (start, start)
        # (tokenizers #1553, fixed in 0.20.1).
        special = set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)
        for token, (start, end), label in zip(input_ids, offsets, item["labels"].tolist()):
            if label != IGNORE_INDEX and start == end and token not in special:
                name = self.tokenizer.convert_ids_to_tokens(token)
                raise AnnotationError(
                    f"{self.span_annotations} row {position}: the tokenizer gives answer token {name!r} the "
                    f"empty character range ({start}, {end}), so span roles cannot be placed (tokenizers "
                    f"{tokenizers.__version__}; 0.20.0 does this to Llama-3-style tokenizers): install "
                    "tokenizers>=0.20.1"
                )
        answer_offsets = [(start - answer_start, end - answer_start) for start, end in offsets]
        return self._with_roles(item, answer_offsets, self.spans[position], int(row["index"]))

    def _templated_text(self, question: str, answer: str) -> tuple[str, int]:
        """The text the framework tokenises for this row and where the answer starts in it."""
        template = self.template_args
        if not template["apply_chat_template"]:
            prompt = (template.get("system_prompt_with_special_tokens") or "") + template["user_start_tag"]
            prompt += question + template["user_end_tag"] + template["asst_start_tag"]
            return prompt + answer, len(prompt)
        system = template.get("system_prompt")
        chat = [{"role": "system", "content": system}] if system else []
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
        if input_ids not in (ids, ids + [self.tokenizer.eos_token_id]):  # the framework may append EOS
            raise AnnotationError(
                f"{self.span_annotations} row {position}: tokenising the templated text with offsets "
                "gave other tokens than the framework's preprocessing; check template_args and the tokenizer"
            )
        return list(offsets) + [(0, 0)] * (len(input_ids) - len(ids))


class PretrainingWithSpansDataset(SpanRoles, PretrainingDataset):
    """open-unlearning's PretrainingDataset (MUSE's raw forget text) whose chunks carry `token_roles` (T,).

    The documents' spans (`text_sha1` files) are shifted into the framework's joined text, each decoded chunk
    is aligned back to the text it came from, and roles are set on the framework's own final tokens; tokens
    that cannot be placed get no role and are counted (docs/muse.md).
    """

    def __init__(
        self, span_annotations, min_initiating_tokens="auto", text_key="text", max_length=2048, **kwargs
    ):
        policy = InitiatingOptions.take(kwargs).policy()
        DatasetArguments.parse({"max_length": max_length, "min_initiating_tokens": min_initiating_tokens})
        super().__init__(text_key=text_key, max_length=max_length, **kwargs)
        texts = list(load_hf_dataset(**kwargs["hf_args"])[text_key])
        self._read_spans(span_annotations, policy, texts, field=text_key)
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(
                f"{self.span_annotations}: placing spans on tokens needs a fast tokenizer (offset mapping); "
                f"{type(self.tokenizer).__name__} is not one"
            )
        joined, joined_spans, offset = "\n\n".join(texts), [], 0  # the framework's join
        for text, text_spans in zip(texts, self.spans):
            joined_spans += [(start + offset, end + offset) for start, end in text_spans]
            offset += len(text) + 2
        encoding = self.tokenizer(joined, add_special_tokens=False, return_offsets_mapping=True)
        counted = ("spans_split", "tokens_unplaced", "span_tokens_unplaced", "chunks_realigned")
        self.stats = stats = dict.fromkeys(counted, 0)
        self.items = [
            self._chunk_with_roles(index, joined, joined_spans, encoding) for index in range(len(self.chunks))
        ]
        if stats["tokens_unplaced"]:
            logger.warning(
                "%s: %d tokens could not be placed in the joined text (role IGNORED, no loss)",
                self.span_annotations,
                stats["tokens_unplaced"],
            )
        self._summarize(
            f"chunks of {len(texts)} documents",
            min_initiating_tokens,
            f", {stats['spans_split']} split by a chunk edge; {stats['chunks_realigned']} chunks decode to "
            f"other text than they cover, {stats['tokens_unplaced']} tokens ({stats['span_tokens_unplaced']} "
            "in spans) could not be placed in the joined text and get no loss",
        )

    def _chunk_with_roles(self, index, joined, joined_spans, encoding) -> dict:
        window = slice(index * self.max_length, (index + 1) * self.max_length)
        if self.tokenizer.decode(encoding["input_ids"][window]) != self.chunks[index]:
            raise AnnotationError(
                f"{self.span_annotations}: chunk {index} differs from decoding its tokens of the joined "
                "text; the framework's chunking changed, these roles would not fit its chunks"
            )
        chunk_offsets = encoding["offset_mapping"][window]
        start, end = (chunk_offsets[0][0], chunk_offsets[-1][1]) if chunk_offsets else (0, 0)
        item = PretrainingDataset.__getitem__(self, index) | {"index": index}
        token_offsets, unplaced = self._joined_offsets(index, joined[start:end], start, item["input_ids"])
        chunk_spans = [(max(a, start), min(b, end)) for a, b in joined_spans if a < end and b > start]
        self.stats["spans_split"] += sum(1 for a, b in joined_spans if a < start < b)
        # An unplaced token sits where the previous placed one ends: inside a span if that point is.
        self.stats["span_tokens_unplaced"] += sum(
            1 for position in unplaced if any(a <= token_offsets[position][0] < b for a, b in chunk_spans)
        )
        return self._with_roles(item, token_offsets, chunk_spans, index, unplaced)

    def _joined_offsets(self, index, covered: str, covered_start: int, input_ids) -> tuple[list, list[int]]:
        """Each final token's character range in the joined text, and the positions that cannot be placed."""
        chunk = self.chunks[index]
        encoding = self.tokenizer(chunk, add_special_tokens=True, return_offsets_mapping=True)
        ids = input_ids.tolist()
        if encoding["input_ids"][: len(ids)] != ids:
            raise AnnotationError(
                f"{self.span_annotations}: chunk {index}: tokenising it with offsets gave other tokens "
                "than the framework's preprocessing; check the tokenizer"
            )
        to_joined = list(range(covered_start, covered_start + len(chunk)))
        if chunk != covered:
            self.stats["chunks_realigned"] += 1
            to_joined = [-1] * len(chunk)
            matcher = difflib.SequenceMatcher(None, chunk, covered, autojunk=False)
            for a, b, size in matcher.get_matching_blocks():
                to_joined[a : a + size] = range(covered_start + b, covered_start + b + size)
        offsets, unplaced, previous_end = [], [], covered_start
        for position, (start, end) in enumerate(encoding["offset_mapping"][: len(ids)]):
            placed = [to_joined[char] for char in range(start, end) if to_joined[char] >= 0]
            if placed:
                previous_end = placed[-1] + 1
                offsets.append((placed[0], previous_end))
            else:
                offsets.append((previous_end, previous_end))
                if end > start and position > 0:  # characters, none of them in the joined text
                    unplaced.append(position)
        self.stats["tokens_unplaced"] += len(unplaced)
        return offsets, unplaced


class DataCollatorWithTokenRoles(DataCollatorForSupervisedDataset):
    """The framework's collator, also padding `token_roles` with IGNORED and keeping row indices by default
    (PALU's reference cache looks batch rows up by their dataset `index`)."""

    def __init__(self, tokenizer, padding_side="right", index="index"):
        super().__init__(tokenizer, padding_side=padding_side, index=index)

    def __call__(self, instances):
        if "input_ids" in instances[0] and self.index and self.index not in instances[0]:
            # the framework's PretrainingDataset chunks (MUSE's retain set) carry no row index, and only
            # forget rows need one; the stock collator would refuse the batch
            index, self.index = self.index, None
            try:
                return super().__call__(instances)
            finally:
                self.index = index
        batch = super().__call__(instances)
        if "token_roles" in instances[0]:
            roles = [instance["token_roles"] for instance in instances]
            batch["token_roles"] = self._pad_tokens(roles, int(TokenRole.IGNORED))
        return batch


def require_token_roles(trainer, method: str, experiment: str) -> None:
    """Stop before training when a span-based trainer's forget batches carry no `token_roles` (the message
    alone, exit 1: under the framework's own train.py no config check ran before loading)."""
    forget = getattr(trainer.train_dataset, "forget", None)
    if forget is None or len(forget) == 0:
        return
    if "token_roles" not in trainer.data_collator([forget[0]]):
        raise RunStopped(
            f"{method} needs token roles in the forget batches: use the QAwithSpansDataset handler for the "
            f"forget set and the DataCollatorWithTokenRoles collator ({experiment} does)"
        )
