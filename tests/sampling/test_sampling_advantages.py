import math

import numpy as np
import pytest
import torch

from orchard.sampling import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    dr_grpo_advantages,
    group_advantages,
    rloo_advantages,
)


def test_grpo_hand_computed():
    # group [1, 0, 0, 1]: mean 0.5, sample var = 4 * 0.25 / 3 = 1/3, std = 0.57735
    # A = ±0.5 / (0.57735 + 1e-6) = ±0.866024...
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[expected, -expected, -expected, expected]]))


def test_grpo_population_std_and_dr_grpo_hand_computed():
    # [3, 1]: mean 2, population std 1 -> A = ±1/(1+eps); Dr.GRPO: r - mean = ±1
    r = np.array([[3.0, 1.0]])
    np.testing.assert_allclose(group_advantages(r, unbiased=False, eps=0.0), [[1.0, -1.0]])
    np.testing.assert_allclose(dr_grpo_advantages(r), [[1.0, -1.0]])
    np.testing.assert_allclose(group_advantages(r, normalize_std=False), [[1.0, -1.0]])


def test_rloo_hand_computed():
    # [1, 0, 0]: A_0 = 1 - (0+0)/2 = 1; A_1 = 0 - (1+0)/2 = -0.5
    np.testing.assert_allclose(rloo_advantages([[1.0, 0.0, 0.0]]), [[1.0, -0.5, -0.5]])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 2), (3, 5), (7, 1), (4, 9)])
def test_reference_over_random_shapes(seed, shape):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    adv = group_advantages(r)
    for i in range(shape[0]):
        row = r[i].tolist()
        n = len(row)
        if n < 2:
            ref = [0.0] * n
        else:
            mu = sum(row) / n
            sd = math.sqrt(sum((x - mu) ** 2 for x in row) / (n - 1))
            ref = [(x - mu) / (sd + 1e-6) for x in row]
        torch.testing.assert_close(adv[i], torch.tensor(ref, dtype=torch.float64))
    # RLOO equals n/(n-1) times the Dr.GRPO advantage
    n = shape[1]
    if n > 1:
        torch.testing.assert_close(rloo_advantages(r), dr_grpo_advantages(r) * n / (n - 1))


def test_degenerate_groups_are_zero_and_finite():
    r = torch.tensor([[0.1, 0.1, 0.1], [2.0, 2.0, 2.0]])
    assert torch.equal(group_advantages(r), torch.zeros(2, 3))
    assert torch.equal(rloo_advantages(r), torch.zeros(2, 3))
    assert torch.equal(group_advantages(torch.tensor([[5.0]])), torch.zeros(1, 1))
    assert group_advantages(torch.zeros(0, 4)).shape == (0, 4)
    assert group_advantages(torch.zeros(3, 0)).shape == (3, 0)


def test_mask_garbage_is_ignored():
    r = torch.tensor([[1.0, 0.0, float("nan"), float("inf")]])
    m = torch.tensor([[True, True, False, False]])
    adv = group_advantages(r, mask_GN=m)
    # valid members [1, 0]: mean .5, sample std .7071 -> ±.5/.7071
    ref = group_advantages(torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(adv[:, :2], ref)
    assert torch.equal(adv[:, 2:], torch.zeros(1, 2))
    # a single valid member gives 0
    assert torch.equal(group_advantages(r, mask_GN=torch.tensor([[True, False, False, False]])), torch.zeros(1, 4))


def test_dtypes_and_types_preserved():
    assert group_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert group_advantages(torch.tensor([[1, 0]])).dtype == torch.float32
    out = group_advantages([[1, 0]])
    assert isinstance(out, np.ndarray) and out.dtype == np.float64


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="rewards_GN"):
        group_advantages(torch.zeros(3))
    with pytest.raises(ValueError, match="rewards_GN"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="mask_GN"):
        group_advantages(torch.zeros(2, 3), mask_GN=torch.ones(3, 2))
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2, 3), eps=-1.0)
    with pytest.raises(ValueError, match="rewards_GN"):
        group_advantages([["a", "b"]])


def test_registry():
    assert ADVANTAGE_ESTIMATORS.names() == ["grpo", "dr_grpo", "rloo"]
    assert ADVANTAGE_ESTIMATORS.get("rloo", "estimator") is rloo_advantages
    with pytest.raises(ValueError, match=r"estimator must be one of \['grpo', 'dr_grpo', 'rloo'\]"):
        ADVANTAGE_ESTIMATORS.get("ppo", "estimator")
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo", group_advantages)


def test_broadcast_to_tokens():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert torch.equal(broadcast_to_tokens(adv, mask), torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))
    with pytest.raises(ValueError, match="mask_BT"):
        broadcast_to_tokens(adv, torch.ones(3, 3))
    with pytest.raises(ValueError, match="adv_B"):
        broadcast_to_tokens(torch.ones(2, 2), mask)
