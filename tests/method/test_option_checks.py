"""Option values the method layer refuses: loss weights, TPO's beta, initiating options a strategy ignores."""

import pytest

from palu_trainer.method.initiating import InitiatingOptions, InitiatingPolicy
from palu_trainer.options import PALUOptions, TPOOptions


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gamma": -1}, r"gamma=-1: must be a number >= 0 \(the weight of the forget terms; a negative one"),
        ({"alpha": -1.0}, r"alpha=-1\.0: must be a number >= 0 \(.*gradient ascent on the retain set\)"),
        ({"gamma": "abc"}, r"gamma='abc': must be a number >= 0"),
        ({"alpha": "abc"}, r"alpha='abc': must be a number >= 0"),
        ({"alpha": True}, r"alpha=True: must be a number"),
        ({"gamma": float("nan")}, r"gamma=nan: must be a number >= 0"),
    ],
)
@pytest.mark.parametrize("options_type", [PALUOptions, TPOOptions])
def test_loss_weights_are_numbers_at_least_zero(options_type, options, message):
    with pytest.raises(ValueError, match=message):
        options_type.parse(options)


def test_zero_and_positive_weights_pass():
    assert (PALUOptions.parse({"gamma": 0, "alpha": 2.5}).alpha, TPOOptions.parse({"gamma": 0}).gamma) == (
        2.5,
        0,
    )


@pytest.mark.parametrize(
    ("beta", "message"),
    [
        (0, r"beta=0: must be a number > 0 \(TPO's logit-preference temperature; 0 divides by zero"),
        (-1, r"beta=-1: must be a number > 0 .*a negative one rewards the sensitive tokens"),
        ("abc", r"beta='abc': must be a number > 0"),
    ],
)
def test_tpo_beta_is_positive(beta, message):
    with pytest.raises(ValueError, match=message):
        TPOOptions.parse({"beta": beta})
    assert TPOOptions.parse({"beta": 0.5}).beta == 0.5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"initiating_ratio": 0.25},
            r"initiating_ratio=0\.25 has no effect with initiating_strategy=first_n: only ratio reads it\. "
            r"Set initiating_strategy=ratio, or drop initiating_ratio",
        ),
        (
            {"initiating_strategy": "all", "num_initiating_tokens": 1},
            r"num_initiating_tokens=1 has no effect with initiating_strategy=all: only first_n and random_n "
            r"read it\. Set initiating_strategy=first_n, or drop num_initiating_tokens",
        ),
        (
            {"initiating_strategy": "ratio", "num_initiating_tokens": 3},
            r"num_initiating_tokens=3 has no effect with initiating_strategy=ratio",
        ),
        ({"initiating_seed": 3}, r"initiating_seed=3 has no effect with initiating_strategy=first_n"),
        ({"initiating_strategy": "last"}, r"initiating_strategy='last'; choose one of first_n, all, ratio"),
    ],
)
def test_options_the_strategy_ignores_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        InitiatingOptions.parse(options)


def test_unset_options_take_their_defaults():
    assert InitiatingOptions.parse({}).policy() == InitiatingPolicy(3, "first_n", 0.5, 0)
    ratio = InitiatingOptions.parse({"initiating_strategy": "ratio", "initiating_ratio": 0.25}).policy()
    assert (ratio.strategy, ratio.ratio, ratio.num_tokens) == ("ratio", 0.25, 3)
    random_n = InitiatingOptions.parse(
        {"num_initiating_tokens": 2, "initiating_strategy": "random_n", "initiating_seed": 7}
    ).policy()
    assert (random_n.num_tokens, random_n.seed) == (2, 7)
