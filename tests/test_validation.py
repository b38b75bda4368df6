"""The one validation system: strict values, ranges read off each field, a typo reported first."""

import pytest

from palu_trainer.validation import Choice, Integer, Number, Options


class Example(Options):
    OWNER = "Example"
    MOVED = {"old_name": "old_name moved to new_name"}

    rate: Number("the step size", gt=0, le=1) = 0.5
    count: Integer("how many", True, ge=1) = None
    flag: Choice("on or off", True, False) = False


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rate": 0}, r"^rate=0: must be a number > 0 and <= 1 \(the step size\)$"),
        ({"rate": "0.1"}, r"^rate='0.1': must be a number > 0 and <= 1"),
        ({"rate": True}, r"^rate=True: must be a number"),
        ({"rate": float("nan")}, r"^rate=nan: must be a number"),
        ({"rate": float("inf")}, r"^rate=inf: must be a number"),
        ({"count": 2.0}, r"^count=2\.0: must be an integer >= 1 \(how many\)$"),
        ({"flag": 1}, r"^flag=1; choose one of true, false$"),
        ({"flag": "true"}, r"^flag='true'; did you mean true\? choose one of true, false$"),
        (
            {"rate": -1, "rat": 1},
            r"^rat is not an option of Example: did you mean rate\? its options are count, flag, rate$",
        ),
        ({"old_name": 1}, r"^old_name moved to new_name$"),
    ],
)
def test_a_bad_value_or_key_is_one_sentence_with_the_fix(values, message):
    with pytest.raises(ValueError, match=message):
        Example.parse(values)


def test_good_values_parse_and_absent_ones_keep_their_defaults():
    example = Example.parse({"rate": 1, "count": None, "flag": True})
    assert (example.rate, example.count, example.flag) == (1.0, None, True)
    assert Example.defaults() == {"rate": 0.5, "count": None, "flag": False}


def test_take_removes_only_the_groups_keys():
    arguments = {"rate": 0.25, "model": "kept"}
    assert Example.take(arguments).rate == 0.25
    assert arguments == {"model": "kept"}


def test_problem_is_the_message_of_parse_or_none():
    assert Example.problem({"rate": 0}, "group.").startswith("group.rate=0: must be a number > 0")
    assert Example.problem({"rate": 1}) is None


def test_trainer_strategy_choices_accept_null_as_transformers_does():
    """transformers 4.45 reads `evaluation_strategy: null` as its default: a null choice is not refused."""
    from palu_trainer.framework.training_arguments import TrainerArguments

    assert TrainerArguments.problem({"evaluation_strategy": None, "optim": None}, "trainer.args.") is None
    assert TrainerArguments.problem({"optim": "adamw_torc"}, "trainer.args.").endswith(", null")
