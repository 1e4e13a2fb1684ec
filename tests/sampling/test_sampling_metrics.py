import itertools
import math

import numpy as np
import pytest
import torch

from orchard.sampling import avg_at_k, best_of_n, mean_std, oracle_best_of_n, pass_at_k, pass_hat_k


def brute_pass(n, c, k, need_all):
    """Enumerate every k-subset of n samples (the first c correct) and count the qualifying ones."""
    subsets = list(itertools.combinations(range(n), k))
    hits = [all(i < c for i in s) if need_all else any(i < c for i in s) for s in subsets]
    return sum(hits) / len(subsets)


def test_hand_computed():
    # pass@2, n=10, c=3: 1 - C(7,2)/C(10,2) = 1 - 21/45 = 24/45
    assert pass_at_k(10, 3, 2) == pytest.approx(24 / 45)
    # pass@1 = c/n
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    # pass^2, n=10, c=3: C(3,2)/C(10,2) = 3/45
    assert pass_hat_k(10, 3, 2) == pytest.approx(3 / 45)
    # n - c < k -> certain; c < k -> pass^k impossible
    assert pass_at_k(5, 3, 3) == 1.0
    assert pass_hat_k(5, 2, 3) == 0.0
    assert pass_at_k(5, 0, 3) == 0.0 and pass_hat_k(5, 5, 3) == 1.0


@pytest.mark.parametrize("n", range(1, 9))
def test_against_subset_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass(n, c, k, need_all=False), abs=1e-12)
            assert pass_hat_k(n, c, k) == pytest.approx(brute_pass(n, c, k, need_all=True), abs=1e-12)


def test_vectorised_matches_scalar_and_large_n_is_finite():
    rng = np.random.default_rng(3)
    n = rng.integers(5, 40, size=17)
    c = (rng.random(17) * (n + 1)).astype(np.int64).clip(0, n)
    got = pass_at_k(n, c, 5)
    assert got.shape == (17,)
    np.testing.assert_allclose(got, [pass_at_k(int(a), int(b), 5) for a, b in zip(n, c, strict=True)])
    np.testing.assert_allclose(pass_hat_k(n, c, 5), [pass_hat_k(int(a), int(b), 5) for a, b in zip(n, c, strict=True)])
    # broadcasting a scalar n over a vector of c; torch tensors accepted
    np.testing.assert_allclose(pass_at_k(10, np.array([0, 3, 10]), 2), [0.0, 24 / 45, 1.0])
    np.testing.assert_allclose(pass_at_k(torch.tensor([10]), torch.tensor([3]), 2), [24 / 45])
    # n = 2000: C(2000, 100) overflows floats, the product form does not
    big = pass_at_k(2000, 7, 100)
    ref = 1 - math.exp(math.lgamma(1994) - math.lgamma(1894) - math.lgamma(2001) + math.lgamma(1901))
    assert math.isfinite(big) and big == pytest.approx(ref, rel=1e-9)
    assert pass_at_k(np.zeros(0, dtype=int), np.zeros(0, dtype=int), 1).shape == (0,)


@pytest.mark.parametrize(
    "args, arg",
    [((3, 4, 1), "c"), ((3, -1, 1), "c"), ((3, 1, 4), "n"), ((3, 1, 0), "k"), ((3, 1, 1.5), "k"), ((3.5, 1, 1), "n")],
)
def test_bad_counts(args, arg):
    for fn in (pass_at_k, pass_hat_k):
        with pytest.raises(ValueError, match=arg):
            fn(*args)


def test_avg_at_k_and_mean_std():
    s = [[1, 0, 1, 1], [0, 0, 0, 1]]
    # per task 3/4 and 1/4 -> avg 1/2; first two samples: 1/2 and 0 -> 1/4
    assert avg_at_k(s) == 0.5
    assert avg_at_k(s, k=2) == 0.25
    assert avg_at_k(np.zeros((0, 3))) == 0.0
    # runs 1, 2, 3: mean 2, sample std sqrt((1 + 0 + 1) / 2) = 1, population std sqrt(2/3)
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert mean_std([1.0, 2.0, 3.0], ddof=0) == pytest.approx((2.0, math.sqrt(2 / 3)))
    assert mean_std([0.7]) == (0.7, 0.0)
    with pytest.raises(ValueError, match="values"):
        mean_std([])
    with pytest.raises(ValueError, match="values"):
        mean_std([[1.0]])
    with pytest.raises(ValueError, match="ddof"):
        mean_std([1.0], ddof=2)
    with pytest.raises(ValueError, match="k"):
        avg_at_k(s, k=5)
    with pytest.raises(ValueError, match="successes_PK"):
        avg_at_k([1, 0])


def test_best_of_n_and_oracle():
    scores = [[0.1, 0.9, 0.5], [0.7, 0.7, 0.2], [0.3, 0.2, 0.8]]
    success = [[1, 0, 1], [0, 1, 0], [0, 0, 1]]
    res = best_of_n(scores, success)
    # argmax: task0 -> 1 (fail), task1 -> tie 0/1 -> 0 (fail), task2 -> 2 (ok): 1/3
    assert res.chosen.tolist() == [1, 0, 2]
    assert res.chosen_success.tolist() == [0.0, 0.0, 1.0]
    assert res.success_rate == pytest.approx(1 / 3)
    # oracle: every task has a success -> 1.0; first two candidates: tasks 0 and 1 -> 2/3
    assert oracle_best_of_n(success) == 1.0
    assert oracle_best_of_n(success, n=2) == pytest.approx(2 / 3)
    assert best_of_n(scores, success, n=1).success_rate == pytest.approx(1 / 3)
    # the oracle bounds any scorer
    rng = np.random.default_rng(0)
    su = rng.random((31, 7)) < 0.3
    for _ in range(5):
        assert best_of_n(rng.random((31, 7)), su).success_rate <= oracle_best_of_n(su)
    assert best_of_n(np.zeros((0, 3)), np.zeros((0, 3))).success_rate == 0.0
    with pytest.raises(ValueError, match="successes_PN"):
        best_of_n(scores, [[1, 0]])
    with pytest.raises(ValueError, match="scores_PN"):
        best_of_n([[float("nan")]], [[1]])
