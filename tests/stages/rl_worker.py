"""An RL stage the rank tests launch as child processes: plain (one process) or DeepSpeed under ``torchrun``.

Usage: ``python rl_worker.py OUT_DIR ENGINE [DIE_RANK] [--steps S] [--die-call C] [--async] [--resume]``. It runs
S (default 2) GRPO steps of ``rl_stage`` on the tiny model of ``tests/train/train_helpers`` with deterministic
rollouts (`FixedRollouts`: every member's sample and reward are a function of its task and index, whatever rank
plays it, and never of the engine's weights) and writes ``OUT_DIR/rank{r}.pt`` with the weights handed to the
engine after the last step, the step stats, which tasks each rank played, the rows of an evaluation of tasks
0-6 run after the RL stage and the task filter's verdict on tasks 0-6. With DIE_RANK=r, rank r SIGKILLs itself in its C-th (default 2nd) rollout call of
harness "a" (while it plays its tasks of step C; asynchronous, during step C-1's training); the others are left
waiting for it. The stage checkpoints after every step under ``OUT_DIR/train`` and, with ``--resume``, continues
from the latest checkpoint there; ``--async`` sets ``async_rollouts``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "train"))
torch.set_num_threads(1)

from train_helpers import VOCAB, make_model  # noqa: E402

from orchard.data import RenderedSample, RenderReport, Trajectory  # noqa: E402
from orchard.stages import RLConfig, RolloutConfig, evaluate, filter_tasks, rl_stage  # noqa: E402
from orchard.stages.ranks import init_ranks  # noqa: E402
from orchard.train.objective import LossTerm  # noqa: E402
from orchard.train.trainer import OptimConfig, TrainConfig  # noqa: E402

TIMEOUT_S = 60.0
"""The process group's collective timeout: the bound on how long a rank waits for a dead peer."""


class FixedRollouts:
    """Member ``j`` of task ``t``: 8 + (3t + j) mod 7 random tokens from seed 1000 t + j, the second half actions
    with sampling log-probs in [-4.9, -4.3] (near
    the tiny model's, log 1/97 = -4.57, so ratios fall inside the clip range); reward +1 when (t + j) mod 3 == 0 else -1, and -1 for every member of
    a task with t mod 4 == 3 (a flat group the ``all_equal`` filter drops)."""

    def __init__(self, die_call: int = 0) -> None:
        self.calls = 0
        self.die_call = die_call
        self.played: list[int] = []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        self.calls += 1
        if self.calls == self.die_call:
            os.kill(os.getpid(), signal.SIGKILL)
        out = []
        for t in tasks:
            self.played.append(t)
            for j in range(group_size):
                gen = torch.Generator().manual_seed(1000 * t + j)
                T = 8 + (3 * t + j) % 7
                ids = torch.randint(0, VOCAB, (T,), generator=gen)
                action = torch.arange(T) >= T // 2
                old = torch.where(action, -4.6 + 0.6 * torch.rand(T, generator=gen) - 0.3, torch.zeros(()))
                sample = RenderedSample(ids, action, torch.where(action, 0, -1), old, action.clone(), RenderReport())
                reward = -1.0 if t % 4 == 3 else (1.0 if (t + j) % 3 == 0 else -1.0)
                out.append(Trajectory(reward=reward, task_id=str(t), samples=[sample]))
        return out


class WeightsEngine:
    """Keeps the weights of the last update."""

    def __init__(self) -> None:
        self.last: dict[str, torch.Tensor] = {}

    async def update_weights(self, weights):
        self.last = weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("engine")
    parser.add_argument("die_rank", type=int, nargs="?", default=-1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--die-call", type=int, default=2)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    out = args.out
    ranks = init_ranks(timeout_s=TIMEOUT_S)
    cfg = RLConfig(steps=args.steps, tasks_per_step=5, group_size=3, mini_batches=2, async_rollouts=args.asynchronous,
                   checkpoint_every=1, resume=args.resume, train=TrainConfig(
        micro_batch_size=2, engine=args.engine, zero_stage=2,
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, eps=1e-6, grad_clip=0.5),
        objective=[LossTerm("policy", 1.0, {"eps_low": 0.2, "eps_high": 0.28})]))
    harnesses = {"a": FixedRollouts(die_call=args.die_call if ranks.rank == args.die_rank else 0),
                 "b": FixedRollouts()}
    engine = WeightsEngine()
    history = asyncio.run(rl_stage(make_model(seed=1), engine, harnesses, list(range(12)), cfg,
                                   rollout=RolloutConfig(), pad_id=0, seed=5, output_dir=str(out / "train")))
    rows = asyncio.run(evaluate(harnesses, engine, list(range(7)), attempts=3, temperature=1.0))
    kept = asyncio.run(filter_tasks(harnesses, engine, list(range(7)), attempts=6))
    torch.save({"weights": engine.last, "history": history, "eval": rows,
                "filter": {"tasks": kept.tasks, "pass_rate": kept.pass_rate.tolist(), "stats": kept.stats},
                "played": {name: h.played for name, h in harnesses.items()}}, out / f"rank{ranks.rank}.pt")


if __name__ == "__main__":
    main()
