"""The SFT stage: a teacher's episodes through the same harnesses the policy uses, then supervised training.

The teacher is any `orchard.rollout.Engine` (a scripted solver, a served larger model). Its episodes go through the
same `Rollouts` as the policy's, so the demonstrations are rendered by exactly the code paths the policy's own
rollouts take; only episodes with a positive reward (the domain's RL outcome: every check passed) are kept, as the
paper keeps the teacher's successes. Inputs are masked: only the assistant's tokens are supervised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from orchard.data import RenderedSample, collate
from orchard.rollout.rollouts import Rollouts
from orchard.stages.config import SFTConfig
from orchard.train.trainer import Trainer

__all__ = ["demonstrations", "sft_stage"]


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


def sft_stage(model: Any, samples: Sequence[RenderedSample], cfg: SFTConfig, *, pad_id: int, seed: int,
              output_dir: str) -> list[dict[str, float]]:
    """Train ``model`` in place on ``samples`` for ``cfg.epochs`` passes; returns the per-step metrics.

    ``total_steps = max(1, round(epochs x len(samples) / global_batch_size))``.
    """
    if not isinstance(cfg, SFTConfig):
        raise ValueError(f"cfg must be an SFTConfig, got {type(cfg).__name__}")
    if not samples:
        raise ValueError("samples is empty: the teacher solved no task (check the sandbox service and the harnesses)")
    steps = max(1, round(cfg.epochs * len(samples) / cfg.train.global_batch_size))
    trainer = Trainer(model, replace(cfg.train, total_steps=steps, seed=seed, output_dir=output_dir, resume=False))
    try:
        return trainer.fit(list(samples), partial(collate, pad_id=pad_id))
    finally:
        trainer.close()
