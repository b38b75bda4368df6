"""Which tokens of a sensitive span are initiating (local entropy loss); the rest are redundant."""

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ConfigDict, model_validator

from palu_trainer.validation import Choice, Integer, Number, Options

STRATEGIES = ("first_n", "all", "ratio", "random_n")
# The experiment's options of the policy: the policy's field each sets and the strategies that read it.
POLICY_OPTIONS = {
    "num_initiating_tokens": ("num_tokens", ("first_n", "random_n")),
    "initiating_ratio": ("ratio", ("ratio",)),
    "initiating_seed": ("seed", ("random_n",)),
}


@dataclass(frozen=True)
class InitiatingPolicy:
    """Which of a span's tokens initiate it (the paper's strategies).

    strategy: `first_n` (the first N tokens, the paper's default), `all`, `ratio` (the first
        ceil(ratio x span length) tokens) or `random_n` (N positions drawn per span).
    num_tokens: N. ratio: p in (0, 1].
    seed: for `random_n`: each span's draw depends only on (seed, row, span), so it is the same in every run
        and process, whatever else used the random number generators.
    merge_adjacent_spans: spans whose tokens follow each other with no token between them (separated by
        nothing or by whitespace that the tokenizer attaches to the next word) are one span, as in the
        released code.
    """

    num_tokens: int = 3
    strategy: str = "first_n"
    ratio: float = 0.5
    seed: int = 0
    merge_adjacent_spans: bool = False

    def __str__(self) -> str:
        chosen = {
            "first_n": f"first {self.num_tokens} tokens",
            "all": "all tokens",
            "ratio": f"first {self.ratio:g} of the tokens",
            "random_n": f"{self.num_tokens} random tokens (seed {self.seed})",
        }[self.strategy]
        merged = ", adjacent spans merged" if self.merge_adjacent_spans else ""
        return f"initiating: {chosen} of each span{merged}"

    def initiating_ranks(self, span_tokens: int, row: int = 0, span: int = 0) -> list[int]:
        """Ranks (0 = the span's first token) of the initiating tokens in a span of `span_tokens` tokens;
        `row` and `span` (the dataset row's index and the span's rank in it) seed `random_n`."""
        if self.strategy == "all":
            return list(range(span_tokens))
        if self.strategy == "ratio":
            # round first: 0.3 x 10 is 3.0000000000000004 in floating point, and must give 3 tokens
            return list(range(math.ceil(round(self.ratio * span_tokens, 9))))
        count = min(self.num_tokens, span_tokens)
        if self.strategy == "random_n":
            return sorted(random.Random(f"{self.seed}/{row}/{span}").sample(range(span_tokens), count))
        return list(range(count))

    def initiating_positions(self, span_positions: Sequence[list[int]], row: int = 0) -> list[int]:
        """Token positions that initiate, given per span, in order, the sorted token positions it covers
        (possibly none); adjacent spans merged first if asked."""
        groups = [list(positions) for positions in span_positions]
        if self.merge_adjacent_spans:
            groups = []
            for positions in filter(None, span_positions):
                if groups and positions[0] <= groups[-1][-1] + 1:
                    groups[-1].extend(p for p in positions if p > groups[-1][-1])
                else:
                    groups.append(list(positions))
        return [
            positions[rank]
            for span, positions in enumerate(groups)
            for rank in self.initiating_ranks(len(positions), row, span)
        ]


class InitiatingOptions(Options):
    """The forget dataset's initiating options, as its `args` (or the experiment's top level) write them.

    None is unset (the policy's default). An option the strategy does not read must stay unset: it would
    otherwise be dropped without a word (`POLICY_OPTIONS`).
    """

    model_config = ConfigDict(extra="ignore")  # the dataset's other arguments
    OWNER = "the forget dataset"

    num_initiating_tokens: Integer("N, the tokens that initiate each span", True, ge=1) = None
    initiating_strategy: Choice("which of a span's tokens initiate it", *STRATEGIES) = "first_n"
    initiating_ratio: Number("p, the initiating share of each span", True, gt=0, le=1) = None
    initiating_seed: Integer("random_n's seed", True) = None
    merge_adjacent_spans: Choice("adjacent spans as one (the released code)", True, False) = False

    @model_validator(mode="after")
    def strategy_reads_every_option_set(self):
        for option, (_, readers) in POLICY_OPTIONS.items():
            value = getattr(self, option)
            if value is not None and self.initiating_strategy not in readers:
                raise ValueError(
                    f"{option}={value!r} has no effect with initiating_strategy={self.initiating_strategy}: "
                    f"only {' and '.join(readers)} {'reads' if len(readers) == 1 else 'read'} it. Set "
                    f"initiating_strategy={readers[0]}, or drop {option}"
                )
        return self

    def policy(self) -> InitiatingPolicy:
        chosen = {field: getattr(self, option) for option, (field, _) in POLICY_OPTIONS.items()}
        return InitiatingPolicy(
            strategy=self.initiating_strategy,
            merge_adjacent_spans=self.merge_adjacent_spans,
            **{name: value for name, value in chosen.items() if value is not None},
        )
