"""The SFT stage: a teacher's episodes through the same harnesses the policy uses, then supervised training.

The teacher is any `orchard.rollout.Engine` (a scripted solver, a served larger model). Its episodes go through the
same `Rollouts` as the policy's, so the demonstrations are rendered by exactly the code paths the policy's own
rollouts take; only episodes with a positive reward (the domain's RL outcome: every check passed) are kept, as the
paper keeps the teacher's successes. Inputs are masked: only the assistant's tokens are supervised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from orchard.data import (
    RenderedSample,
    Trajectory,
    check_tool_calls,
    collate,
    sequence_length,
    truncate_sample,
)
from orchard.losses import credit_assigned_sft_mask, credit_runs, interpolate_step_values, td_credit
from orchard.rollout.rollouts import Rollouts
from orchard.stages.config import SFTConfig
from orchard.stages.ranks import ranks_from_env
from orchard.train.trainer import Trainer

__all__ = ["SFT_MODES", "curate_sft", "demonstrations", "sft_samples", "sft_stage", "sft_steps"]

SFT_MODES = ("resolved", "all", "credit")
"""What an SFT stage learns from a teacher's trajectories (`sft_samples`)."""


async def demonstrations(harnesses: Mapping[str, Rollouts], teacher: Any, tasks: Sequence[Any], *,
                         max_tokens: int = 4096) -> tuple[list[RenderedSample], dict[str, float]]:
    """One greedy teacher episode per task through each harness; the samples of those with reward > 0.

    Returns the samples and ``sft/teacher_<harness>_episodes`` / ``sft/teacher_<harness>_passed`` counts.
    """
    if not harnesses:
        raise ValueError("harnesses must name at least one Rollouts, got none")
    if not tasks:
        raise ValueError("tasks must hold at least one task, got none")
    samples: list[RenderedSample] = []
    stats: dict[str, float] = {}
    for name, rollouts in harnesses.items():
        trajectories = await rollouts(teacher, tasks, group_size=1, temperature=0.0, max_tokens=max_tokens)
        good = [t for t in trajectories if t.valid and t.reward is not None and t.reward > 0]
        samples += [s for t in good for s in t.samples]
        stats[f"sft/teacher_{name}_episodes"] = float(len(trajectories))
        stats[f"sft/teacher_{name}_passed"] = float(len(good))
    return samples, stats


def curate_sft(trajectories: Sequence[Trajectory], *, max_len: int | None = None,
               unparseable: Callable[[Trajectory], Sequence[Any]] | None = None,
               ) -> tuple[list[Trajectory], dict[str, float]]:
    """The Orchard paper's curation of SFT trajectories: drop those over the context limit and those with
    undefined, invalid or unparseable tool calls.

    - over length: the longest sequence the trajectory trains as (`orchard.data.sequence_length`: its longest
      recorded sample) has more than ``max_len`` tokens (None: no limit).
    - invalid calls: `orchard.data.check_tool_calls` against the trajectory's own ``tools`` finds an issue (a tool
      it does not define, arguments that do not validate against the schema, a call tag left unparsed in the
      text), or ``unparseable(traj)`` (a domain's own action format, e.g. the bash block of mini-swe-agent's
      convention) returns a non-empty list.

    Our reading of the paper, which both trains with a 64K context under left truncation and drops trajectories
    over the context limit in curation: curation drops, so with the same ``max_len`` nothing truncated reaches
    training; the SFT stage's left truncation (``SFTConfig.max_len``) is what applies when curation is off.
    A trajectory that fails both checks counts once, as over length. Environment failures and trajectories
    without samples pass through untouched and uncounted (`sft_samples` never trains them).

    Returns the kept trajectories in input order and ``sft/dropped_over_length``, ``sft/dropped_invalid_calls``.
    """
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    if unparseable is not None and not callable(unparseable):
        raise ValueError(f"unparseable must be callable or None, got {type(unparseable).__name__}")
    kept: list[Trajectory] = []
    stats = dict.fromkeys(("sft/dropped_over_length", "sft/dropped_invalid_calls"), 0.0)
    for i, traj in enumerate(trajectories):
        if not isinstance(traj, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(traj).__name__}")
        if traj.valid and traj.samples:
            if max_len is not None and sequence_length(traj) > max_len:
                stats["sft/dropped_over_length"] += 1
                continue
            if check_tool_calls(traj) or (unparseable is not None and unparseable(traj)):
                stats["sft/dropped_invalid_calls"] += 1
                continue
        kept.append(traj)
    return kept, stats


def sft_samples(trajectories: Sequence[Trajectory], *, mode: str = "resolved",
                step_values: Callable[[Trajectory], Mapping[int, float] | None] | None = None,
                eps: float = 0.05) -> tuple[list[RenderedSample], dict[str, float]]:
    """The training samples of a teacher's trajectories under an SFT mode (the Orchard paper's SWE SFT, Sec. 3).

    - ``resolved``: the samples of trajectories with reward > 0, every action token supervised.
    - ``all``: the samples of every valid trajectory, every action token supervised (failures as demonstrations).
    - ``credit`` (credit-assigned SFT): resolved trajectories whole; a failed one only on the action tokens of its
      credit runs: hindsight values ``step_values(traj)`` (``{state index: V}``, from a value teacher that knows
      the outcome) are interpolated over its steps, ``c_t = V(s_{t+1}) − V(s_t)``, and the runs with
      ``c_t ≥ eps`` (0.05) are kept (``orchard.losses``' pipeline). A failed trajectory whose values could not be
      had (``None``) or that has no run contributes nothing. Observations are never supervised.

    A credit-masked sample is the sample with its ``action_mask`` (and ``logprob_mask``) narrowed to the runs, so
    the plain ``sft`` objective trains it; the earlier history stays in the input as context. Environment failures
    never train. Returns the samples and counts: ``sft/resolved``, ``sft/failed``, ``sft/credit_trajectories``
    (failed ones that gave at least one run), ``sft/credit_steps``, ``sft/unvalued`` and ``sft/samples``.
    """
    if mode not in SFT_MODES:
        raise ValueError(f"mode must be one of {list(SFT_MODES)}, got {mode!r}")
    if mode == "credit" and step_values is None:
        raise ValueError("step_values must be given for mode='credit' (a hindsight value per key step)")
    samples: list[RenderedSample] = []
    stats = dict.fromkeys(("sft/resolved", "sft/failed", "sft/credit_trajectories", "sft/credit_steps",
                           "sft/unvalued"), 0.0)
    for i, traj in enumerate(trajectories):
        if not isinstance(traj, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(traj).__name__}")
        if not traj.valid or not traj.samples:
            continue
        resolved = traj.reward is not None and traj.reward > 0
        stats["sft/resolved" if resolved else "sft/failed"] += 1
        if resolved or mode == "all":
            samples += traj.samples
            continue
        if mode == "resolved":
            continue
        keyed = step_values(traj)  # type: ignore[misc]
        if not keyed:
            stats["sft/unvalued"] += 1
            continue
        runs = credit_runs(td_credit(interpolate_step_values(keyed, traj.num_steps)), eps=eps)
        if not runs:
            continue
        stats["sft/credit_trajectories"] += 1
        stats["sft/credit_steps"] += sum(end - start for start, end in runs)
        for sample in traj.samples:
            mask = credit_assigned_sft_mask(sample.action_mask, sample.turn_index, False, runs)
            if bool(mask.any()):
                samples.append(replace(sample, action_mask=mask, logprob_mask=sample.logprob_mask & mask))
    stats["sft/samples"] = float(len(samples))
    return samples, stats


def sft_steps(cfg: SFTConfig, samples: int) -> int:
    """The optimizer steps `sft_stage` takes on ``samples`` samples: ``max(1, round(epochs x samples /
    global_batch_size))`` (Python's round: a half goes to the even neighbour). A recipe that sets a schedule by a
    share of the steps (a warm-up fraction) reads them here."""
    if not isinstance(cfg, SFTConfig):
        raise ValueError(f"cfg must be an SFTConfig, got {type(cfg).__name__}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError(f"samples must be an int >= 0, got {samples!r}")
    return max(1, round(cfg.epochs * samples / cfg.train.global_batch_size))


def sft_stage(model: Any, samples: Sequence[RenderedSample], cfg: SFTConfig, *, pad_id: int, seed: int,
              output_dir: str) -> list[dict[str, float]]:
    """Train ``model`` in place on ``samples`` for ``cfg.epochs`` passes; returns the per-step metrics.

    ``total_steps = max(1, round(epochs x len(samples) / global_batch_size))`` (`sft_steps`). With ``cfg.max_len`` a
    longer sample is left-truncated first (`orchard.data.truncate_sample`: its prompt, then its newest tokens).
    """
    if not isinstance(cfg, SFTConfig):
        raise ValueError(f"cfg must be an SFTConfig, got {type(cfg).__name__}")
    if not samples:
        raise ValueError("samples is empty: the teacher solved no task (check the sandbox service and the harnesses)")
    world = ranks_from_env().world_size
    if world > 1 and cfg.train.engine != "deepspeed":
        raise ValueError(f"cfg.train.engine must be 'deepspeed' under {world} ranks (plain torch trains one "
                         f"process, and every rank would write its logs), got {cfg.train.engine!r}")
    if cfg.max_len is not None:
        samples = [truncate_sample(s, cfg.max_len) for s in samples]
    trainer = Trainer(model, replace(cfg.train, total_steps=sft_steps(cfg, len(samples)), seed=seed,
                                     output_dir=output_dir, resume=False))
    try:
        return trainer.fit(list(samples), partial(collate, pad_id=pad_id))
    finally:
        trainer.close()
