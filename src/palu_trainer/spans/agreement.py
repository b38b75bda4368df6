"""Agreement between two span annotations of the same answers: word-token and exact-span P/R/F1."""

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from palu_trainer.spans.format import Span

WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Agreement:
    """Precision, recall and F1 of a candidate against a reference, micro-averaged over all rows."""

    true_positives: int
    false_positives: int
    false_negatives: int

    @property
    def precision(self) -> float:
        return self.true_positives / max(self.true_positives + self.false_positives, 1)

    @property
    def recall(self) -> float:
        return self.true_positives / max(self.true_positives + self.false_negatives, 1)

    @property
    def f1(self) -> float:
        total = self.precision + self.recall
        return 2 * self.precision * self.recall / total if total else 0.0

    def __str__(self) -> str:
        return f"precision {self.precision:.3f}  recall {self.recall:.3f}  F1 {self.f1:.3f}"


def word_agreement(
    answers: Sequence[str], reference: Sequence[Sequence[Span]], candidate: Sequence[Sequence[Span]]
) -> Agreement:
    """Agreement on word tokens (`\\w+`); a file marks a word when any of its characters is in a span."""
    counts = Counter()
    for answer, reference_spans, candidate_spans in zip(answers, reference, candidate, strict=True):
        for word in WORD.finditer(answer):
            counts[_covers(reference_spans, word), _covers(candidate_spans, word)] += 1
    return Agreement(counts[True, True], counts[False, True], counts[True, False])


def span_agreement(reference: Sequence[Sequence[Span]], candidate: Sequence[Sequence[Span]]) -> Agreement:
    """Agreement on spans: a candidate span counts only where the reference has exactly the same span."""
    counts = Counter()
    for reference_spans, candidate_spans in zip(reference, candidate, strict=True):
        reference_set, candidate_set = set(map(tuple, reference_spans)), set(map(tuple, candidate_spans))
        for span in reference_set | candidate_set:
            counts[span in reference_set, span in candidate_set] += 1
    return Agreement(counts[True, True], counts[False, True], counts[True, False])


def _covers(spans: Iterable[Span], word: re.Match) -> bool:
    return any(start < word.end() and word.start() < end for start, end in spans)
