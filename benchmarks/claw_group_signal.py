"""Which Claw RL groups carry a signal? For a saved policy: per template, how many groups of ``--group-size``
rollouts of one train-split task have rewards that differ, under the outcome reward (+1 all checks / -1) and under
the score reward (partial credit), with the success rate and mean score of the rollouts.

A group whose trained rewards are all equal gives GRPO nothing to learn from (dynamic sampling drops it); the
members counted are those the RL stage trains on (`orchard.data.RolloutGroup`: scored, no environment failure,
timeouts dropped as ``rl.drop_timeouts`` says), rewards as `orchard.stages.trajectory_reward` gives them. A policy that is
nearly deterministic per task (a low-temperature start) solves a task always or never, and its groups carry no
outcome signal even where its success rate is mid-range; this script shows that per template.

    python benchmarks/claw_group_signal.py --model <saved policy dir> [--per-template 3] [--group-size 8]

Tasks: ``--per-template`` of each template drawn (``--draw-seed``) from the RL pool the recipe would use
(``tasks.rl_pool_per_template``, default 200: train-split task seeds, never the held-out set), played through both
of the recipe's harnesses (react and text: one group per task and harness) at ``--temperature`` (default: the
config's ``rollout.temperature``), on the recipe's embedded sandbox service. Baseline: none; it counts, it does not time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a saved policy directory (the recipe's model.path)")
    parser.add_argument("--config", default=str(ROOT / "recipes/configs/claw_tiny.yaml"))
    parser.add_argument("--per-template", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--pool-per-template", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=None, help="default: the config's rollout.temperature")
    parser.add_argument("--draw-seed", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0, help="the recipe's seed (sampling)")
    args = parser.parse_args(argv)
    for name in ("per_template", "group_size", "pool_per_template"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.per_template > args.pool_per_template:
        parser.error("--per-template must be <= --pool-per-template")
    if args.temperature is not None and not args.temperature > 0:
        parser.error("--temperature must be > 0")
    asyncio.run(count(args))
    return 0


async def count(args: argparse.Namespace) -> None:
    import claw as recipe
    from _seeds import machine

    from orchard.data import RolloutGroup
    from orchard.domains.claw.corpus import tokenizer_corpus
    from orchard.env import AsyncSandboxClient
    from orchard.stages import trajectory_reward
    from orchard.train.config import load_config

    cfg = load_config(recipe.ClawConfig, args.config,
                      [f"model.path={args.model}", f"tasks.rl_pool_per_template={args.pool_per_template}",
                       f"seed={args.seed}"], derived=recipe.DERIVED)
    train, pool, _ = recipe.task_pools(cfg)
    model, tokenizer = recipe.load_policy(cfg.model, tokenizer_corpus(train), seed=cfg.seed)
    engine = recipe.make_engine(cfg.model, model, tokenizer, seed=cfg.seed)
    temperature = cfg.rollout.temperature if args.temperature is None else args.temperature
    by_template = defaultdict(list)
    for task in pool:
        by_template[task.template].append(task)
    rng = random.Random(args.draw_seed)
    tasks = [t for name in sorted(by_template) for t in rng.sample(by_template[name], args.per_template)]
    n = args.group_size
    rows: dict[str, Counter] = defaultdict(Counter)
    with recipe.sandbox_service(None) as env:
        async with AsyncSandboxClient(*env) as client:
            harnesses = recipe.claw_harnesses(cfg, tokenizer, client)
            for name in ("react", "text"):
                trajs = await harnesses[name](engine, tasks, group_size=n, temperature=temperature)
                for j, task in enumerate(tasks):
                    group = RolloutGroup(task.id, tuple(trajs[j * n:(j + 1) * n]),
                                         drop_timeouts=cfg.rl.drop_timeouts)
                    trained = group.trained
                    row = rows[task.template]
                    row["groups"] += 1
                    for kind in ("outcome", "score"):
                        row[f"{kind}_signal"] += len({trajectory_reward(t, kind) for t in trained}) > 1
                    row["episodes"] += len(trained)
                    row["passed"] += sum(t.reward_components.get("passed", 0.0) for t in trained)
                    row["score"] += sum(t.reward_components.get("score", 0.0) for t in trained)
    await engine.close()
    print(machine())
    print(f"model {args.model}, {args.per_template} tasks per template x 2 harnesses, groups of {n}, "
          f"temperature {temperature}; success and mean score over the trained members")
    print("| template | groups | outcome signal | score signal | success | mean score |")
    print("|---|---:|---:|---:|---:|---:|")
    total: Counter = Counter()
    for name in sorted(rows):
        total.update(rows[name])
        print(_row(name, rows[name]))
    print(_row("all", total))


def _row(name: str, row: Counter) -> str:
    episodes = max(row["episodes"], 1)
    return (f"| {name} | {row['groups']} | {row['outcome_signal']} | {row['score_signal']} | "
            f"{row['passed'] / episodes:.2f} | {row['score'] / episodes:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
