"""Credit-assigned SFT: step values, TD credit, credit runs, the token mask, and sft_loss."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.losses import (
    credit_assigned_sft_mask,
    credit_runs,
    interpolate_step_values,
    sft_loss,
    td_credit,
)
from orchard.losses.sft import CREDIT_TOL

from ._reference import aggregate_reference


def test_interpolate_hand_computed():
    values = interpolate_step_values({1: 0.2, 4: 0.8}, num_steps=5)
    # s_0 holds V(s_1) = 0.2; s_1..s_4 linear with slope 0.6 / 3 = 0.2; s_5 holds V(s_4) = 0.8
    torch.testing.assert_close(values, torch.tensor([0.2, 0.2, 0.4, 0.6, 0.8, 0.8], dtype=torch.float64))
    torch.testing.assert_close(
        interpolate_step_values({3: 0.5}, 3), torch.full((4,), 0.5, dtype=torch.float64)
    )
    torch.testing.assert_close(interpolate_step_values({0: 1.0}, 0), torch.tensor([1.0], dtype=torch.float64))


def test_interpolate_keeps_keyed_values_and_order_of_keys_does_not_matter():
    keyed = {7: 0.1, 0: 0.9, 3: 0.4}
    values = interpolate_step_values(keyed, 9)
    assert values.shape == (10,)
    for k, v in keyed.items():
        assert values[k].item() == pytest.approx(v)
    torch.testing.assert_close(values, interpolate_step_values(dict(sorted(keyed.items())), 9))


def test_td_credit_and_runs_hand_computed():
    values = interpolate_step_values({0: 0.1, 4: 0.6, 9: 0.2}, num_steps=9)
    credit = td_credit(values)
    # s_0..s_4 rise by 0.5 / 4 = 0.125 per step; s_4..s_9 fall by 0.4 / 5 = 0.08 per step
    torch.testing.assert_close(credit, torch.tensor([0.125] * 4 + [-0.08] * 5, dtype=torch.float64))
    assert credit_runs(credit, eps=0.05) == [(0, 4)]
    assert credit_runs(credit, eps=0.2) == []
    assert credit_runs([0.1, 0.2, 0.0, 0.05], eps=0.05) == [(0, 2), (3, 4)]  # c_3 = ε counts
    assert credit_runs([0.06, 0.04, 0.07, 0.07, 0.0]) == [(0, 1), (2, 4)]  # default ε = 0.05
    assert credit_runs([float("nan"), 0.1]) == [(1, 2)]
    assert credit_runs([]) == []


def test_td_credit_batched_and_single_state():
    v = torch.tensor([[0.0, 0.5, 0.25], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(td_credit(v), torch.tensor([[0.5, -0.25], [0.0, -1.0]]))
    assert td_credit([0.3]).shape == (0,)  # S = 0 steps: no credit


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1, 1, allow_nan=False), max_size=30), st.floats(-0.5, 0.5))
def test_credit_runs_are_maximal_and_cover_exactly_the_credited_steps(credit, eps):
    runs = credit_runs(credit, eps=eps)
    covered = [False] * len(credit)
    for start, end in runs:
        assert 0 <= start < end <= len(credit)
        for t in range(start, end):
            covered[t] = True
        assert start == 0 or credit[start - 1] < eps - CREDIT_TOL  # maximal on the left
        assert end == len(credit) or credit[end] < eps - CREDIT_TOL  # maximal on the right
    assert covered == [c >= eps - CREDIT_TOL for c in credit]
    assert all(a[1] < b[0] for a, b in itertools.pairwise(runs))  # ordered, disjoint, not adjacent


def _trajectory():
    # tokens:      prompt | step 0 (act, obs) | step 1 (act, act, obs) | step 2 (act) | pad
    turn_index = torch.tensor([-1, -1, 0, 0, 1, 1, 1, 2, -1])
    action_mask = torch.tensor([0, 0, 1, 0, 1, 1, 0, 1, 0], dtype=torch.bool)
    return action_mask, turn_index


def test_mask_hand_computed():
    action_mask, turn_index = _trajectory()
    resolved = credit_assigned_sft_mask(action_mask, turn_index, True, [])
    assert resolved.tolist() == action_mask.tolist()  # resolved: every action token, observations never
    unresolved = credit_assigned_sft_mask(action_mask, turn_index, False, [(1, 2)])
    # only step 1's action tokens (positions 4, 5); its observation (6) and the other steps are context
    assert unresolved.tolist() == [False, False, False, False, True, True, False, False, False]
    two_runs = credit_assigned_sft_mask(action_mask, turn_index, False, [(0, 1), (2, 3)])
    assert two_runs.nonzero().flatten().tolist() == [2, 7]
    assert not credit_assigned_sft_mask(action_mask, turn_index, False, []).any()
    assert credit_assigned_sft_mask(action_mask, turn_index, False, [(5, 9)]).sum() == 0  # runs past the end


def test_mask_batched_equals_rows():
    action_mask, turn_index = _trajectory()
    am = torch.stack([action_mask, action_mask, action_mask])
    si = torch.stack([turn_index, turn_index, turn_index])
    resolved = torch.tensor([False, True, False])
    runs = [[(0, 2)], [], [(2, 3)]]
    batched = credit_assigned_sft_mask(am, si, resolved, runs)
    for i in range(3):
        row = credit_assigned_sft_mask(action_mask, turn_index, bool(resolved[i]), runs[i])
        assert batched[i].tolist() == row.tolist()
    assert batched.dtype == torch.bool and batched.shape == am.shape
    assert credit_assigned_sft_mask(am, si, [False, True, False], runs).tolist() == batched.tolist()


def test_pipeline_into_sft_loss():
    action_mask, turn_index = _trajectory()
    values = interpolate_step_values({0: 0.0, 1: 0.3, 3: 0.3}, num_steps=3)  # credit [0.3, 0, 0]
    mask = credit_assigned_sft_mask(action_mask, turn_index, False, credit_runs(td_credit(values)))
    logprobs = torch.linspace(-1.0, -9.0, 9)[None].requires_grad_()  # -1, -2, ..., -9
    loss, metrics = sft_loss(logprobs, mask[None])
    assert loss.item() == pytest.approx(3.0)  # only position 2 (step 0's action): -log p = 3
    assert metrics["sft/tokens"].item() == 1


def test_sft_loss_hand_reference_and_gradcheck():
    lp = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, float("nan"), -float("inf")]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = sft_loss(lp, mask)
    assert loss.item() == pytest.approx(3.5 / 3)  # (1 + 2 + 0.5) / 3
    assert metrics["sft/nll"].item() == pytest.approx(3.5 / 3)
    assert metrics["sft/tokens"].item() == 3
    loss, _ = sft_loss(lp, mask, agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(1.0)  # (1.5 + 0.5) / 2
    torch.manual_seed(0)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    m = torch.rand(3, 7) < 0.6
    torch.testing.assert_close(
        sft_loss(x, m, agg="seq-mean-token-sum")[0], aggregate_reference(-x, m, "seq-mean-token-sum")
    )
    assert torch.autograd.gradcheck(lambda t: sft_loss(t, m)[0], (x,))


def test_sft_loss_garbage_and_empty():
    lp = torch.tensor([[-1.0, -float("inf")], [float("nan"), float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])
    loss, _ = sft_loss(lp, mask)
    loss.backward()
    assert loss.item() == 1.0
    assert lp.grad.tolist() == [[-1.0, 0.0], [0.0, 0.0]]
    empty, metrics = sft_loss(torch.full((2, 2), -math.inf), torch.zeros(2, 2))
    assert empty.item() == 0.0 and metrics["sft/nll"].item() == 0.0


def test_errors_name_the_argument():
    action_mask, turn_index = _trajectory()
    with pytest.raises(ValueError, match="keyed_values must be a non-empty"):
        interpolate_step_values({}, 3)
    with pytest.raises(ValueError, match=r"keyed_values keys .*\[0, 3\].*got key 4"):
        interpolate_step_values({4: 0.5}, 3)
    with pytest.raises(ValueError, match="keyed_values values must be finite"):
        interpolate_step_values({0: float("nan")}, 3)
    with pytest.raises(ValueError, match="num_steps"):
        interpolate_step_values({0: 0.5}, -1)
    with pytest.raises(ValueError, match="values must be"):
        td_credit(torch.zeros(0))
    with pytest.raises(ValueError, match="values must be finite"):
        td_credit([0.0, float("inf")])
    with pytest.raises(ValueError, match="credit must have shape"):
        credit_runs(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="eps"):
        credit_runs([0.1], eps=float("nan"))
    with pytest.raises(ValueError, match="turn_index must have the shape"):
        credit_assigned_sft_mask(action_mask, turn_index[:-1], False, [])
    with pytest.raises(ValueError, match="turn_index must be an integer"):
        credit_assigned_sft_mask(action_mask, turn_index.float(), False, [])
    with pytest.raises(ValueError, match="action_mask must have shape"):
        credit_assigned_sft_mask(action_mask[None, None], turn_index[None, None], False, [])
    with pytest.raises(ValueError, match="resolved must be a bool"):
        credit_assigned_sft_mask(action_mask, turn_index, [True], [])
    with pytest.raises(ValueError, match=r"resolved must hold one bool per row \(2\)"):
        credit_assigned_sft_mask(action_mask.repeat(2, 1), turn_index.repeat(2, 1), [True], [[], []])
    with pytest.raises(ValueError, match=r"runs must hold one list of runs per row \(2\)"):
        credit_assigned_sft_mask(action_mask.repeat(2, 1), turn_index.repeat(2, 1), [True, False], [[]])
    with pytest.raises(ValueError, match=r"runs must hold \(start, end\)"):
        credit_assigned_sft_mask(action_mask, turn_index, False, [(2, 2)])
    with pytest.raises(ValueError, match=r"runs\[1\]"):
        credit_assigned_sft_mask(
            action_mask.repeat(2, 1), turn_index.repeat(2, 1), [True, False], [[], [(-1, 2)]]
        )
    with pytest.raises(ValueError, match="logprobs must have shape"):
        sft_loss(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="mask"):
        sft_loss(torch.zeros(2, 3), torch.ones(2, 2))


def test_credit_exactly_eps_counts_despite_rounding():
    # Teacher values on a 0.05 grid: every credit is 0.05 in exact arithmetic, but float64 gives
    # 0.35 - 0.30 = 0.04999999999999999 < 0.05, which used to split the run into [(1, 2), (4, 5)].
    grid = [0.30, 0.35, 0.40, 0.45, 0.50, 0.55, 0.60]
    assert credit_runs(td_credit(grid)) == [(0, 6)]
    # float32 rounds harder: 0.35f - 0.30f = 0.0499999821.
    assert credit_runs(td_credit(torch.tensor(grid, dtype=torch.float32))) == [(0, 6)]
    # Interpolation on 0.1, 0.15, 0.2, 0.25, 0.3: four credits of 0.05 (was [(0, 1)]).
    assert credit_runs(td_credit(interpolate_step_values({0: 0.1, 2: 0.2, 4: 0.3}, 4))) == [(0, 4)]
    # The slack is a rounding allowance, not a looser threshold: 0.0499 stays below eps = 0.05.
    assert credit_runs([0.0499, 0.05, 0.0499]) == [(1, 2)]
