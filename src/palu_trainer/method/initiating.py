"""Which tokens of a sensitive span are initiating (local entropy loss); the rest are redundant."""

from dataclasses import dataclass


@dataclass(frozen=True)
class InitiatingPolicy:
    """The paper's default strategy: the first `num_tokens` (N) tokens of each span initiate it.

    The forget dataset owns the policy and fixes roles when it is built, so every consumer (the trainer,
    the reference cache) reads the same roles.
    """

    num_tokens: int = 3

    def __post_init__(self):
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"num_initiating_tokens (N) must be an integer >= 1, got {self.num_tokens!r}")

    def initiating_ranks(self, span_tokens: int) -> range:
        """Ranks (0 = the span's first token) of the initiating tokens in a span of `span_tokens` tokens."""
        return range(min(self.num_tokens, span_tokens))
