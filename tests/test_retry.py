"""orchard._retry.backoff_s: the one backoff formula every retry loop uses."""

import random
import statistics

import pytest

from orchard._retry import backoff_s


def test_backoff_doubles_from_base_up_to_the_cap_in_the_upper_half() -> None:
    # c = min(max_s, base_s * 2**k) with base 0.5, cap 3: c = 0.5, 1, 2, 3, 3; each wait in [c/2, c]
    rng = random.Random(0)
    for attempt, cap in enumerate([0.5, 1.0, 2.0, 3.0, 3.0]):
        waits = [backoff_s(attempt, base_s=0.5, max_s=3.0, rng=rng) for _ in range(2000)]
        assert cap / 2 <= min(waits) and max(waits) <= cap
        assert min(waits) < cap * 0.52 and max(waits) > cap * 0.98  # the whole upper half is used
        assert statistics.fmean(waits) == pytest.approx(0.75 * cap, rel=0.03)  # uniform: mean (c/2 + c) / 2


def test_backoff_defaults_cap_at_ten_seconds_and_survives_huge_attempts() -> None:
    assert 5.0 <= backoff_s(20, base_s=0.5) <= 10.0  # 0.5 * 2**20 s capped at 10
    assert 5.0 <= backoff_s(5000, base_s=0.5) <= 10.0  # no OverflowError from 2.0**5000
    assert backoff_s(3, base_s=0.0) == 0.0  # base 0: retry at once


def test_seeded_rng_reproduces_the_waits_and_the_default_ignores_random_seed() -> None:
    a = [backoff_s(k, base_s=1.0, rng=random.Random(7)) for k in range(4)]
    b = [backoff_s(k, base_s=1.0, rng=random.Random(7)) for k in range(4)]
    assert a == b
    # Processes seeded alike must not retry in step: the default source is the OS's entropy, not `random`.
    random.seed(1)
    first = backoff_s(3, base_s=1.0)
    random.seed(1)
    assert backoff_s(3, base_s=1.0) != first


@pytest.mark.parametrize(
    ("kw", "name"),
    [(dict(attempt=-1), "attempt"), (dict(attempt=1.0), "attempt"), (dict(attempt=True), "attempt"),
     (dict(base_s=-0.1), "base_s"), (dict(max_s=float("inf")), "max_s"), (dict(base_s=float("nan")), "base_s")],
)
def test_backoff_rejects_bad_arguments(kw: dict, name: str) -> None:
    args = dict(attempt=0, base_s=0.1, max_s=1.0) | kw
    with pytest.raises(ValueError, match=name):
        backoff_s(args.pop("attempt"), **args)
