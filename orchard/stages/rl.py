"""The RL stage: groups of rollouts -> BAR / dynamic sampling / remove_sample -> advantages -> steps -> weights.

One step (the paper's GRPO, Orchard-Claw and Orchard-SWE)::

    tasks      = tasks_per_step tasks drawn from the pool, assigned round-robin to the harnesses
    groups     = group_size rollouts per task (or BAR: up to bar_n_max, keep group_size balanced ones)
    per group: members that train (valid, with samples, not timed out, not removed); filter (all_equal drops
               groups whose trained rewards are all equal); advantages = group_advantages over trained members
    batch      = every sample of every trained member, weighted by its rollout's advantage
    ppo_epochs x mini_batches optimizer steps on the batch (clipped ratio against the sampling log-probs)
    engine.update_weights(new weights)   # once per rollout batch, after its last update

A `kl` objective term anchors the policy to the model RL started from (a frozen copy made here). An OPD term
(``k2_opd`` / ``k3_opd`` / ``js_opd``) reads a separate ``teacher``'s log-probs on the student's sampled tokens
(`orchard.stages.distill.teacher_logprobs`, scored once per rollout batch). With ``async_rollouts`` the next
step's rollouts are generated while a step trains (one step off-policy, stale samples IS-corrected:
`_off_policy`); ``checkpoint_every`` / ``resume`` save and continue the stage between rollout steps.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orchard.data import RenderedSample, RolloutGroup, Trajectory, collate
from orchard.rollout.engine import derive_seed
from orchard.rollout.harness import task_id
from orchard.rollout.rollouts import Rollouts
from orchard.sampling import GROUP_FILTER_RULES, abar_select, filter_groups, group_advantages
from orchard.stages.config import RLConfig, RolloutConfig
from orchard.stages.distill import check_teacher, teacher_logprobs
from orchard.stages.ranks import (
    Ranks,
    all_gather_concat,
    all_reduce_sum,
    barrier,
    init_ranks,
    ranks_from_env,
    shard_range,
)
from orchard.train import checkpoint as ckpt
from orchard.train.action_logprobs import VISION_KEYS, action_logprobs
from orchard.train.progress import StepProgress
from orchard.train.trainer import Trainer, forward_logprobs

__all__ = ["bar_candidate", "bar_groups", "group_batch", "rl_stage", "rollout_groups", "trajectory_reward"]


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
                normalize_std: bool = True) -> tuple[list[RenderedSample], list[float], dict[str, float]]:
    """Samples of the groups' trained members, each with its rollout's group-relative advantage (GRPO's, divided
    by the group's std; with ``normalize_std=False`` Dr.GRPO's, the reward minus the group's mean).

    A group keeps at least two trained members, and passes the dynamic-sampling rule ``group_filter`` (a name in
    `orchard.sampling.GROUP_FILTER_RULES`, over its trained members' rewards: ``all_equal`` drops groups without
    GRPO signal), or every such group with ``"none"``. Returns ``(samples, advantages, stats)`` with
    ``rl/groups``, ``rl/groups_with_signal`` (groups that trained), ``rl/groups_with_spread`` (those of them whose
    trained rewards differ, so their advantages are not all 0: a group the filter keeps with equal rewards, as the
    GUI rule keeps an all −1 group or ``"none"`` any group, trains with zero advantages and moves nothing) and
    ``rl/sequences``.
    """
    if group_filter != "none" and group_filter not in GROUP_FILTER_RULES:
        raise ValueError(f"group_filter must be one of {[*GROUP_FILTER_RULES.names(), 'none']}, got {group_filter!r}")
    if not isinstance(normalize_std, bool):
        raise ValueError(f"normalize_std must be a bool, got {normalize_std!r}")
    samples: list[RenderedSample] = []
    advantages: list[float] = []
    kept = spread = 0
    for group in groups:
        mask_N = group.mask_N
        rewards_N = np.array([trajectory_reward(t, reward) if m else np.nan
                              for t, m in zip(group.trajectories, mask_N, strict=True)])  # [N]
        trained = rewards_N[mask_N]
        if trained.size < 2 or (group_filter != "none" and not filter_groups([trained], rule=group_filter).keep[0]):
            continue
        kept += 1
        spread += bool(np.ptp(trained) > 0)
        adv_N = group_advantages(rewards_N[None], mask_GN=mask_N[None], normalize_std=normalize_std)[0]  # [N]
        for traj, adv, m in zip(group.trajectories, adv_N.tolist(), mask_N, strict=True):
            if m:
                samples += traj.samples
                advantages += [adv] * len(traj.samples)
    stats = {"rl/groups": float(len(groups)), "rl/groups_with_signal": float(kept),
             "rl/groups_with_spread": float(spread), "rl/sequences": float(len(samples))}
    return samples, advantages, stats


def bar_candidate(traj: Trajectory, *, drop_timeouts: bool = True) -> bool:
    """Whether BAR may choose ``traj`` to fill its group: it is valid (scored, no environment failure), not removed
    from the loss (``metadata["removed"]``: remove_sample, a judge that failed or could not be parsed), and not a
    timeout the group would drop (``drop_timeouts``).

    Our reading of the paper: BAR (Algorithm 1) balances the set of rollouts that *train*, so a rollout that will
    leave the loss is no candidate. Were it one, BAR could pick it as one of the ``n`` and the group would then
    train on fewer than ``n`` members, off the balanced band. Judging therefore happens before selection (inside
    the harness's call), and such a rollout still spends BAR's budget and is reported among the generated ones.
    """
    if not traj.valid or traj.metadata.get("removed"):
        return False
    return not (drop_timeouts and traj.termination_reason == "time_budget")


async def rollout_groups(harnesses: Mapping[str, Rollouts], engine: Any, tasks: Sequence[Any],
                         harness_of: Sequence[str], cfg: RLConfig, rollout: RolloutConfig,
                         seed: int | None = None) -> tuple[list[RolloutGroup], list[Trajectory]]:
    """One group per task (task ``i`` through harness ``harness_of[i]``); BAR-selected when ``cfg.use_bar``.

    BAR chooses among `bar_candidate` rollouts only (not removed by a judge, not a dropped timeout), so a kept
    group trains on ``group_size`` members. Returns the groups (a BAR group that was dropped is empty) and every
    trajectory generated (BAR's whole pool and discards, so success over what was generated can be reported next
    to success over what trains). Under BAR each member of a group's pool (its candidates) carries BAR's reading
    and choice in ``metadata["bar"]``: ``{"positive": bool, "kept": bool}`` (kept: in the group), so a report of
    the choice reads it rather than choosing again; a rollout that was no candidate has no such key.

    ``seed`` seeds every episode by its task and place in the group (`orchard.rollout.Rollouts`); BAR's ``c``-th
    draw for a task plays with ``derive_seed(seed, "bar", c)``. So a step split into blocks of tasks (ranks)
    samples the episodes one process would. None leaves sampling to the engines.
    """
    if len(harness_of) != len(tasks):
        raise ValueError(f"harness_of must name one harness per task, got {len(harness_of)} for {len(tasks)}")
    ids = [task_id(t, default=str(i)) for i, t in enumerate(tasks)]
    if not cfg.use_bar:
        groups: list[RolloutGroup | None] = [None] * len(tasks)
        generated: list[Trajectory] = []
        for name, rollouts in harnesses.items():
            mine = [i for i, h in enumerate(harness_of) if h == name]
            if not mine:
                continue
            trajs = await rollouts(engine, [tasks[i] for i in mine], group_size=cfg.group_size,
                                   temperature=rollout.temperature, seed=seed)
            generated += trajs
            for j, i in enumerate(mine):
                members = trajs[j * cfg.group_size:(j + 1) * cfg.group_size]
                groups[i] = RolloutGroup(ids[i], tuple(members), drop_timeouts=cfg.drop_timeouts)
        return [g for g in groups if g is not None], generated

    bar = cfg.bar_config()

    async def select(i: int) -> tuple[RolloutGroup, list[Trajectory]]:
        draws = 0

        async def source(k: int) -> list[Trajectory]:
            nonlocal draws
            draw_seed = None if seed is None else derive_seed(seed, "bar", draws)
            draws += 1
            return await harnesses[harness_of[i]](engine, [tasks[i]], group_size=k, temperature=rollout.temperature,
                                                  seed=draw_seed)

        result = await abar_select(source, bar, valid=lambda t: bar_candidate(t, drop_timeouts=cfg.drop_timeouts))
        chosen = set(result.selected_indices)
        for j, (traj, won) in enumerate(zip(result.pool, result.pool_positive, strict=True)):
            traj.metadata["bar"] = {"positive": won, "kept": j in chosen}  # reported as chosen, never re-chosen
        return (RolloutGroup(ids[i], tuple(result.selected), drop_timeouts=cfg.drop_timeouts),
                [*result.pool, *result.discarded])

    selected = await asyncio.gather(*(select(i) for i in range(len(tasks))))
    return [g for g, _ in selected], [t for _, pool in selected for t in pool]


def bar_groups(calls_per_step: Sequence[Sequence[Sequence[Trajectory]]]) -> list[dict[str, Any]]:
    """BAR's positive ratio per group and step, read from the choice `rollout_groups` made (each candidate's
    ``metadata["bar"]``), never made again here, so the report and the groups that trained agree whatever the
    stride.

    Args:
        calls_per_step: per RL step, the generation calls it made (each a list of trajectories; what
            `orchard.stages.RecordedRollouts` keeps). A step draws each task once, so its rollouts of one task
            are one group, spread over as many calls as BAR drew strides.

    Returns:
        One row per group, in step order: ``step`` (1-based), ``pool_positive_ratio`` (over BAR's candidates:
        judge-removed rollouts, dropped timeouts and sandbox failures are not; None when there was no candidate)
        and ``kept_positive_ratio`` (over the group_size it kept; None when the group was dropped).
    """
    rows = []
    for step, calls in enumerate(calls_per_step, 1):
        groups: dict[str, list[dict[str, bool]]] = {}
        for traj in (t for call in calls for t in call):
            groups.setdefault(traj.task_id, [])
            if "bar" in traj.metadata:
                groups[traj.task_id].append(traj.metadata["bar"])
        for pool in groups.values():
            kept = [c["positive"] for c in pool if c["kept"]]
            rows.append({"step": step,
                         "pool_positive_ratio": sum(c["positive"] for c in pool) / len(pool) if pool else None,
                         "kept_positive_ratio": sum(kept) / len(kept) if kept else None})
    return rows


REMOVAL_REASONS = {"judge_failure": "rl/judge_failures", "judge_unparseable": "rl/judge_unparseable",
                   "captcha_blocked": "rl/captcha_blocked"}
"""The ``metadata["removed"]`` values the domains' judges set -> the step stat that counts them (the names the
judges' own stats use)."""


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
        # remove_sample: episodes a judge could not score (or a blocked site) leave the loss, counted by reason
        "rl/removed": float(sum(bool(t.metadata.get("removed")) for t in generated)),
        **{key: float(sum(t.metadata.get("removed") == reason for t in generated))
           for reason, key in REMOVAL_REASONS.items()},
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


Local = tuple[list[RenderedSample], list[float], dict[str, float]]
"""One rank's share of a rollout batch: its groups' trained samples, their advantages, and the rollout counts."""


async def _play(harnesses: Mapping[str, Rollouts], engine: Any, step_tasks: Sequence[Any], harness_of: list[str],
                cfg: RLConfig, rollout: RolloutConfig, ranks: Ranks, version: int, seed: int) -> Local:
    """This rank's block of one step's tasks, played (seeded ``seed``) and turned into samples stamped with
    ``version``."""
    mine = shard_range(len(step_tasks), ranks.rank, ranks.world_size)
    groups, generated = await rollout_groups(harnesses, engine, [step_tasks[i] for i in mine],
                                             [harness_of[i] for i in mine], cfg, rollout, seed)
    samples, advantages, batch_stats = group_batch(groups, reward=cfg.reward, group_filter=cfg.group_filter,
                                                   normalize_std=cfg.normalize_std)
    samples = [replace(s, policy_version=version) for s in samples]
    return samples, advantages, {**_rollout_counts(groups, generated), **batch_stats}


def _gather(local: Local, ranks: Ranks) -> tuple[list[RenderedSample], list[float], dict[str, float]]:
    samples, advantages, counts = local
    if ranks.world_size > 1:
        samples, advantages = _unzip(all_gather_concat(list(zip(samples, advantages, strict=True))))
        counts = all_reduce_sum(counts)
    return samples, advantages, _rollout_stats(counts)


def _current_logprobs(trainer: Trainer, samples: Sequence[RenderedSample], pad_id: int) -> list[torch.Tensor]:
    """The trained policy's log-probs of each sample's sampled tokens (0 elsewhere), ``[T]`` each, computed
    ``micro_batch_size`` rows at a time through the engine's forward (ZeRO-3 gathers its parameters there), so
    every rank runs the same forwards."""
    out = []
    mb = trainer.cfg.micro_batch_size
    device = next(trainer.engine.module.parameters()).device
    with torch.no_grad():
        for lo in range(0, len(samples), mb):
            part = samples[lo:lo + mb]
            batch = {k: v.to(device) for k, v in collate(part, pad_id).items()}
            batch["scored_mask"] = batch["logprob_mask"]
            logp_BT = trainer.logprob_fn(trainer.engine.forward_model(), batch).float().cpu()  # [b, T]
            out += [torch.where(s.logprob_mask, logp_BT[i, :len(s)], 0.0) for i, s in enumerate(part)]
    return out


def _off_policy(trainer: Trainer, samples: list[RenderedSample], version: int, pad_id: int,
                ) -> tuple[list[RenderedSample], list[RenderedSample] | None, dict[str, float]]:
    """Samples ready for the policy term, the samples whose ``old_logprobs`` are the sampling log-probs (the
    batch's ``rollout_logprobs``; None when no sample is stale), and staleness stats.

    A sample of an older policy version than the trained one (``version``) is stale. Its ratio is anchored at the
    current policy (``old_logprobs`` := log pi_version, recomputed), and the policy term weights it by the
    truncated (or masked) importance weight pi_version / pi_sampling. This is our reading of "one step
    off-policy with the importance correction" (the decoupled PPO objective of AReaL, Fu et al. 2025): the clip
    keeps each update near the current policy, not near the older one that sampled.
    """
    stale = [i for i, s in enumerate(samples) if s.policy_version is not None and s.policy_version < version]
    lags = [version - s.policy_version for s in samples if s.policy_version is not None]
    stats = {"rl/stale_sequences": float(len(stale)), "rl/policy_lag": float(np.mean(lags)) if lags else 0.0}
    if not stale:
        return samples, None, stats
    fresh = list(samples)
    for i, logp in zip(stale, _current_logprobs(trainer, [samples[i] for i in stale], pad_id), strict=True):
        fresh[i] = replace(samples[i], old_logprobs=logp)
    return fresh, samples, stats


def _train_batch(trainer: Trainer, reference: Any, samples: list[RenderedSample], advantages: list[float],
                 cfg: RLConfig, rng: random.Random, pad_id: int, version: int, teacher_BT: torch.Tensor | None,
                 temperature: float) -> dict[str, float]:
    """``ppo_epochs`` x ``mini_batches`` optimizer steps on one gathered rollout batch (``teacher_BT``: the OPD
    teacher's log-probs of its samples, row per sample; ``temperature``: the rollouts', at which the reference
    scores them too); returns the last one's stats with the batch's staleness stats."""
    samples, sampled, stats = _off_policy(trainer, samples, version, pad_id)
    # PPO-style reuse of one rollout batch: ppo_epochs passes over shuffled mini-batches, the clipped ratio against
    # the sampling log-probs keeping each update near the rollout policy.
    for _ in range(cfg.ppo_epochs):
        order = rng.sample(range(len(samples)), len(samples))
        for part in np.array_split(np.array(order), min(cfg.mini_batches, len(order))):
            batch = collate([samples[i] for i in part], pad_id, advantages=[advantages[i] for i in part])
            if sampled is not None:
                batch["rollout_logprobs"] = collate([sampled[i] for i in part], pad_id)["old_logprobs"]
            if reference is not None:
                with torch.no_grad():
                    batch["ref_logprobs"] = action_logprobs(
                        reference, batch["input_ids"], batch["action_mask"],
                        attention_mask=batch["attention_mask"], temperature=temperature,
                        **{k: batch[k] for k in VISION_KEYS if k in batch})  # a VLM's reference sees the images
            if teacher_BT is not None:  # collate pads to the mini-batch's longest sample
                width = batch["input_ids"].shape[1]
                batch["teacher_logprobs"] = teacher_BT[torch.as_tensor(part), :width]
            stats.update(trainer.train_step(batch))
    return stats


def _state_of(step: int, version: int, rng: random.Random, history: list[dict[str, float]], asynchronous: bool,
              ) -> dict[str, Any]:
    """The stage's part of a checkpoint (JSON: ``trainer_state.json``'s ``extra``)."""
    rng_version, rng_words, gauss = rng.getstate()
    return {"step": step, "version": version, "rng": [rng_version, list(rng_words), gauss], "history": history,
            "async_rollouts": asynchronous}


def _pending_path(trainer: Trainer, rank: int) -> Path:
    return ckpt.step_dir(trainer.ckpt_dir, trainer.step) / f"rl_pending_rank{rank}.pt"


async def rl_stage(model: Any, engine: Any, harnesses: Mapping[str, Rollouts], tasks: Sequence[Any],
                   cfg: RLConfig, *, rollout: RolloutConfig, pad_id: int, seed: int, output_dir: str,
                   log: Callable[[dict[str, float], int], None] | None = None,
                   teacher: Any = None) -> list[dict[str, float]]:
    """``cfg.steps`` GRPO steps of ``model`` (trained in place) with rollouts of ``engine`` (updated after each).

    Tasks are drawn without replacement per step (``cfg.tasks_per_step`` of ``tasks``) with a generator seeded by
    ``seed`` and dealt round-robin to ``harnesses``; step ``k``'s episodes sample with seeds derived from
    ``derive_seed(seed, "rl-step", k)`` (`rollout_groups`). Returns each step's stats (also passed to ``log(stats,
    step)``, on rank 0 only).

    Under a launcher (``WORLD_SIZE`` > 1; ``cfg.train.engine`` must be ``deepspeed``) every rank draws the same
    tasks and plays its block of them (`orchard.stages.ranks.shard_range`) with its own ``engine``; rewards,
    group filter and advantages are computed where the group lives, then the trained samples and the counts are
    gathered in task order, so every optimizer step sees the single-process batch (module docstring of
    `orchard.stages.ranks`). After each rollout batch every rank passes the full weights to its ``engine`` and
    waits for the others: an `EnginePool` over served replicas shared by the ranks pushes from rank 0 only
    (``push_weights=ranks.is_main``), and no rank generates before the push is done.

    Log-probs: the trained policy's (the ratio, a stale sample's anchor, and any other objective term such as an
    OPD term's student side) and the ``kl`` reference's are those of ``softmax(logits / rollout.temperature)``,
    the distribution the engine sampled from (temperature 0: untempered), so a rollout temperature other than 1
    starts each batch at ratio 1. That holds for engines that return the tempered distribution's log-probs with
    top_p = 1: `HFEngine`, ``orchard serve-model``, `VLLMEngine`, and a ``vllm serve`` started with
    ``--logprobs-mode processed_logprobs``; a vLLM server in its default mode returns the raw model's log-probs,
    which are right only at temperature 1. An OPD teacher still scores at temperature 1.

    ``teacher``: a scoring engine (`orchard.rollout.engine.Scorer`, never ``engine`` itself) whose log-probs on
    each rollout batch fill ``batch["teacher_logprobs"]``; required exactly when ``cfg.train.objective`` has an
    OPD term (`orchard.stages.distill.check_teacher`). The paper's best SWE variant is ``policy`` + ``js_opd``.

    Policy versions: version ``v`` is the policy after ``v`` weight pushes of this stage (0: the model passed
    in); every sample carries the version that sampled it (``RenderedSample.policy_version``). Synchronous, step
    k trains on rollouts of the version it starts from. With ``cfg.async_rollouts`` step k+1's rollouts are
    generated (on the event loop, with the engine's weights of step k's start) while step k trains (in a worker
    thread), and the push waits for both: step k >= 2 trains on rollouts one version older than the policy it
    updates, corrected as `_off_policy` says, and no request is served while the engine's weights change.

    Checkpoints (``cfg.checkpoint_every`` rollout steps) hold the trainer's state, the stage's (step, version,
    task generator, history) and, asynchronous, each rank's rollouts of the next step; ``cfg.resume`` continues
    from the latest one after pushing its weights to the engine. Resumed, a run with deterministic rollouts ends
    with the parameters of an uninterrupted one; the reference of a ``kl`` term is still copied from ``model``,
    so pass the model RL started from.
    """
    if not isinstance(cfg, RLConfig):
        raise ValueError(f"cfg must be an RLConfig, got {type(cfg).__name__}")
    if not harnesses:
        raise ValueError("harnesses must name at least one Rollouts, got none")
    if cfg.tasks_per_step > len(tasks):
        raise ValueError(f"tasks_per_step ({cfg.tasks_per_step}) must be <= the task pool ({len(tasks)} tasks)")
    check_teacher(teacher, engine, cfg.train.objective)
    world = ranks_from_env().world_size
    if world > 1 and cfg.train.engine != "deepspeed":
        raise ValueError(f"cfg.train.engine must be 'deepspeed' under {world} ranks (plain torch trains one "
                         f"process), got {cfg.train.engine!r}")
    ranks = init_ranks()
    updates = cfg.steps * cfg.ppo_epochs * cfg.mini_batches
    reference = None
    if any(term.name == "kl" for term in cfg.train.objective):
        reference = copy.deepcopy(model).eval().requires_grad_(False)  # before a resume loads trained weights
    # The engines return log-probs of the tempered distribution they sample from; the trained policy and the
    # reference score the same tokens at the same temperature, so the ratio starts at 1 whatever the rollouts'
    # temperature (greedy rollouts, temperature 0, carry the untempered log-probs: scored at 1).
    temperature = float(rollout.temperature) if rollout.temperature > 0 else 1.0
    trainer = Trainer(model, replace(cfg.train, total_steps=updates, seed=seed, output_dir=output_dir,
                                     resume=cfg.resume, checkpoint_every=0),
                      logprob_fn=functools.partial(forward_logprobs, temperature=temperature))
    rng = random.Random(seed)
    names = list(harnesses)
    history: list[dict[str, float]] = []
    start, version = 1, 0
    pending: Local | None = None
    saved = trainer.extra_state.get("rl")
    if saved is not None:
        if saved["async_rollouts"] != cfg.async_rollouts:
            raise ValueError(f"cfg.async_rollouts must match the checkpoint's ({saved['async_rollouts']}) to "
                             f"resume, got {cfg.async_rollouts}")
        start, version, history = saved["step"] + 1, saved["version"], saved["history"]
        rng.setstate((saved["rng"][0], tuple(saved["rng"][1]), saved["rng"][2]))
        if cfg.async_rollouts and start <= cfg.steps:
            pending = torch.load(_pending_path(trainer, ranks.rank), weights_only=False)
        await engine.update_weights(trainer.full_state_dict())
        barrier()

    def step_seed(step: int) -> int:
        return derive_seed(seed, "rl-step", step)

    def draw() -> tuple[list[Any], list[str]]:
        step_tasks = rng.sample(list(tasks), cfg.tasks_per_step)
        return step_tasks, [names[i % len(names)] for i in range(len(step_tasks))]

    following: asyncio.Future[Local] | None = None
    # steps done / total, the last update's loss, trained tokens/s, ETA: redrawn on a terminal, a line per interval
    progress = StepProgress("rl", cfg.steps, start=start - 1, interval_s=cfg.train.progress_interval_s,
                            enabled=ranks.is_main)
    try:
        for step in range(start, cfg.steps + 1):
            if pending is None:
                pending = await _play(harnesses, engine, *draw(), cfg, rollout, ranks, version, step_seed(step))
            samples, advantages, stats = _gather(pending, ranks)
            teacher_BT = await teacher_logprobs(teacher, samples) if teacher is not None and samples else None
            pending = following = None
            if cfg.async_rollouts and step < cfg.steps:
                following = asyncio.ensure_future(_play(harnesses, engine, *draw(), cfg, rollout, ranks, version,
                                                        step_seed(step + 1)))
            if samples:
                train = (trainer, reference, samples, advantages, cfg, rng, pad_id, version, teacher_BT, temperature)
                stats.update(await asyncio.to_thread(_train_batch, *train) if following is not None
                             else _train_batch(*train))
            if following is not None:
                pending = await following
            if samples:
                await engine.update_weights(trainer.full_state_dict())
                version += 1
                barrier()
            history.append(stats)
            progress.update(step, stats)
            if log is not None and ranks.is_main:
                log(stats, step)
            if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
                trainer.extra_state["rl"] = _state_of(step, version, rng, history, cfg.async_rollouts)
                if pending is not None:
                    _pending_path(trainer, ranks.rank).parent.mkdir(parents=True, exist_ok=True)
                    torch.save(pending, _pending_path(trainer, ranks.rank))
                trainer.save_checkpoint()
    finally:
        if following is not None and not following.done():
            following.cancel()  # training failed: the next step's rollouts have no one to train on them
        progress.close()
        trainer.close()
    return history
