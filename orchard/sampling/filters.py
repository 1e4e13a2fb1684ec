"""Group and task filters: dynamic sampling (DAPO) and difficulty filtering before RL.

Dynamic sampling drops the groups that would teach nothing. Which groups those are is a named rule in
``GROUP_FILTER_RULES``; a rule is ``fn(rewards_N, eps) -> bool`` (True: keep the group) over one group's
rewards ``[N]`` (``N ≥ 2``: smaller groups are dropped before any rule is asked).

| rule                        | drops a group when                          | from                            |
|-----------------------------|---------------------------------------------|---------------------------------|
| ``all_equal`` (default)     | ``max − min ≤ eps``: every reward the same  | DAPO (Yu et al. 2025)           |
| ``all_zero_or_all_positive``| every ``|r| ≤ eps`` or every ``r > eps``     | the Orchard paper's GUI recipe  |

Under ``all_zero_or_all_positive`` a group of ``−1`` rewards (every rollout failed its format) is *kept*: our
reading of the paper, which names only the all-zero and all-positive groups as dropped. The mixed groups
``{0, −1}`` and ``{+1, 0}`` are kept by both rules; a group such as ``{0.5, 1}`` is kept by ``all_equal`` and
dropped by the GUI rule (every rollout got some reward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from orchard._registry import Registry

GroupRule = Callable[[np.ndarray, float], bool]
"""A dynamic-sampling rule: ``fn(rewards_N float64 [N], eps) -> keep``."""

GROUP_FILTER_RULES: Registry[GroupRule] = Registry("group filter rule")
"""Named dynamic-sampling rules for ``filter_groups(rule=...)``; add one with ``GROUP_FILTER_RULES.register``."""


def _not_all_equal(rewards_N: np.ndarray, eps: float) -> bool:
    return float(rewards_N.max() - rewards_N.min()) > eps


def _not_all_zero_nor_all_positive(rewards_N: np.ndarray, eps: float) -> bool:
    all_zero = bool((np.abs(rewards_N) <= eps).all())
    all_positive = bool((rewards_N > eps).all())
    return not (all_zero or all_positive)


GROUP_FILTER_RULES.register("all_equal", _not_all_equal)
GROUP_FILTER_RULES.register("all_zero_or_all_positive", _not_all_zero_nor_all_positive)


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


def filter_groups(rewards_GN: object, *, rule: str = "all_equal", eps: float = 0.0) -> GroupFilterResult:
    """Dynamic sampling: drop the groups that ``rule`` names (rules in the module docstring).

    The default ``rule="all_equal"`` is DAPO's (Yu et al. 2025): a group is kept when
    ``max_i r_gi - min_i r_gi > eps``; with ``eps = 0`` (default) that is "not all equal". The GUI recipe of the
    Orchard paper uses ``rule="all_zero_or_all_positive"``. Under every rule, groups with fewer than two members
    carry no group-relative signal and are dropped.

    Args:
        rewards_GN: rewards. Shape: ``(G, N)`` tensor / array, or a ragged list of ``G`` lists.
        rule: one of ``GROUP_FILTER_RULES.names()``; default ``"all_equal"``.
        eps: tolerance; ``all_equal``: the spread at or below which a group counts as flat;
            ``all_zero_or_all_positive``: ``|r| ≤ eps`` counts as zero and ``r > eps`` as positive. Default 0.

    Returns:
        :class:`GroupFilterResult` (an empty input keeps nothing and drops nothing).
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    keeps = GROUP_FILTER_RULES.get(rule, "rule")
    rows = _rows(rewards_GN, "rewards_GN")
    keep = np.zeros(len(rows), dtype=bool)
    for g, row in enumerate(rows):
        if not np.isfinite(row).all():
            raise ValueError(f"rewards_GN[{g}] must be finite, got {row.tolist()}")
        keep[g] = row.size >= 2 and keeps(row, float(eps))
    kept = np.flatnonzero(keep).astype(np.int64)
    return GroupFilterResult(keep, kept, int(kept.size), int(len(rows) - kept.size))


@dataclass(frozen=True)
class DifficultyFilterResult:
    """Which tasks survived :func:`difficulty_filter`."""

    keep: np.ndarray
    """Bool ``[P]``: True where the task is kept."""
    kept_indices: np.ndarray
    """Int64 indices of kept tasks, ascending."""
    pass_rate: np.ndarray
    """Float64 ``[P]``: estimated success rate p̂ of each task."""
    num_kept: int
    num_dropped: int


def difficulty_filter(successes_PK: object, *, low: float = 0.0, high: float = 0.5) -> DifficultyFilterResult:
    """Keep tasks of useful difficulty from ``k`` initial rollouts each: ``low < p̂ <= high``.

    ``p̂_p = mean_k s_pk``. The defaults keep ``0 < p̂ <= 0.5``: tasks the policy solves sometimes but at most half
    of the time (never-solved tasks give no signal; mostly-solved ones little).

    Args:
        successes_PK: outcomes in ``[0, 1]`` (bool, 0/1, or a partial score). Shape: ``(P, K)`` tensor / array,
            or a ragged list of ``P`` non-empty lists.
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
    rows = _rows(successes_PK, "successes_PK")
    rate = np.zeros(len(rows), dtype=np.float64)
    for p, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"successes_PK[{p}] is empty: every task needs at least one rollout")
        if not (np.isfinite(row).all() and (row >= 0).all() and (row <= 1).all()):
            raise ValueError(f"successes_PK[{p}] must hold values in [0, 1], got {row.tolist()}")
        rate[p] = row.mean()
    keep = (rate > low) & (rate <= high)
    kept = np.flatnonzero(keep).astype(np.int64)
    return DifficultyFilterResult(keep, kept, rate, int(kept.size), int(len(rows) - kept.size))
