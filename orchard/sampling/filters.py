"""Group and task filters: dynamic sampling (DAPO) and difficulty filtering before RL."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def _rows(x: object, arg: str) -> list[np.ndarray]:
    """A ``[G, N]`` tensor / array, or a ragged sequence of sequences, as a list of float64 rows."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        if x.ndim != 2:
            raise ValueError(f"{arg} must have shape [G, N] (or be a list of lists), got shape {x.shape}")
        if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
            raise ValueError(f"{arg} must be numeric, got dtype {x.dtype}")
        return list(x.astype(np.float64))
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise ValueError(f"{arg} must be a [G, N] array or a list of lists, got {type(x).__name__}")
    rows = []
    for g, row in enumerate(x):
        try:
            arr = np.asarray(row, dtype=np.float64)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{arg}[{g}] must be a list of numbers, got {row!r}") from e
        if arr.ndim != 1:
            raise ValueError(f"{arg}[{g}] must be a flat list of numbers, got shape {arr.shape}")
        rows.append(arr)
    return rows


@dataclass(frozen=True)
class GroupFilterResult:
    """Which groups survived :func:`filter_groups`."""

    keep: np.ndarray
    """Bool ``[G]``: True where the group is kept."""
    kept_indices: np.ndarray
    """Int64 indices of kept groups, ascending."""
    num_kept: int
    num_dropped: int


def filter_groups(rewards_GN: object, *, eps: float = 0.0) -> GroupFilterResult:
    """Dynamic sampling (DAPO, Yu et al. 2025): drop groups whose rewards are all equal.

    A group is kept when ``max_i r_gi - min_i r_gi > eps``; with ``eps = 0`` (default) that is "not all equal".
    Groups with fewer than two members carry no signal and are dropped.

    Args:
        rewards_GN: rewards. Shape: ``(G, N)`` tensor / array, or a ragged list of ``G`` lists.
        eps: spread at or below which a group counts as flat; default 0.

    Returns:
        :class:`GroupFilterResult` (an empty input keeps nothing and drops nothing).
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    rows = _rows(rewards_GN, "rewards_GN")
    keep = np.zeros(len(rows), dtype=bool)
    for g, row in enumerate(rows):
        if not np.isfinite(row).all():
            raise ValueError(f"rewards_GN[{g}] must be finite, got {row.tolist()}")
        keep[g] = row.size >= 2 and float(row.max() - row.min()) > eps
    kept = np.flatnonzero(keep).astype(np.int64)
    return GroupFilterResult(keep, kept, int(kept.size), int(len(rows) - kept.size))


@dataclass(frozen=True)
class DifficultyFilterResult:
    """Which tasks survived :func:`difficulty_filter`."""

    keep: np.ndarray
    """Bool ``[T]``: True where the task is kept."""
    kept_indices: np.ndarray
    """Int64 indices of kept tasks, ascending."""
    pass_rate: np.ndarray
    """Float64 ``[T]``: estimated success rate p̂ of each task."""
    num_kept: int
    num_dropped: int


def difficulty_filter(successes_TK: object, *, low: float = 0.0, high: float = 0.5) -> DifficultyFilterResult:
    """Keep tasks of useful difficulty from ``k`` initial rollouts each: ``low < p̂ <= high``.

    ``p̂_t = mean_k s_tk``. The defaults keep ``0 < p̂ <= 0.5``: tasks the policy solves sometimes but at most half
    of the time (never-solved tasks give no signal; mostly-solved ones little).

    Args:
        successes_TK: outcomes in ``[0, 1]`` (bool, 0/1, or a partial score). Shape: ``(T, K)`` tensor / array,
            or a ragged list of ``T`` non-empty lists.
        low: exclusive lower bound on p̂; default 0.
        high: inclusive upper bound on p̂; default 0.5.

    Returns:
        :class:`DifficultyFilterResult`.
    """
    for name, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    if not low < high:
        raise ValueError(f"low must be < high={high}, got {low}")
    rows = _rows(successes_TK, "successes_TK")
    rate = np.zeros(len(rows), dtype=np.float64)
    for t, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"successes_TK[{t}] is empty: every task needs at least one rollout")
        if not (np.isfinite(row).all() and (row >= 0).all() and (row <= 1).all()):
            raise ValueError(f"successes_TK[{t}] must hold values in [0, 1], got {row.tolist()}")
        rate[t] = row.mean()
    keep = (rate > low) & (rate <= high)
    kept = np.flatnonzero(keep).astype(np.int64)
    return DifficultyFilterResult(keep, kept, rate, int(kept.size), int(len(rows) - kept.size))
