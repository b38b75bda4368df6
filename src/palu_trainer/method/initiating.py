"""Which tokens of a sensitive span are initiating (local entropy loss); the rest are redundant.

The paper's strategies: the first N tokens of each span (its default), all of them, a prefix that is a share
of the span, and N random tokens. The released code also merges spans with no token between them into one
run before taking the first N.
"""

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

STRATEGIES = ("first_n", "all", "ratio", "random_n")
# The experiment's options of the policy and the strategies that read them (any other strategy ignores it).
OPTION_READERS = {
    "num_initiating_tokens": ("first_n", "random_n"),
    "initiating_ratio": ("ratio",),
    "initiating_seed": ("random_n",),
}
OPTION_FIELDS = {
    "num_initiating_tokens": "num_tokens",
    "initiating_ratio": "ratio",
    "initiating_seed": "seed",
}


@dataclass(frozen=True)
class InitiatingPolicy:
    """Which of a span's tokens initiate it.

    num_tokens: N, for `first_n` (the first N tokens) and `random_n` (N positions drawn per span).
    strategy: `first_n`, `all` (every span token), `ratio` (the first ceil(ratio x span length) tokens) or
        `random_n`.
    ratio: p in (0, 1], for `ratio`.
    seed: for `random_n`: each span's draw depends only on (seed, row, span), so it is the same in every run
        and process, whatever else used the random number generators.
    merge_adjacent_spans: spans whose tokens follow each other with no token between them (separated by
        nothing or by whitespace that the tokenizer attaches to the next word) are one span, as in the
        released code.

    The forget dataset owns the policy and fixes roles when it is built, so every consumer (the trainer,
    the reference cache) reads the same roles.
    """

    num_tokens: int = 3
    strategy: str = "first_n"
    ratio: float = 0.5
    seed: int = 0
    merge_adjacent_spans: bool = False

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"initiating_strategy={self.strategy!r} is unknown; choose one of {', '.join(STRATEGIES)}"
            )
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"num_initiating_tokens (N) must be an integer >= 1, got {self.num_tokens!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, int | float) or not 0 < self.ratio <= 1:
            raise ValueError(f"initiating_ratio must be a number in (0, 1], got {self.ratio!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"initiating_seed must be an integer, got {self.seed!r}")
        if not isinstance(self.merge_adjacent_spans, bool):
            raise ValueError(f"merge_adjacent_spans must be true or false, got {self.merge_adjacent_spans!r}")

    @classmethod
    def from_options(
        cls,
        num_initiating_tokens=None,
        initiating_strategy="first_n",
        initiating_ratio=None,
        initiating_seed=None,
        merge_adjacent_spans=False,
    ) -> "InitiatingPolicy":
        """The policy from the experiment's options; an option the strategy does not read must stay unset.

        None is unset (the default: N=3, ratio 0.5, seed 0). `initiating_ratio=0.25` with `first_n`, or
        `num_initiating_tokens=1` with `all`, would otherwise be dropped without a word (`OPTION_READERS`).
        """
        if initiating_strategy not in STRATEGIES:
            cls(strategy=initiating_strategy)  # the unknown-strategy message
        given = {
            "num_initiating_tokens": num_initiating_tokens,
            "initiating_ratio": initiating_ratio,
            "initiating_seed": initiating_seed,
        }
        for option, value in given.items():
            readers = OPTION_READERS[option]
            if value is not None and initiating_strategy not in readers:
                raise ValueError(
                    f"{option}={value!r} has no effect with initiating_strategy={initiating_strategy}: only "
                    f"{' and '.join(readers)} {'reads' if len(readers) == 1 else 'read'} it. Set "
                    f"initiating_strategy={readers[0]}, or drop {option}"
                )
        chosen = {OPTION_FIELDS[option]: value for option, value in given.items() if value is not None}
        return cls(strategy=initiating_strategy, merge_adjacent_spans=merge_adjacent_spans, **chosen)

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
        """Ranks (0 = the span's first token) of the initiating tokens in a span of `span_tokens` tokens.

        `row` and `span` (the dataset row's index and the span's rank in it) seed `random_n`.
        """
        if self.strategy == "all":
            return list(range(span_tokens))
        if self.strategy == "ratio":
            # round first: 0.3 x 10 is 3.0000000000000004 in floating point, and must give 3 tokens
            return list(range(math.ceil(round(self.ratio * span_tokens, 9))))
        count = min(self.num_tokens, span_tokens)
        if self.strategy == "random_n":
            return sorted(random.Random(f"{self.seed}/{row}/{span}").sample(range(span_tokens), count))
        return list(range(count))

    def group_spans(self, span_positions: Sequence[list[int]]) -> list[list[int]]:
        """The token positions of each span as the policy sees them: merged when adjacent, if asked.

        Args:
            span_positions: per span, in order, the sorted token positions it covers (possibly none).
        """
        if not self.merge_adjacent_spans:
            return [list(positions) for positions in span_positions]
        groups: list[list[int]] = []
        for positions in filter(None, span_positions):
            if groups and positions[0] <= groups[-1][-1] + 1:
                groups[-1].extend(p for p in positions if p > groups[-1][-1])
            else:
                groups.append(list(positions))
        return groups

    def initiating_positions(self, span_positions: Sequence[list[int]], row: int = 0) -> list[int]:
        """Token positions that initiate, given each span's token positions (see `group_spans`)."""
        return [
            positions[rank]
            for span, positions in enumerate(self.group_spans(span_positions))
            for rank in self.initiating_ranks(len(positions), row, span)
        ]
