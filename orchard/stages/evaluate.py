"""Evaluation: success, pass@k and pass^k of a policy on held-out tasks, per harness.

``k = attempts`` episodes per task. Environment failures are counted (``env_errors``) and never scored; a task
counts only when all its ``k`` attempts were scored (a task with an environment failure would otherwise bias
pass@k), and ``tasks`` says how many did. Success is each trajectory's evaluation pass rule (`Trajectory.passed`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from orchard.data import Trajectory
from orchard.rollout.rollouts import Rollouts
from orchard.sampling import avg_at_k, pass_at_k, pass_hat_k
from orchard.stages.config import EvalConfig
from orchard.stages.ranks import all_gather_concat, init_ranks, shard_range
from orchard.stages.report import RunLog, format_table
from orchard.train.progress import format_duration

__all__ = ["evaluate", "evaluate_stage", "format_table", "success_row"]


def success_row(trajectories: Sequence[Trajectory], attempts: int) -> dict[str, float]:
    """One stage and harness: ``success`` (avg@k), ``pass@k``, ``pass^k``, ``tasks`` (fully scored), ``env_errors``.

    Trajectories are grouped by ``task_id``; zero fully scored tasks give 0.0 rates.
    """
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
    by_task: dict[str | None, list[bool]] = {}
    env_errors = 0
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(t).__name__}")
        if not t.valid:
            env_errors += 1
            continue
        by_task.setdefault(t.task_id, []).append(t.passed)
    full = [v for v in by_task.values() if len(v) == attempts]
    n = np.full(len(full), attempts)
    c = np.array([sum(v) for v in full])
    return {
        "success": avg_at_k(full) if full else 0.0,
        f"pass@{attempts}": float(np.mean(pass_at_k(n, c, attempts))) if full else 0.0,
        f"pass^{attempts}": float(np.mean(pass_hat_k(n, c, attempts))) if full else 0.0,
        "tasks": len(full),
        "env_errors": env_errors,
    }


async def evaluate(harnesses: Mapping[str, Rollouts], engine: Any, tasks: Sequence[Any], *, attempts: int,
                   temperature: float, seed: int | None = None) -> dict[str, dict[str, float]]:
    """``attempts`` episodes of every task through each harness; one `success_row` per harness name.

    Under a launcher (several ranks) each rank plays its block of ``tasks`` (`orchard.stages.ranks.shard_range`)
    with its own ``engine``; the trajectories (without their training samples) are gathered, so every rank
    returns the same rows, those of one process playing every task. ``seed`` seeds every episode by its task and
    attempt (`orchard.rollout.Rollouts`), so those rows are the very episodes one process would play; None leaves
    sampling to the engines.
    """
    if not harnesses:
        raise ValueError("harnesses must name at least one Rollouts, got none")
    if not tasks:
        raise ValueError("tasks must hold at least one task, got none")
    ranks = init_ranks()
    mine = [tasks[i] for i in shard_range(len(tasks), ranks.rank, ranks.world_size)]
    rows = {}
    for name, rollouts in harnesses.items():
        trajectories = (await rollouts(engine, mine, group_size=attempts, temperature=temperature, seed=seed)
                        if mine else [])
        rows[name] = success_row(all_gather_concat([replace(t, samples=[]) for t in trajectories]), attempts)
    return rows


async def evaluate_stage(stage: str, step: int, harnesses: Mapping[str, Rollouts], engine: Any,
                         tasks: Sequence[Any], cfg: EvalConfig, log: RunLog, *,
                         seed: int | None = None) -> dict[str, dict[str, float]]:
    """`evaluate` (seeded ``seed``) on the harnesses ``cfg.harnesses`` names, each row logged as
    ``eval/<stage>/<harness>/<key>`` at ``step`` and printed: what a recipe does after each stage."""
    missing = [h for h in cfg.harnesses if h not in harnesses]
    if missing:
        raise ValueError(f"cfg.harnesses names harnesses the recipe does not have: {missing}")
    episodes = len(tasks) * cfg.attempts * len(cfg.harnesses)
    running = asyncio.ensure_future(evaluate({h: harnesses[h] for h in cfg.harnesses}, engine, tasks,
                                             attempts=cfg.attempts, temperature=cfg.temperature, seed=seed))
    started = time.monotonic()
    while not running.done():
        # a run that evaluates for many minutes says so once per interval, rather than nothing at all
        await asyncio.wait([running], timeout=cfg.progress_interval_s)
        if not running.done():
            log.print(f"eval {stage}: {episodes} episodes through {', '.join(cfg.harnesses)}, running for "
                      f"{format_duration(time.monotonic() - started)}")
    rows = running.result()
    for harness, row in rows.items():
        log.log({f"eval/{stage}/{harness}/{k}": float(v) for k, v in row.items()}, step)
        log.print(f"eval {stage:4s} {harness:5s} " + " ".join(f"{k}={v:.3f}" for k, v in row.items()))
    return rows
