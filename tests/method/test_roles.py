import pytest
import torch

from palu_trainer.method.initiating import InitiatingOptions, InitiatingPolicy
from palu_trainer.method.roles import TokenRole, assign_token_roles, count_roles

IGN, COM, INI, RED = (int(role) for role in TokenRole)


def test_roles_from_hand_made_offsets():
    # answer: "Ann Lee was born in Oslo." spans: "Ann Lee" [0, 7), "Oslo" [20, 24)
    offsets = [(-5, -1), (0, 3), (3, 7), (7, 11), (11, 16), (16, 19), (19, 24), (24, 25), (0, 0)]
    is_label = [False] + [True] * 8
    assignment = assign_token_roles(offsets, is_label, [(0, 7), (20, 24)], InitiatingPolicy(1))
    assert assignment.roles.tolist() == [IGN, INI, RED, COM, COM, COM, INI, COM, COM]
    assert (assignment.spans_cut, assignment.spans_dropped) == (0, 0)
    assignment = assign_token_roles(offsets, is_label, [(0, 7), (20, 24)], InitiatingPolicy(3))
    assert assignment.roles.tolist()[1:3] == [INI, INI]


def test_token_over_two_spans_belongs_to_the_first():
    offsets = [(0, 4), (4, 9), (9, 12)]
    roles = assign_token_roles(offsets, [True] * 3, [(0, 6), (6, 12)], InitiatingPolicy(1)).roles
    assert roles.tolist() == [INI, RED, INI]


def test_truncation_counts_cut_and_dropped_spans():
    offsets = [(0, 3), (3, 7), (7, 11)]  # the answer goes on to 40 characters, cut at 11
    assignment = assign_token_roles(offsets, [True] * 3, [(4, 15), (20, 30)], InitiatingPolicy(2))
    assert assignment.roles.tolist() == [COM, INI, INI]
    assert (assignment.spans_cut, assignment.spans_dropped) == (1, 1)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_num_initiating_must_be_a_positive_integer(bad):
    with pytest.raises(
        ValueError, match=r"^num_initiating_tokens=.*: must be an integer >= 1 \(N, the tokens"
    ):
        InitiatingOptions.parse({"num_initiating_tokens": bad})


def test_count_roles():
    roles = torch.tensor([[IGN, INI, RED, COM], [INI, COM, COM, IGN]])
    assert count_roles(roles) == {"n_initiating": 2, "n_common": 3, "n_redundant": 1}
