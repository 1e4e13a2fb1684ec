"""Monte-Carlo state values: hand-computed means and Wilson intervals, dropped continuations, degenerate input."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

from orchard.losses import credit_runs, interpolate_step_values, td_credit
from orchard.value import (
    MonteCarloValues,
    monte_carlo_step_targets,
    monte_carlo_step_values,
    monte_carlo_values,
)

Z95 = 1.959963984540054  # Φ⁻¹(0.975)


def wilson(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The textbook formula, written out independently of the implementation's tensor form."""
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def test_hand_computed_means_and_intervals():
    # state 0: 1 of 4 succeed -> 0.25; state 1: all 4 -> 1.0; state 2: rewards 0.5, 0.5, 1, 0 -> 2 / 4 = 0.5
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 1.0, 0.0]])
    est = monte_carlo_values(rewards)
    torch.testing.assert_close(est.values, torch.tensor([0.25, 1.0, 0.5], dtype=torch.float64))
    assert est.counts.tolist() == [4, 4, 4] and est.valued.tolist() == [True, True, True]
    # all 4 succeed: p = 1, z² = 3.8415; centre = (1 + 3.8415/8) / (1 + 3.8415/4) = 1.4802 / 1.9604 = 0.7551,
    # half = (1.96 / 1.9604) * sqrt(0 + 3.8415/64) = 0.9998 * 0.2450 = 0.2449 -> [4 / (4 + z²), 1] = [0.5101, 1]
    assert float(est.low[1]) == pytest.approx(4 / (4 + Z95**2)) == pytest.approx(0.5101, abs=1e-4)
    assert float(est.high[1]) == pytest.approx(1.0)
    # 1 of 4: centre = (0.25 + 0.4802) / 1.9604 = 0.3725, half = 0.9998 * sqrt(0.046875 + 0.060024) = 0.3268
    # -> [0.0456, 0.6994]
    assert float(est.low[0]) == pytest.approx(0.0456, abs=1e-4)
    assert float(est.high[0]) == pytest.approx(0.6994, abs=1e-4)
    for row, p in enumerate((0.25, 1.0, 0.5)):
        lo, hi = wilson(p, 4)
        assert float(est.low[row]) == pytest.approx(lo) and float(est.high[row]) == pytest.approx(hi)


def test_lost_continuations_are_dropped_not_scored_zero():
    # 2 of 3 continuations finished, both resolved: value 2 / 2 = 1, not 2 / 3; the lost one's NaN is never read
    rewards = torch.tensor([[1.0, float("nan"), 1.0]])
    valid = torch.tensor([[True, False, True]])
    est = monte_carlo_values(rewards, valid)
    assert est.values.tolist() == [1.0] and est.counts.tolist() == [2]
    assert float(est.low[0]) == pytest.approx(2 / (2 + Z95**2))  # the interval of n = 2, wider than n = 3's


def test_masked_rewards_may_hold_anything():
    gen = torch.Generator().manual_seed(0)
    for S, K in ((1, 1), (3, 5), (7, 2)):
        rewards = torch.rand(S, K, generator=gen)
        valid = torch.rand(S, K, generator=gen) > 0.3
        garbage = torch.where(valid, rewards, torch.full_like(rewards, 7.5))
        a, b = monte_carlo_values(rewards, valid), monte_carlo_values(garbage, valid)
        for field in ("values", "low", "high", "counts", "valued"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_matches_a_plain_loop_over_random_shapes():
    rng = np.random.default_rng(1)
    for S, K in ((1, 1), (2, 3), (5, 8), (4, 1)):
        binary = rng.random((S, K)) < 0.5
        rewards = np.where(rng.random((S, K)) < 0.5, binary.astype(float), rng.random((S, K)))
        valid = rng.random((S, K)) < 0.8
        est = monte_carlo_values(rewards, torch.from_numpy(valid), confidence=0.9)
        z = NormalDist().inv_cdf(0.95)
        for i in range(S):
            kept = rewards[i][valid[i]]
            if kept.size == 0:
                assert (float(est.values[i]), float(est.low[i]), float(est.high[i])) == (0.5, 0.0, 1.0)
                continue
            p = float(kept.mean())
            lo, hi = wilson(p, kept.size, z)
            assert float(est.values[i]) == pytest.approx(p)
            assert float(est.low[i]) == pytest.approx(lo) and float(est.high[i]) == pytest.approx(hi)
            assert 0.0 <= lo <= p <= hi <= 1.0


def test_degenerate_input_is_finite_and_flagged():
    # K = 1: one failure -> value 0, interval [0, z² / (1 + z²)] = [0, 0.7935]
    est = monte_carlo_values([[0.0]])
    assert est.values.tolist() == [0.0] and float(est.low[0]) == 0.0
    assert float(est.high[0]) == pytest.approx(Z95**2 / (1 + Z95**2)) == pytest.approx(0.7935, abs=1e-4)
    # no valid continuation: 0.5 in [0, 1], counts 0, not valued
    est = monte_carlo_values([[1.0, 0.0]], torch.tensor([[False, False]]))
    assert (est.values.tolist(), est.low.tolist(), est.high.tolist()) == ([0.5], [0.0], [1.0])
    assert est.counts.tolist() == [0] and est.valued.tolist() == [False]
    # no state at all
    est = monte_carlo_values(torch.zeros(0, 3))
    assert est.values.shape == (0,) and est.valued.dtype == torch.bool
    # a wider interval at a higher confidence
    narrow, wide = monte_carlo_values([[1.0, 0.0, 1.0]], confidence=0.8), monte_carlo_values([[1.0, 0.0, 1.0]],
                                                                                               confidence=0.99)
    assert float(wide.low[0]) < float(narrow.low[0]) and float(wide.high[0]) > float(narrow.high[0])


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    (([1.0, 0.0],), {}, "rewards must have shape"),
    ((torch.zeros(2, 0),), {}, "K >= 1"),
    (([[1.5]],), {}, r"rewards must lie in \[0, 1\]"),
    (([[-0.1]],), {}, r"rewards must lie in \[0, 1\]"),
    (([[float("nan")]],), {}, "finite where valid"),
    ((torch.ones(1, 2, dtype=torch.bool),), {}, "real numbers"),
    (([[1.0, 0.0]], [[1, 0]]), {}, "valid must be a bool tensor"),
    (([[1.0, 0.0]], torch.tensor([[True]])), {}, "valid must have the shape"),
    (([[1.0]],), {"confidence": 1.0}, "confidence"),
    (([[1.0]],), {"confidence": True}, "confidence"),
    (("abc",), {}, "rewards must"),
])
def test_bad_input_names_the_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        monte_carlo_values(*args, **kwargs)


def test_step_values_feed_the_credit_pipeline():
    # states 0, 2, 4 of a 4-step failed trajectory: 0 of 4, 3 of 4, and the last state lost every continuation
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    valid = torch.tensor([[True] * 4, [True] * 4, [False] * 4])
    keyed = monte_carlo_step_values([0, 2, 4], monte_carlo_values(rewards, valid))
    assert keyed == {0: 0.0, 2: 0.75}  # state 4 has no value, so it is left out
    # interpolated: 0, 0.375, 0.75, 0.75, 0.75 -> credits 0.375, 0.375, 0, 0 -> one run, steps 0 and 1
    assert credit_runs(td_credit(interpolate_step_values(keyed, 4)), eps=0.05) == [(0, 2)]
    with pytest.raises(ValueError, match="one index per row"):
        monte_carlo_step_values([0, 2], monte_carlo_values(rewards, valid))
    with pytest.raises(ValueError, match="distinct"):
        monte_carlo_step_values([0, 0, 1], monte_carlo_values(rewards, valid))
    with pytest.raises(ValueError, match="integer"):
        monte_carlo_step_values([0, 1.0, 2], monte_carlo_values(rewards, valid))
    with pytest.raises(ValueError, match="MonteCarloValues"):
        monte_carlo_step_values([0], {"values": [1.0]})
    assert isinstance(monte_carlo_values([[1.0]]), MonteCarloValues)


def test_step_targets_sit_on_the_step_that_leads_to_the_state():
    # state t+1's value is step t's target: {0: ., 1: 1.0, 3: 0.25} over 3 steps -> step 0: 1.0, step 2: 0.25;
    # state 0 has no step before it; in reward units (-1, 1): 1.0 -> 1.0, 0.25 -> -1 + 2 * 0.25 = -0.5
    targets, mask = monte_carlo_step_targets([{0: 0.5, 1: 1.0, 3: 0.25}, None, {5: 1.0}], 3, reward_range=(-1.0, 1.0))
    assert targets.tolist() == [[1.0, 0.0, -0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert mask.tolist() == [[True, False, True], [False] * 3, [False] * 3]  # state 5 is past the 3 columns
    targets, mask = monte_carlo_step_targets([{2: 0.75}], 2)
    assert targets.tolist() == [[0.0, 0.75]] and targets.dtype == torch.float32
    for args, kwargs, match in ((([{1: 1.5}], 2), {}, r"in \[0, 1\]"), (([{-1: 0.5}], 2), {}, "state indices"),
                                (([{1: 0.5}], 0), {}, "num_steps"), (({1: 0.5}, 2), {}, "one mapping"),
                                (([[0.5]], 2), {}, "must be a mapping"),
                                (([{1: 0.5}], 2), {"reward_range": (1.0, -1.0)}, "low < high")):
        with pytest.raises(ValueError, match=match):
            monte_carlo_step_targets(*args, **kwargs)
