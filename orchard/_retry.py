"""The wait between two tries of a failed call: one backoff formula for every retry loop in orchard.

Try ``k`` (0-based) failed; the next waits ``uniform(c/2, c)`` seconds with ``c = min(max_s, base_s · 2^k)``:
exponential, capped, and jittered into its upper half ("equal jitter", M. Brooker, "Exponential Backoff And
Jitter", AWS Architecture Blog, 2015). The jitter spreads the retries of many clients that failed together (one
overloaded server, a batch of rollouts); keeping the lower half out means no retry comes straight back.

Each loop keeps its own rules on what is retried, how many times, and what a server's ``Retry-After`` means.
"""

from __future__ import annotations

import math
import random

__all__ = ["SYSTEM_RANDOM", "backoff_s"]

SYSTEM_RANDOM = random.SystemRandom()
"""The default source of jitter: the OS's entropy, untouched by ``random.seed``, so processes seeded alike (the
ranks of one run, the replicas of a service) do not retry in step."""


def backoff_s(attempt: int, *, base_s: float, max_s: float = 10.0, rng: random.Random | None = None) -> float:
    """Seconds to wait after failed try ``attempt`` (0-based): ``uniform(c/2, c)``, ``c = min(max_s, base_s · 2^attempt)``.

    Args:
        attempt: how many tries failed before this one, minus one (0 after the first failure).
        base_s: ``c`` after the first failure; 0 retries at once.
        max_s: the largest ``c``, whatever the attempt. Default 10 s.
        rng: the jitter's source; default :data:`SYSTEM_RANDOM`. A seeded ``random.Random`` reproduces the waits.
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"attempt must be an int >= 0, got {attempt!r}")
    if not (0 <= base_s < math.inf and 0 <= max_s < math.inf):
        raise ValueError(f"base_s and max_s must be finite numbers >= 0, got {base_s!r}, {max_s!r}")
    cap = min(max_s, base_s * 2.0 ** min(attempt, 1000))  # 2.0**1024 overflows; any cap is reached long before
    return (rng or SYSTEM_RANDOM).uniform(cap / 2, cap)
