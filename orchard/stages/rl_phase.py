"""A recipe's RL phase, once: the task filter on the RL pool, then `rl_stage` on the tasks it kept.

::

    kept      = filter_tasks(filter harnesses, pool candidates)     # 0 < p̂ <= 0.5 for the starting policy
    history   = rl_stage(harnesses, kept)                          # skipped when no task was kept
    generated = the filter's rollouts + every rollout the RL stage generated (BAR's discards included)
    summary   = variant-free facts: tasks, steps, BAR's positive ratio per group (`bar_groups`), a judge's counts

Each of the two plays in its own warm sandbox pool when the run's sandboxes are given (`PooledSandboxes.stage`,
sized to the episodes it has in flight at once). ``generated`` is what a value model can learn from
(`value_rerank_stage`'s pool).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchard.data import Trajectory
from orchard.rollout.rollouts import JudgedRolloutsBase, Rollouts
from orchard.stages.config import RLConfig, RolloutConfig, TaskFilterConfig
from orchard.stages.ranks import ranks_from_env
from orchard.stages.report import RunLog
from orchard.stages.rl import bar_groups, rl_stage
from orchard.stages.sandboxes import PooledSandboxes
from orchard.stages.task_filter import filter_tasks
from orchard.stages.value_rerank import RecordedRollouts

__all__ = ["RLPhaseResult", "rl_phase"]


@dataclass(frozen=True)
class RLPhaseResult:
    """What `rl_phase` did."""

    history: list[dict[str, float]]
    """The RL stage's per-step stats (empty when the filter kept no task)."""
    generated: list[Trajectory]
    """Every rollout the phase played, scored or not: the filter's, then the RL stage's (none when not kept)."""
    summary: dict[str, Any]
    """``tasks`` (kept), ``steps``; after a stage that ran, ``tasks_per_step`` (as shrunk to the kept tasks),
    ``bar_groups`` (`bar_groups`' rows, [] without BAR) and, when a harness is judged, ``judge`` (the judges'
    ``totals`` summed over harnesses)."""


def _pool(sandboxes: PooledSandboxes | None, episodes: int) -> contextlib.AbstractAsyncContextManager[Any]:
    return sandboxes.stage(episodes) if sandboxes is not None else contextlib.nullcontext()


async def rl_phase(model: Any, engine: Any, harnesses: Mapping[str, Rollouts], tasks: Sequence[Any], cfg: RLConfig,
                   *, rollout: RolloutConfig, pad_id: int, seed: int, output_dir: str | Path, log: RunLog,
                   task_filter: TaskFilterConfig | None = None, filter_harnesses: Mapping[str, Rollouts] | None = None,
                   teacher: Any = None, step_stats: Callable[[list[Trajectory]], dict[str, float]] | None = None,
                   sandboxes: PooledSandboxes | None = None, keep_generated: bool = True,
                   set_phase: Callable[[str], None] | None = None) -> RLPhaseResult:
    """The task filter, then ``cfg``'s RL stage on the kept tasks.

    Args:
        model, engine, cfg, rollout, pad_id, seed, teacher: as `rl_stage` takes them. A filter that keeps fewer
            tasks than a step draws shrinks ``cfg.tasks_per_step`` rather than failing.
        harnesses: the rollouts RL trains through (a judge's wrappers, where the variant judges).
        tasks: the RL pool.
        output_dir: the RL stage's folder (its trainer's logs and checkpoints).
        log: the run's log: the filter's stats at step 0 and each RL step's, with a console line each.
        task_filter: the filter; None or ``enabled: false``: RL on every task of ``tasks``.
        filter_harnesses: the rollouts the filter plays (default ``harnesses``): a judge need not grade them.
        step_stats: more stats for each step's row, from the rollouts that step generated (a judge's curves).
        sandboxes: the run's sandboxes, for a warm pool per part; None: the harnesses create their own.
        keep_generated: False: ``generated`` stays empty and each RL step's rollouts are let go once its row is
            logged, so a recipe that learns nothing from them does not hold a whole stage's rollouts in memory.
        set_phase: told the name of each part as it starts, ``"task_filter"`` (when the filter runs) then ``"rl"``:
            a recipe's ``run.phase``, so that the episodes each part plays are saved apart.
    """
    played = dict(filter_harnesses if filter_harnesses is not None else harnesses)
    generated: list[Trajectory] = []
    f = task_filter
    if f is not None and f.enabled:
        if set_phase is not None:
            set_phase("task_filter")
        candidates = f.candidates_of(list(tasks), seed)
        async with _pool(sandboxes, len(candidates) * math.ceil(f.attempts / len(played))):
            kept = await filter_tasks(played, engine, candidates, attempts=f.attempts, low=f.low, high=f.high,
                                      temperature=rollout.temperature, seed=seed)
        log.log(kept.stats, 0)
        log.print(f"task filter: kept {len(kept.tasks)}/{kept.stats['filter/candidates']:.0f} ({f.low} < p̂ <= "
                  f"{f.high} over {f.attempts} rollouts), success {kept.stats['filter/success']:.3f}")
        tasks, generated = kept.tasks, list(kept.trajectories) if keep_generated else []
    summary: dict[str, Any] = {"tasks": len(tasks), "steps": 0}
    history: list[dict[str, float]] = []
    if tasks:
        if set_phase is not None:
            set_phase("rl")
        rl_cfg = replace(cfg, tasks_per_step=min(cfg.tasks_per_step, len(tasks)))
        calls: list[list[Trajectory]] = []  # the generation calls since the last step's row
        # rl_stage hands a step's row to rank 0 alone: another rank records only the rollouts it is to keep
        recording = keep_generated or ranks_from_env().is_main
        played_rl = {h: RecordedRollouts(r, calls) for h, r in harnesses.items()} if recording else dict(harnesses)
        bar_rows: list[dict[str, Any]] = []

        def on_step(stats: dict[str, float], step: int) -> None:
            step_trajs = [t for c in calls for t in c]
            if rl_cfg.use_bar:
                bar_rows.extend({**row, "step": step} for row in bar_groups([calls]))
            if keep_generated:
                generated.extend(step_trajs)
            calls.clear()
            log.log({**stats, **(step_stats(step_trajs) if step_stats is not None else {})}, step)
            log.print(f"rl step {step}: success {stats['rl/success_generated']:.2f} groups "
                      f"{stats['rl/groups_with_signal']:.0f}/{stats['rl/groups']:.0f} "
                      f"env_errors {stats['rl/env_errors']:.0f}")

        # a step plays tasks_per_step groups at once; under BAR each draws a stride at a time
        group = rl_cfg.bar_stride if rl_cfg.use_bar else rl_cfg.group_size
        async with _pool(sandboxes, rl_cfg.tasks_per_step * group):
            history = await rl_stage(model, engine, played_rl, tasks, rl_cfg, rollout=rollout, pad_id=pad_id,
                                     seed=seed, output_dir=str(output_dir), log=on_step, teacher=teacher)
        if keep_generated:  # calls after the last step's row, if any
            generated += [t for c in calls for t in c]
        summary.update(steps=len(history), tasks_per_step=rl_cfg.tasks_per_step, bar_groups=bar_rows)
        judges = [h for h in harnesses.values() if isinstance(h, JudgedRolloutsBase)]
        if judges:  # the judges' counts over the whole stage
            summary["judge"] = {k: sum(j.totals.get(k, 0.0) for j in judges)
                                for k in dict.fromkeys(k for j in judges for k in j.counted)}
    else:
        log.print("rl: skipped, no task of useful difficulty for the policy")
    return RLPhaseResult(history, generated, summary)
