"""Evaluation metrics: pass@k, pass^k, avg@k, mean ± std over runs, best-of-N (learned and oracle).

Notation: ``P`` tasks, ``n`` samples per task of which ``c`` are correct, ``k`` the attempt budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def _int_array(x: object, arg: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"{arg} must be an integer or an array of integers, got {x!r}")
    if not np.issubdtype(arr.dtype, np.integer):
        if not (np.isfinite(arr).all() and (arr == np.round(arr)).all()):
            raise ValueError(f"{arg} must hold whole numbers, got {x!r}")
        arr = arr.astype(np.int64)
    return arr.astype(np.int64)


def _check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    return int(k)


def _counts(n: object, c: object, k: int) -> tuple[np.ndarray, np.ndarray, bool]:
    n_arr, c_arr = _int_array(n, "n"), _int_array(c, "c")
    scalar = n_arr.ndim == 0 and c_arr.ndim == 0
    try:
        n_arr, c_arr = np.broadcast_arrays(n_arr, c_arr)
    except ValueError as e:
        raise ValueError(f"n and c must broadcast, got shapes {n_arr.shape} and {c_arr.shape}") from e
    if (c_arr < 0).any() or (c_arr > n_arr).any():
        raise ValueError(f"c must satisfy 0 <= c <= n, got n={n_arr.tolist()}, c={c_arr.tolist()}")
    if (n_arr < k).any():
        raise ValueError(f"n must be >= k={k} for every task, got n={n_arr.tolist()}")
    return n_arr, c_arr, scalar


def _out(x: np.ndarray, scalar: bool) -> float | np.ndarray:
    return float(x) if scalar else x


def pass_at_k(n: int | np.ndarray, c: int | np.ndarray, k: int) -> float | np.ndarray:
    """Unbiased pass@k (Chen et al. 2021, Codex): chance that at least one of k draws without replacement is right.

    ``pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)``; 1 when ``n - c < k``.
    The product form never forms a binomial coefficient, so it is exact-ish and finite for any n.

    Args:
        n: samples per task (int or integer array). Shape: ``()`` or ``(P,)``, broadcast against ``c``.
        c: correct samples per task, ``0 <= c <= n``.
        k: attempt budget, ``1 <= k <= n``.

    Returns:
        A float for scalar inputs, else a float64 array of the broadcast shape.
    """
    k = _check_k(k)
    n_arr, c_arr, scalar = _counts(n, c, k)
    n_f, c_f = n_arr.reshape(-1), c_arr.reshape(-1)
    out = np.ones(n_f.shape, dtype=np.float64)
    hard = n_f - c_f >= k  # tasks where some k-subset can miss
    if hard.any():
        nh, ch = n_f[hard], c_f[hard]
        j = np.arange(int(ch.max()), dtype=np.int64)  # [J]
        live = j[None, :] < ch[:, None]  # [M, J]
        i = np.where(live, nh[:, None] - j[None, :], 1)  # i runs over n, n-1, ..., n-c+1
        miss = np.where(live, 1.0 - k / i, 1.0).prod(axis=1)  # [M]
        out[hard] = 1.0 - miss
    return _out(out.reshape(n_arr.shape), scalar)


def pass_hat_k(n: int | np.ndarray, c: int | np.ndarray, k: int) -> float | np.ndarray:
    """pass^k (Yao et al. 2024, tau-bench): chance that all k draws without replacement are right.

    ``pass^k = C(c, k) / C(n, k) = prod_{j=0}^{k-1} (c - j) / (n - j)``; 0 when ``c < k``.
    Arguments and return as in :func:`pass_at_k`.
    """
    k = _check_k(k)
    n_arr, c_arr, scalar = _counts(n, c, k)
    n_f, c_f = n_arr.reshape(-1).astype(np.float64), c_arr.reshape(-1).astype(np.float64)
    j = np.arange(k, dtype=np.float64)  # [k]
    ratio = np.clip(c_f[:, None] - j[None, :], 0.0, None) / (n_f[:, None] - j[None, :])  # [M, k]
    return _out(ratio.prod(axis=1).reshape(n_arr.shape), scalar)


def _matrix(x: object, arg: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise ValueError(f"{arg} must be a numeric [P, N] array, got {type(x).__name__} of dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{arg} must have shape [P, N], got shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"{arg} must be finite, got NaN or inf")
    return arr


def _first_n(arr: np.ndarray, n: int | None, arg: str, n_arg: str = "n") -> np.ndarray:
    if n is None:
        return arr
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= arr.shape[1]:
        raise ValueError(
            f"{n_arg} must be an int in [1, {arr.shape[1]}] ({arg} has {arr.shape[1]} columns), got {n!r}"
        )
    return arr[:, :n]


def avg_at_k(successes_PK: object, *, k: int | None = None) -> float:
    """avg@k: success averaged over k samples per task, then over tasks: ``(1/P) sum_p (1/k) sum_j s_pj``.

    Args:
        successes_PK: outcomes (bool, 0/1 or scores). Shape: ``(P, K)``.
        k: use the first ``k`` samples of each task; default all ``K``.

    Returns:
        A float; 0.0 for zero tasks.
    """
    s = _first_n(_matrix(successes_PK, "successes_PK"), k, "successes_PK", "k")
    if s.shape[0] == 0 or s.shape[1] == 0:
        return 0.0
    return float(s.mean())


def mean_std(values: object, *, ddof: int = 1) -> tuple[float, float]:
    """Mean and standard deviation over independent runs (report as ``mean ± std``).

    ``std = sqrt(sum (x - mean)^2 / (R - ddof))``; default ``ddof=1`` (sample std). A single run gives std 0.0.

    Args:
        values: one number per run. Shape: ``(R,)``, ``R >= 1``.
        ddof: delta degrees of freedom, 0 or 1.

    Returns:
        ``(mean, std)`` floats.
    """
    if ddof not in (0, 1) or isinstance(ddof, bool):
        raise ValueError(f"ddof must be 0 or 1, got {ddof!r}")
    arr = np.asarray(values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool) or arr.ndim != 1:
        raise ValueError(f"values must be a 1-D list of numbers, got {values!r}")
    if arr.size == 0:
        raise ValueError("values must hold at least one run, got an empty list")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"values must be finite, got {arr.tolist()}")
    if arr.size == 1:
        return float(arr[0]), 0.0
    return float(arr.mean()), float(math.sqrt(((arr - arr.mean()) ** 2).sum() / (arr.size - ddof)))


@dataclass(frozen=True)
class BestOfNResult:
    """The outcome of best-of-N selection."""

    chosen: np.ndarray
    """Int64 ``[P]``: index of the chosen candidate per task."""
    chosen_success: np.ndarray
    """Float64 ``[P]``: success of the chosen candidate."""
    success_rate: float
    """Mean of ``chosen_success`` (0.0 for zero tasks)."""


def best_of_n(scores_PN: object, successes_PN: object, *, n: int | None = None) -> BestOfNResult:
    """Best-of-N with a learned scorer (e.g. a value model): per task, take the highest-scoring candidate.

    ``chosen_t = argmax_i score_ti`` (ties go to the lower index), ``success_rate = mean_t s_{t, chosen_t}``.

    Args:
        scores_PN: scorer output per candidate. Shape: ``(P, N)``.
        successes_PN: ground-truth outcome per candidate (bool / 0-1 / score). Shape: ``(P, N)``.
        n: use only the first ``n`` candidates of each task; default all.

    Returns:
        :class:`BestOfNResult`.
    """
    sc = _matrix(scores_PN, "scores_PN")
    su = _matrix(successes_PN, "successes_PN")
    if sc.shape != su.shape:
        raise ValueError(f"successes_PN must have the shape of scores_PN {sc.shape}, got {su.shape}")
    sc, su = _first_n(sc, n, "scores_PN"), _first_n(su, n, "scores_PN")
    if sc.shape[1] == 0 and sc.shape[0] > 0:
        raise ValueError("scores_PN must have at least one candidate per task, got N=0")
    chosen = sc.argmax(axis=1).astype(np.int64) if sc.shape[0] else np.zeros(0, dtype=np.int64)
    got = su[np.arange(su.shape[0]), chosen]
    return BestOfNResult(chosen, got, float(got.mean()) if got.size else 0.0)


def oracle_best_of_n(successes_PN: object, *, n: int | None = None) -> float:
    """Oracle best-of-N: a task counts when any of its first ``n`` candidates succeeds (``mean_t max_i s_ti``).

    An upper bound for :func:`best_of_n`. ``successes_PN`` shape ``(P, N)``; returns 0.0 for zero tasks.
    """
    su = _first_n(_matrix(successes_PN, "successes_PN"), n, "successes_PN")
    if su.shape[0] == 0:
        return 0.0
    if su.shape[1] == 0:
        raise ValueError("successes_PN must have at least one candidate per task, got N=0")
    return float(su.max(axis=1).mean())
