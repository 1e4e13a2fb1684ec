"""The task filter stage: initial rollouts of the policy on every candidate task, keep those of useful difficulty.

The Orchard paper (Orchard-SWE RL) plays 8 initial rollouts per candidate task with the SFT policy and keeps a task
when its estimated success rate is ``0 < p̂ <= 0.5``: never-solved tasks give GRPO no signal, mostly-solved ones
little. The rule is `orchard.sampling.difficulty_filter`; this stage plays the rollouts that feed it::

    per task p:   attempts rollouts, spread over the harnesses (the first ones take the remainder)
    p̂_p         = passed / scored   over the task's scored rollouts (environment failures are not outcomes)
    keep p       iff low < p̂_p <= high;   a task none of whose rollouts was scored is dropped ("unscored")

Spreading a task's attempts over the harnesses measures the policy the RL stage trains, which deals each task to
any of them. Reading "8 initial rollouts" as 8 per task in all (not 8 per harness) is our interpretation.

Under a launcher (several ranks) each rank plays its block of the tasks (`orchard.stages.ranks.shard_range`) and
the per-task counts are gathered, so every rank keeps the same tasks, as the RL stage that follows requires.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchard.data import Trajectory
from orchard.rollout.engine import derive_seed
from orchard.rollout.rollouts import Rollouts
from orchard.sampling import difficulty_filter
from orchard.stages.ranks import all_gather_concat, all_reduce_sum, init_ranks, shard_range

__all__ = ["TaskFilterResult", "filter_tasks", "split_attempts"]


@dataclass(frozen=True)
class TaskFilterResult:
    """What `filter_tasks` kept, with the evidence."""

    tasks: list[Any]
    """The kept tasks, in candidate order."""
    pass_rate: np.ndarray
    """Float64 ``[P]``: p̂ of every candidate task (NaN where none of its rollouts was scored)."""
    stats: dict[str, float]
    """``filter/candidates``, ``filter/kept``, ``filter/too_hard`` (p̂ <= low), ``filter/too_easy`` (p̂ > high),
    ``filter/unscored``, ``filter/episodes``, ``filter/env_errors``, ``filter/success`` (over scored episodes)."""
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)
    """Every rollout this rank played, task-major within each harness (all of them on one process)."""


def split_attempts(attempts: int, names: Sequence[str]) -> dict[str, int]:
    """``attempts`` rollouts spread over harnesses ``names`` as evenly as possible, the first ones taking the rest.

    ``split_attempts(8, ["bash", "tool"]) == {"bash": 4, "tool": 4}``; 3 over two gives ``{"bash": 2, "tool": 1}``;
    a harness left with 0 plays nothing.
    """
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
    if not names:
        raise ValueError("names must name at least one harness, got none")
    base, extra = divmod(attempts, len(names))
    return {name: base + (i < extra) for i, name in enumerate(names)}


async def filter_tasks(harnesses: Mapping[str, Rollouts], engine: Any, tasks: Sequence[Any], *,
                       attempts: int = 8, low: float = 0.0, high: float = 0.5,
                       temperature: float = 1.0, seed: int | None = None) -> TaskFilterResult:
    """Play ``attempts`` rollouts of ``engine`` per task and keep the tasks with ``low < p̂ <= high``.

    Args:
        harnesses: the harnesses the policy is trained through; a task's attempts are spread over them
            (`split_attempts`).
        engine: the policy's engine (the SFT model in the paper).
        tasks: the candidate tasks, ``P`` of them.
        attempts: rollouts per task, >= 1 (the paper: 8).
        low: exclusive lower bound on p̂ (the paper: 0).
        high: inclusive upper bound on p̂ (the paper: 0.5).
        temperature: sampling temperature of the rollouts.
        seed: seeds the rollouts through harness ``h`` with ``derive_seed(seed, h)`` (each episode by its task and
            attempt, `orchard.rollout.Rollouts`), so the rates do not depend on how many ranks played them. Default
            None: sampling is left to the engines.

    Returns:
        `TaskFilterResult`. Success is the evaluation's pass rule (``Trajectory.passed``); a rollout whose sandbox
        failed is counted in ``filter/env_errors`` and is not an outcome.
    """
    if not harnesses:
        raise ValueError("harnesses must name at least one Rollouts, got none")
    per_harness = split_attempts(attempts, list(harnesses))
    difficulty_filter([[0.0]], low=low, high=high)  # checks the bounds before any rollout is spent
    tasks = list(tasks)
    ranks = init_ranks()
    mine = [tasks[i] for i in shard_range(len(tasks), ranks.rank, ranks.world_size)]
    passed_L = np.zeros(len(mine))
    scored_L = np.zeros(len(mine))
    played: list[Trajectory] = []
    for name, k in per_harness.items():
        if k == 0 or not mine:
            continue
        trajs = await harnesses[name](engine, mine, group_size=k, temperature=temperature,
                                      seed=None if seed is None else derive_seed(seed, name))
        if len(trajs) != k * len(mine):
            raise ValueError(f"harnesses[{name!r}] returned {len(trajs)} rollouts for {len(mine)} tasks x {k}")
        played += trajs
        for p in range(len(mine)):
            group = [t for t in trajs[p * k:(p + 1) * k] if t.valid]
            scored_L[p] += len(group)
            passed_L[p] += sum(t.passed for t in group)
    # the blocks in rank order are the tasks in order: the gathered counts line up with ``tasks``
    counts = np.array(all_gather_concat(list(zip(passed_L.tolist(), scored_L.tolist(), strict=True))),
                      dtype=np.float64).reshape(len(tasks), 2)
    passed_P, scored_P = counts[:, 0], counts[:, 1]
    totals = all_reduce_sum({"episodes": len(played), "env_errors": sum(t.is_env_error for t in played)})
    scored = scored_P > 0
    rate_P = np.full(len(tasks), np.nan)
    rate_P[scored] = passed_P[scored] / scored_P[scored]
    kept_idx: list[int] = []
    if scored.any():
        rows = [[1.0] * int(passed_P[p]) + [0.0] * int(scored_P[p] - passed_P[p]) for p in np.flatnonzero(scored)]
        verdict = difficulty_filter(rows, low=low, high=high)
        kept_idx = np.flatnonzero(scored)[verdict.kept_indices].tolist()
    rated = rate_P[scored]
    stats = {
        "filter/candidates": float(len(tasks)),
        "filter/kept": float(len(kept_idx)),
        "filter/too_hard": float((rated <= low).sum()),
        "filter/too_easy": float((rated > high).sum()),
        "filter/unscored": float((~scored).sum()),
        "filter/episodes": totals["episodes"],
        "filter/env_errors": totals["env_errors"],
        "filter/success": float(passed_P.sum() / scored_P.sum()) if scored_P.sum() else 0.0,
    }
    return TaskFilterResult([tasks[p] for p in kept_idx], rate_P, stats, played)
