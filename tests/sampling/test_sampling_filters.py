import numpy as np
import pytest
import torch

from orchard.sampling import difficulty_filter, filter_groups


def test_filter_groups_hand_computed():
    r = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.6]])
    res = filter_groups(r)
    assert res.kept_indices.tolist() == [1, 3]
    assert res.keep.tolist() == [False, True, False, True]
    assert (res.num_kept, res.num_dropped) == (2, 2)
    # spread of group 3 is 0.1 (up to rounding): eps 0.2 treats it as flat
    assert filter_groups(r, eps=0.2).kept_indices.tolist() == [1]


def test_filter_groups_ragged_and_degenerate():
    res = filter_groups([[1.0], [0.0, 1.0], [], [2.0, 2.0]])
    assert res.kept_indices.tolist() == [1] and res.num_dropped == 3
    empty = filter_groups(np.zeros((0, 4)))
    assert (empty.num_kept, empty.num_dropped) == (0, 0)
    with pytest.raises(ValueError, match="rewards_GN"):
        filter_groups(np.zeros(4))
    with pytest.raises(ValueError, match="rewards_GN"):
        filter_groups([[1.0, float("nan")]])
    with pytest.raises(ValueError, match="eps"):
        filter_groups([[1.0]], eps=-0.1)


def test_difficulty_filter_hand_computed():
    s = [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    res = difficulty_filter(s)
    # p = 0, .25, .5, .75, 1 -> keep 0 < p <= .5: tasks 1 and 2 (0.5 is inclusive)
    np.testing.assert_allclose(res.pass_rate, [0.0, 0.25, 0.5, 0.75, 1.0])
    assert res.kept_indices.tolist() == [1, 2] and (res.num_kept, res.num_dropped) == (2, 3)
    # thresholds as kwargs: 0.25 < p <= 1
    assert difficulty_filter(s, low=0.25, high=1.0).kept_indices.tolist() == [2, 3, 4]
    # ragged: [1, 0, 0] -> 1/3 kept; [True] -> 1 dropped
    assert difficulty_filter([[1, 0, 0], [True]]).kept_indices.tolist() == [0]


def test_difficulty_filter_bad_inputs():
    with pytest.raises(ValueError, match="low"):
        difficulty_filter([[1]], low=0.6, high=0.5)
    with pytest.raises(ValueError, match="high"):
        difficulty_filter([[1]], high=1.5)
    with pytest.raises(ValueError, match=r"successes_PK\[0\]"):
        difficulty_filter([[2, 0]])
    with pytest.raises(ValueError, match=r"successes_PK\[1\]"):
        difficulty_filter([[1], []])
    with pytest.raises(ValueError, match="successes_PK"):
        difficulty_filter("abc")


def test_filter_rules_hand_computed():
    r = [
        [1.0, 1.0, 1.0],  # 0: all positive and all equal
        [0.0, 0.0, 0.0],  # 1: all zero
        [-1.0, -1.0, -1.0],  # 2: all -1 (format failures): flat, but neither zero nor positive
        [1.0, 0.0, -1.0],  # 3: mixed
        [0.5, 1.0, 1.0],  # 4: not equal, but all positive
        [0.0, -1.0, 0.0],  # 5: zeros and -1
    ]
    assert filter_groups(r).kept_indices.tolist() == [3, 4, 5]  # default rule="all_equal" (DAPO)
    gui = filter_groups(r, rule="all_zero_or_all_positive")
    assert gui.kept_indices.tolist() == [2, 3, 5]  # the GUI rule keeps the all -1 group, drops {0.5, 1, 1}
    assert (gui.num_kept, gui.num_dropped) == (3, 3)
    # eps as the zero / positive tolerance: with eps = 0.1, 0.05 counts as zero, so [0.05, 0] is all zero;
    # with eps = 0 it is a mixed group (0.05 positive, 0 not).
    assert filter_groups([[0.05, 0.0]], rule="all_zero_or_all_positive", eps=0.1).num_kept == 0
    assert filter_groups([[0.05, 0.0]], rule="all_zero_or_all_positive").num_kept == 1
    # a one-member group is dropped under every rule
    assert filter_groups([[-1.0]], rule="all_zero_or_all_positive").num_kept == 0


def test_filter_rule_registry_names_the_argument():
    from orchard.sampling import GROUP_FILTER_RULES

    assert GROUP_FILTER_RULES.names()[:2] == ["all_equal", "all_zero_or_all_positive"]
    with pytest.raises(ValueError, match=r"rule must be one of \['all_equal', 'all_zero_or_all_positive'"):
        filter_groups([[0.0, 1.0]], rule="gui")
