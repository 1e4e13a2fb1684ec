"""GAE over steps: a hand-computed case, a reference reverse loop with masked holes, and edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from orchard.value import gae, terminal_rewards


def reference_gae(rewards, values, mask, gamma, lam):
    """Row by row, backwards, remembering the last real step seen (holes are skipped)."""
    B, S = rewards.shape
    adv = torch.zeros(B, S, dtype=torch.float64)
    ret = torch.zeros(B, S, dtype=torch.float64)
    for b in range(B):
        next_v, next_a = 0.0, 0.0
        for t in reversed(range(S)):
            if not mask[b, t]:
                continue
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            a = delta + gamma * lam * next_a
            adv[b, t], ret[b, t] = a, a + float(values[b, t])
            next_v, next_a = float(values[b, t]), a
    return adv, ret


def test_hand_computed_terminal_reward_propagates_back() -> None:
    # 3 steps, outcome 1 at the end, values 0.5, 0.6, 0.8; gamma 0.98, lam 0.95 (gl = 0.931):
    # d2 = 1 + 0 - 0.8 = 0.2;          A2 = 0.2
    # d1 = 0 + 0.98*0.8 - 0.6 = 0.184; A1 = 0.184 + 0.931*0.2 = 0.3702
    # d0 = 0 + 0.98*0.6 - 0.5 = 0.088; A0 = 0.088 + 0.931*0.3702 = 0.4326562
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.8]])
    adv, ret = gae(r, v, torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(adv, torch.tensor([[0.4326562, 0.3702, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.9326562, 0.9702, 1.0]]))


def test_hole_is_skipped_not_terminal() -> None:
    # Steps 0 and 2 real, 1 a hole holding garbage: step 0's successor is step 2.
    # lam = 1, values 0: A2 = 1, A0 = 0 + 0.98*0 - 0 + 0.98*1 = 0.98.
    r = torch.tensor([[0.0, float("nan"), 1.0]])
    v = torch.tensor([[0.0, float("inf"), 0.0]])
    m = torch.tensor([[True, False, True]])
    adv, ret = gae(r, v, m, gamma=0.98, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.98, 0.0, 1.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.98, 0.0, 1.0]]))


@pytest.mark.parametrize("seed", range(6))
def test_matches_reference_loop_with_holes(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    B, S = 1 + seed * 2, 3 + seed
    r = torch.randn(B, S, generator=gen)
    v = torch.randn(B, S, generator=gen)
    m = torch.rand(B, S, generator=gen) > 0.35
    m[0] = False  # a row with no step at all
    gamma, lam = 0.9 + 0.01 * seed, 0.8 + 0.03 * seed
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam)
    ref_a, ref_r = reference_gae(r, v, m, gamma, lam)
    torch.testing.assert_close(adv.double(), ref_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret.double(), ref_r, rtol=1e-5, atol=1e-6)
    # Filling masked positions with garbage changes nothing.
    r2 = torch.where(m, r, torch.full_like(r, float("nan")))
    v2 = torch.where(m, v, torch.full_like(v, -float("inf")))
    adv2, ret2 = gae(r2, v2, m, gamma=gamma, lam=lam)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_lambda_one_returns_are_discounted_reward_sums() -> None:
    # lam = 1: R_t = sum_k gamma^k r_{t+k} over real steps, whatever the values.
    r = torch.tensor([[1.0, 0.0, 2.0, 3.0]])
    v = torch.tensor([[5.0, -1.0, 0.3, 7.0]])
    _, ret = gae(r, v, torch.ones(1, 4), gamma=0.5, lam=1.0)
    # R3 = 3; R2 = 2 + 1.5 = 3.5; R1 = 0 + 1.75 = 1.75; R0 = 1 + 0.875 = 1.875
    torch.testing.assert_close(ret, torch.tensor([[1.875, 1.75, 3.5, 3.0]]))


def test_terminal_rewards_on_last_real_step() -> None:
    m = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    out = terminal_rewards(torch.tensor([1.0, -1.0, 5.0]), m)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # Propagation: with values 0 and lam = 1 the first step's return is gamma^(S-1) * outcome.
    _, ret = gae(out, torch.zeros(3, 3), m, gamma=0.98, lam=1.0)
    assert math.isclose(float(ret[0, 0]), 0.98, rel_tol=1e-6)


def test_bad_inputs_name_the_argument() -> None:
    with pytest.raises(ValueError, match="values"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="rewards"):
        gae(torch.zeros(3), torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), gamma=1.5)
    with pytest.raises(ValueError, match="outcome"):
        terminal_rewards(torch.zeros(3), torch.ones(2, 2))
