"""The RL stage: groups of rollouts -> BAR / dynamic sampling / remove_sample -> advantages -> steps -> weights.

One step (the paper's GRPO, Orchard-Claw and Orchard-SWE)::

    tasks      = tasks_per_step tasks drawn from the pool, assigned round-robin to the harnesses
    groups     = group_size rollouts per task (or BAR: up to bar_n_max, keep group_size balanced ones)
    per group: members that train (valid, with samples, not timed out, not removed); filter (all_equal drops
               groups whose trained rewards are all equal); advantages = group_advantages over trained members
    batch      = every sample of every trained member, weighted by its rollout's advantage
    ppo_epochs x mini_batches optimizer steps on the batch (clipped ratio against the sampling log-probs)
    engine.update_weights(new weights)   # once per rollout batch, after its last update

A `kl` objective term anchors the policy to the model RL started from (a frozen copy made here).
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from orchard.data import RenderedSample, RolloutGroup, Trajectory, collate
from orchard.rollout.rollouts import Rollouts
from orchard.sampling import GROUP_FILTER_RULES, abar_select, filter_groups, group_advantages
from orchard.stages.config import RLConfig, RolloutConfig
from orchard.stages.ranks import (
    all_gather_concat,
    all_reduce_sum,
    barrier,
    init_ranks,
    ranks_from_env,
    shard_range,
)
from orchard.train.action_logprobs import action_logprobs
from orchard.train.trainer import Trainer

__all__ = ["group_batch", "rl_stage", "rollout_groups", "trajectory_reward"]


def trajectory_reward(traj: Trajectory, kind: str = "outcome") -> float:
    """The RL reward of a scored trajectory: its ``reward`` ("outcome"), or 2 x its ``score`` component - 1
    ("score"; the outcome where the verifier gave no score)."""
    if kind not in ("outcome", "score"):
        raise ValueError(f"kind must be 'outcome' or 'score', got {kind!r}")
    if traj.reward is None:
        raise ValueError(f"traj has no reward (termination {traj.termination_reason!r}): it cannot train")
    if kind == "score" and "score" in traj.reward_components:
        return 2.0 * traj.reward_components["score"] - 1.0
    return traj.reward


def group_batch(groups: Sequence[RolloutGroup], *, reward: str = "outcome", group_filter: str = "all_equal",
                ) -> tuple[list[RenderedSample], list[float], dict[str, float]]:
    """Samples of the groups' trained members, each with its rollout's group-relative advantage.

    A group keeps at least two trained members, and passes the dynamic-sampling rule ``group_filter`` (a name in
    `orchard.sampling.GROUP_FILTER_RULES`, over its trained members' rewards: ``all_equal`` drops groups without
    GRPO signal), or every such group with ``"none"``. Returns ``(samples, advantages, stats)`` with
    ``rl/groups``, ``rl/groups_with_signal`` (groups that trained) and ``rl/sequences``.
    """
    if group_filter != "none" and group_filter not in GROUP_FILTER_RULES:
        raise ValueError(f"group_filter must be one of {[*GROUP_FILTER_RULES.names(), 'none']}, got {group_filter!r}")
    samples: list[RenderedSample] = []
    advantages: list[float] = []
    kept = 0
    for group in groups:
        mask_N = group.mask_N
        rewards_N = np.array([trajectory_reward(t, reward) if m else np.nan
                              for t, m in zip(group.trajectories, mask_N, strict=True)])  # [N]
        trained = rewards_N[mask_N]
        if trained.size < 2 or (group_filter != "none" and not filter_groups([trained], rule=group_filter).keep[0]):
            continue
        kept += 1
        adv_N = group_advantages(rewards_N[None], mask_GN=mask_N[None])[0]  # [N], 0 where masked
        for traj, adv, m in zip(group.trajectories, adv_N.tolist(), mask_N, strict=True):
            if m:
                samples += traj.samples
                advantages += [adv] * len(traj.samples)
    stats = {"rl/groups": float(len(groups)), "rl/groups_with_signal": float(kept),
             "rl/sequences": float(len(samples))}
    return samples, advantages, stats


async def rollout_groups(harnesses: Mapping[str, Rollouts], engine: Any, tasks: Sequence[Any],
                         harness_of: Sequence[str], cfg: RLConfig, rollout: RolloutConfig,
                         ) -> tuple[list[RolloutGroup], list[Trajectory]]:
    """One group per task (task ``i`` through harness ``harness_of[i]``); BAR-selected when ``cfg.use_bar``.

    Returns the groups (a BAR group that was dropped is empty) and every trajectory generated (BAR's whole pool
    and discards, so success over what was generated can be reported next to success over what trains).
    """
    if len(harness_of) != len(tasks):
        raise ValueError(f"harness_of must name one harness per task, got {len(harness_of)} for {len(tasks)}")
    ids = [str(getattr(t, "id", i)) for i, t in enumerate(tasks)]
    if not cfg.use_bar:
        groups: list[RolloutGroup | None] = [None] * len(tasks)
        generated: list[Trajectory] = []
        for name, rollouts in harnesses.items():
            mine = [i for i, h in enumerate(harness_of) if h == name]
            if not mine:
                continue
            trajs = await rollouts(engine, [tasks[i] for i in mine], group_size=cfg.group_size,
                                   temperature=rollout.temperature)
            generated += trajs
            for j, i in enumerate(mine):
                members = trajs[j * cfg.group_size:(j + 1) * cfg.group_size]
                groups[i] = RolloutGroup(ids[i], tuple(members), drop_timeouts=cfg.drop_timeouts)
        return [g for g in groups if g is not None], generated

    bar = cfg.bar_config()

    async def select(i: int) -> tuple[RolloutGroup, list[Trajectory]]:
        async def source(k: int) -> list[Trajectory]:
            return await harnesses[harness_of[i]](engine, [tasks[i]], group_size=k, temperature=rollout.temperature)

        result = await abar_select(source, bar)
        return (RolloutGroup(ids[i], tuple(result.selected), drop_timeouts=cfg.drop_timeouts),
                [*result.pool, *result.discarded])

    selected = await asyncio.gather(*(select(i) for i in range(len(tasks))))
    return [g for g, _ in selected], [t for _, pool in selected for t in pool]


def _rollout_counts(groups: Sequence[RolloutGroup], generated: Sequence[Trajectory]) -> dict[str, float]:
    """What `_rollout_stats` divides, as sums, so ranks can add theirs up before dividing."""
    trained = [t for g in groups for t in g.trajectories if t.valid]
    valid = [t for t in generated if t.valid]
    return {
        "valid_generated": float(len(valid)), "passed_generated": float(sum(t.passed for t in valid)),
        "valid_trained": float(len(trained)), "passed_trained": float(sum(t.passed for t in trained)),
        "rl/episodes": float(len(generated)),
        "rl/env_errors": float(sum(t.is_env_error for t in generated)),
        "rl/format_errors": float(sum(t.termination_reason == "format_error" for t in generated)),
        "rl/timeouts": float(sum(t.termination_reason == "time_budget" for t in generated)),
    }


def _rollout_stats(counts: Mapping[str, float]) -> dict[str, float]:
    stats = {k: v for k, v in counts.items() if k.startswith("rl/")}
    # success over every scored episode generated, and over the episodes the groups kept (differs under BAR)
    stats["rl/success_generated"] = counts["passed_generated"] / counts["valid_generated"] \
        if counts["valid_generated"] else 0.0
    stats["rl/success"] = counts["passed_trained"] / counts["valid_trained"] if counts["valid_trained"] else 0.0
    return stats


def _unzip(pairs: Sequence[tuple[RenderedSample, float]]) -> tuple[list[RenderedSample], list[float]]:
    return [s for s, _ in pairs], [a for _, a in pairs]


async def rl_stage(model: Any, engine: Any, harnesses: Mapping[str, Rollouts], tasks: Sequence[Any],
                   cfg: RLConfig, *, rollout: RolloutConfig, pad_id: int, seed: int, output_dir: str,
                   log: Callable[[dict[str, float], int], None] | None = None) -> list[dict[str, float]]:
    """``cfg.steps`` GRPO steps of ``model`` (trained in place) with rollouts of ``engine`` (updated after each).

    Tasks are drawn without replacement per step (``cfg.tasks_per_step`` of ``tasks``) with a generator seeded by
    ``seed`` and dealt round-robin to ``harnesses``. Returns each step's stats (also passed to ``log(stats,
    step)``, on rank 0 only).

    Under a launcher (``WORLD_SIZE`` > 1; ``cfg.train.engine`` must be ``deepspeed``) every rank draws the same
    tasks and plays its block of them (`orchard.stages.ranks.shard_range`) with its own ``engine``; rewards,
    group filter and advantages are computed where the group lives, then the trained samples and the counts are
    gathered in task order, so every optimizer step sees the single-process batch (module docstring of
    `orchard.stages.ranks`). After each rollout batch every rank passes the full weights to its ``engine`` and
    waits for the others: an `EnginePool` over served replicas shared by the ranks pushes from rank 0 only
    (``push_weights=ranks.is_main``), and no rank generates before the push is done.
    """
    if not isinstance(cfg, RLConfig):
        raise ValueError(f"cfg must be an RLConfig, got {type(cfg).__name__}")
    if not harnesses:
        raise ValueError("harnesses must name at least one Rollouts, got none")
    if cfg.tasks_per_step > len(tasks):
        raise ValueError(f"tasks_per_step ({cfg.tasks_per_step}) must be <= the task pool ({len(tasks)} tasks)")
    world = ranks_from_env().world_size
    if world > 1 and cfg.train.engine != "deepspeed":
        raise ValueError(f"cfg.train.engine must be 'deepspeed' under {world} ranks (plain torch trains one "
                         f"process), got {cfg.train.engine!r}")
    ranks = init_ranks()
    updates = cfg.steps * cfg.ppo_epochs * cfg.mini_batches
    trainer = Trainer(model, replace(cfg.train, total_steps=updates, seed=seed, output_dir=output_dir, resume=False))
    reference = None
    if any(term.name == "kl" for term in cfg.train.objective):
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    rng = random.Random(seed)
    names = list(harnesses)
    history = []
    try:
        for step in range(1, cfg.steps + 1):
            step_tasks = rng.sample(list(tasks), cfg.tasks_per_step)
            harness_of = [names[i % len(names)] for i in range(len(step_tasks))]
            mine = shard_range(len(step_tasks), ranks.rank, ranks.world_size)
            groups, generated = await rollout_groups(harnesses, engine, [step_tasks[i] for i in mine],
                                                     [harness_of[i] for i in mine], cfg, rollout)
            samples, advantages, batch_stats = group_batch(groups, reward=cfg.reward, group_filter=cfg.group_filter)
            counts = {**_rollout_counts(groups, generated), **batch_stats}
            if ranks.world_size > 1:
                samples, advantages = _unzip(all_gather_concat(list(zip(samples, advantages, strict=True))))
                counts = all_reduce_sum(counts)
            stats = _rollout_stats(counts)
            if samples:
                # PPO-style reuse of one rollout batch: ppo_epochs passes over shuffled mini-batches, the clipped
                # ratio against the sampling log-probs keeping each update near the rollout policy.
                for _ in range(cfg.ppo_epochs):
                    order = rng.sample(range(len(samples)), len(samples))
                    for part in np.array_split(np.array(order), min(cfg.mini_batches, len(order))):
                        batch = collate([samples[i] for i in part], pad_id,
                                        advantages=[advantages[i] for i in part])
                        if reference is not None:
                            with torch.no_grad():
                                batch["ref_logprobs"] = action_logprobs(
                                    reference, batch["input_ids"], batch["action_mask"],
                                    attention_mask=batch["attention_mask"])
                        stats.update(trainer.train_step(batch))
                await engine.update_weights(trainer.full_state_dict())
                barrier()
            history.append(stats)
            if log is not None and ranks.is_main:
                log(stats, step)
    finally:
        trainer.close()
    return history
