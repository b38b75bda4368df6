"""Initiating strategies on hand-made spans with known roles."""

import random
import subprocess
import sys

import pytest

from palu_trainer.method.initiating import InitiatingOptions, InitiatingPolicy
from palu_trainer.method.roles import TokenRole, assign_token_roles

IGN, COM, INI, RED = (int(role) for role in TokenRole)

# answer: "Ann Lee Smith was born in Oslo , Norway ." one token per word (the space goes with the next word)
WORDS = ["Ann", " Lee", " Smith", " was", " born", " in", " Oslo", " ,", " Norway", " ."]
OFFSETS = []
for word in WORDS:
    start = OFFSETS[-1][1] if OFFSETS else 0
    OFFSETS.append((start, start + len(word)))
NAME, OSLO, NORWAY = (0, 13), (26, 30), (32, 38)  # "Ann Lee Smith" (3 tokens), "Oslo", "Norway"


def roles(policy, spans=(NAME, OSLO, NORWAY), row=0):
    return assign_token_roles(OFFSETS, [True] * len(OFFSETS), list(spans), policy, row=row).roles.tolist()


def test_first_n_takes_each_span_prefix():
    assert roles(InitiatingPolicy(2)) == [INI, INI, RED, COM, COM, COM, INI, COM, INI, COM]
    assert roles(InitiatingPolicy(1, "first_n")) == [INI, RED, RED, COM, COM, COM, INI, COM, INI, COM]


def test_all_makes_every_span_token_initiating():
    assert roles(InitiatingPolicy(1, "all")) == [INI, INI, INI, COM, COM, COM, INI, COM, INI, COM]


@pytest.mark.parametrize(
    ("ratio", "name_roles"),
    [(0.25, [INI, RED, RED]), (0.34, [INI, INI, RED]), (0.5, [INI, INI, RED]), (1.0, [INI, INI, INI])],
)
def test_ratio_takes_the_ceiling_of_the_share_of_each_span(ratio, name_roles):
    # ceil(p x 3): 0.75 -> 1, 1.02 -> 2, 1.5 -> 2, 3 -> 3; one-token spans always keep their token
    assert roles(InitiatingPolicy(strategy="ratio", ratio=ratio)) == [
        *name_roles,
        COM,
        COM,
        COM,
        INI,
        COM,
        INI,
        COM,
    ]


def test_ratio_is_exact_where_floating_point_is_not():
    assert InitiatingPolicy(strategy="ratio", ratio=0.3).initiating_ranks(10) == [0, 1, 2]  # 0.3 x 10 != 3.0
    assert InitiatingPolicy(strategy="ratio", ratio=0.7).initiating_ranks(10) == list(range(7))


def test_random_n_draws_n_positions_per_span_from_seed_row_and_span():
    policy = InitiatingPolicy(2, "random_n", seed=7)
    ranks = policy.initiating_ranks(10, row=4, span=1)
    assert len(ranks) == 2 == len(set(ranks)) and ranks == sorted(ranks) and all(0 <= r < 10 for r in ranks)
    assert ranks == sorted(random.Random("7/4/1").sample(range(10), 2))
    random.seed(123)  # the global generator plays no part
    assert policy.initiating_ranks(10, row=4, span=1) == ranks
    draws = {tuple(policy.initiating_ranks(10, row=row, span=span)) for row in range(5) for span in range(3)}
    assert len(draws) > 5  # rows and spans draw differently
    assert InitiatingPolicy(5, "random_n").initiating_ranks(3) == [0, 1, 2]  # short span: all of it
    row_roles = roles(InitiatingPolicy(2, "random_n", seed=7), row=3)
    name = sorted(random.Random("7/3/0").sample(range(3), 2))
    assert [i for i in range(3) if row_roles[i] == INI] == name
    assert row_roles[3:] == [COM, COM, COM, INI, COM, INI, COM]


def test_random_n_is_the_same_in_another_process():
    code = (
        "from palu_trainer.method.initiating import InitiatingPolicy as P;"
        "policy = P(3, 'random_n', seed=11);"
        "print([policy.initiating_ranks(20, row=r, span=s) for r in range(3) for s in range(2)])"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    here = [
        InitiatingPolicy(3, "random_n", seed=11).initiating_ranks(20, row=r, span=s)
        for r in range(3)
        for s in range(2)
    ]
    assert other.strip() == str(here)


def test_merging_joins_spans_with_no_token_between_them():
    # "Ann Lee" and "Smith" touch (only the space before "Smith" separates them): one span when merged;
    # "Oslo" and "Norway" have the token "," between them: two spans either way.
    spans = [(0, 7), (7, 13), OSLO, NORWAY]
    assert roles(InitiatingPolicy(1), spans) == [INI, RED, INI, COM, COM, COM, INI, COM, INI, COM]
    merged = InitiatingPolicy(1, merge_adjacent_spans=True)
    assert roles(merged, spans) == [INI, RED, RED, COM, COM, COM, INI, COM, INI, COM]


def released_runs_first_n(sensitive: list[int], n: int) -> list[int]:
    """The released code's rule: runs of consecutive sensitive positions, the first n of each."""
    chosen, run = [], []
    for position in sensitive + [None]:
        if run and (position is None or position != run[-1] + 1):
            chosen += run[:n]
            run = []
        if position is not None:
            run.append(position)
    return chosen


def test_merging_matches_the_released_runs_on_random_layouts():
    generator = random.Random(0)
    for _ in range(200):
        n, spans, in_span = generator.randint(1, 4), [], False
        for position in range(generator.randint(1, 30)):  # spans that touch, follow a gap, or continue
            draw = generator.random()
            if draw < 0.4:
                in_span = False
            elif in_span and draw < 0.8:
                spans[-1].append(position)
            else:
                spans.append([position])
                in_span = True
        sensitive = [p for span in spans for p in span]
        merged = InitiatingPolicy(n, merge_adjacent_spans=True).initiating_positions(spans)
        assert merged == released_runs_first_n(sensitive, n), spans


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"initiating_strategy": "last_n"},
            r"^initiating_strategy='last_n'; did you mean first_n\? choose one of first_n, all, ratio",
        ),
        (
            {"initiating_strategy": "ratio", "initiating_ratio": 0},
            r"^initiating_ratio=0: must be a number > 0 and <= 1 \(p, the initiating share of each span\)",
        ),
        (
            {"initiating_strategy": "ratio", "initiating_ratio": 1.5},
            r"^initiating_ratio=1.5: must be a number > 0",
        ),
        (
            {"initiating_strategy": "ratio", "initiating_ratio": "half"},
            r"^initiating_ratio='half': must be a n",
        ),
        ({"num_initiating_tokens": 0}, r"^num_initiating_tokens=0: must be an integer >= 1 \(N, the tokens"),
        (
            {"initiating_strategy": "random_n", "initiating_seed": 1.5},
            r"^initiating_seed=1.5: must be an integer",
        ),
        ({"merge_adjacent_spans": "yes"}, r"^merge_adjacent_spans='yes'; choose one of true, false$"),
    ],
)
def test_bad_policies_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        InitiatingOptions.parse(options)
