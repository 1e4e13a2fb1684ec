"""The historical pool a value model is trained on: past rollouts with a valid verification result.

``build_value_pool`` keeps trajectories whose verifier produced a result (a reward, and not an environment error:
a dead sandbox says nothing about the policy), caps how many come from one task, and balances successes and
failures so the value head does not learn the base rate alone.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable

from orchard.data import Trajectory

__all__ = ["build_value_pool", "is_success"]


def is_success(traj: Trajectory, threshold: float = 0.5) -> bool:
    """A verified trajectory succeeded when its reward exceeds ``threshold`` (rewards in {0, 1} or {−1, +1})."""
    if traj.reward is None:
        raise ValueError("traj has no reward (not verified)")
    return traj.reward > threshold


def build_value_pool(
    trajectories: Iterable[Trajectory],
    *,
    max_per_task: int = 8,
    balance: bool = True,
    success_threshold: float = 0.5,
    seed: int = 0,
) -> list[Trajectory]:
    """Select the value-training pool.

    1. Keep a trajectory iff ``reward is not None`` and ``termination_reason != "env_error"``.
    2. Per task, keep at most ``max_per_task``, alternating successes and failures (shuffled by ``seed``), so a
       task contributes both outcomes when it has both.
    3. With ``balance``, subsample the larger outcome class globally to the size of the smaller one (nothing is
       dropped when one class is empty: an all-failure pool still trains the head towards 0).

    Args:
        trajectories: past rollouts (``orchard.data.Trajectory``; ``task_id`` None counts as its own task).
        max_per_task: cap per task, >= 1; default 8.
        balance: equalise successes and failures globally; default True.
        success_threshold: reward above which a trajectory counts as a success; default 0.5.
        seed: seed of the random choices; the result is deterministic for a seed and input order.

    Returns:
        The kept trajectories, in input order.
    """
    if isinstance(max_per_task, bool) or not isinstance(max_per_task, int) or max_per_task < 1:
        raise ValueError(f"max_per_task must be an int >= 1, got {max_per_task!r}")
    items = list(trajectories)
    for i, t in enumerate(items):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(t).__name__}")
    rng = random.Random(seed)
    valid = [i for i, t in enumerate(items) if t.reward is not None and t.termination_reason != "env_error"]
    by_task: dict[object, dict[bool, list[int]]] = defaultdict(lambda: {True: [], False: []})
    for i in valid:
        t = items[i]
        by_task[t.task_id if t.task_id is not None else ("<none>", i)][
            is_success(t, success_threshold)
        ].append(i)
    kept: list[int] = []
    for task in by_task:
        wins, losses = by_task[task][True], by_task[task][False]
        rng.shuffle(wins)
        rng.shuffle(losses)
        order = [x for pair in zip(wins, losses, strict=False) for x in pair]
        longer = wins if len(wins) > len(losses) else losses
        order += longer[min(len(wins), len(losses)) :]
        kept.extend(order[:max_per_task])
    if balance:
        wins = [i for i in kept if is_success(items[i], success_threshold)]
        losses = [i for i in kept if not is_success(items[i], success_threshold)]
        if wins and losses:
            n = min(len(wins), len(losses))
            kept = rng.sample(wins, n) + rng.sample(losses, n)
    return [items[i] for i in sorted(kept)]
