"""The stages seed their rollouts so that ranks sample the episodes one process would: RL step k plays with
``derive_seed(seed, "rl-step", k)`` (synchronous or one step ahead), BAR's c-th draw for a task with
``derive_seed(step seed, "bar", c)``, every stage's evaluation with one seed, and a step split into blocks of
tasks passes each block the same seed (each episode is seeded by its task, `orchard.rollout.Rollouts`)."""

from __future__ import annotations

import asyncio

from test_rl_stage import CountingEngine, VersionRollouts
from train_helpers import make_model

from orchard.data import Trajectory
from orchard.rollout import derive_seed
from orchard.stages import EvalConfig, RecipeRun, RLConfig, RolloutConfig, evaluate, rl_stage, rollout_groups
from orchard.train.objective import LossTerm
from orchard.train.trainer import OptimConfig, TrainConfig


class SeedRollouts(VersionRollouts):
    """`VersionRollouts` that also keeps each call's (tasks, seed)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list, int | None]] = []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        self.calls.append((list(tasks), seed))
        return await super().__call__(engine, tasks, group_size=group_size, temperature=temperature)


def _rl(tmp_path, asynchronous: bool) -> SeedRollouts:
    rollouts = SeedRollouts()
    cfg = RLConfig(steps=3, tasks_per_step=2, group_size=3, async_rollouts=asynchronous,
                   train=TrainConfig(micro_batch_size=3, optim=OptimConfig(lr=1e-2, min_lr=1e-2),
                                     objective=[LossTerm("policy", 1.0, {})]))
    asyncio.run(rl_stage(make_model(seed=1), CountingEngine(), {"a": rollouts}, [0, 1, 2, 4], cfg,
                         rollout=RolloutConfig(), pad_id=0, seed=5, output_dir=str(tmp_path / "rl")))
    return rollouts


def test_rl_step_k_plays_with_its_own_seed_in_both_modes(tmp_path):
    expected = [derive_seed(5, "rl-step", k) for k in (1, 2, 3)]
    for asynchronous in (False, True):
        calls = _rl(tmp_path / str(asynchronous), asynchronous).calls
        assert [seed for _, seed in calls] == expected, asynchronous
        assert len(set(expected)) == 3


def _seeds_by_task(calls) -> dict:
    out: dict = {}
    for tasks, seed in calls:
        for t in tasks:
            out.setdefault(t, []).append(seed)
    return out


def test_a_step_split_into_blocks_passes_every_block_the_steps_seed():
    cfg = RLConfig(group_size=2)
    whole, first, second = SeedRollouts(), SeedRollouts(), SeedRollouts()
    engine = CountingEngine()
    asyncio.run(rollout_groups({"a": whole}, engine, [0, 1, 2, 4], ["a"] * 4, cfg, RolloutConfig(), seed=9))
    asyncio.run(rollout_groups({"a": first}, engine, [0, 1], ["a"] * 2, cfg, RolloutConfig(), seed=9))
    asyncio.run(rollout_groups({"a": second}, engine, [2, 4], ["a"] * 2, cfg, RolloutConfig(), seed=9))
    assert _seeds_by_task(whole.calls) == _seeds_by_task(first.calls + second.calls) == {t: [9] for t in (0, 1, 2, 4)}


class RareSuccess:
    """Member j of task t passes when derive_seed(seed, t, j) % 6 == 0 (rare: BAR must draw again)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, int | None]] = []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        self.calls.append((list(tasks), seed))
        return [Trajectory(reward=1.0 if derive_seed(seed, t, j) % 6 == 0 else -1.0, task_id=str(t))
                for t in tasks for j in range(group_size)]


def test_bar_draws_are_seeded_by_task_and_draw_alike_in_one_call_or_in_blocks():
    # BAR draws until its band is met or its budget is spent; each draw of a task gets the next
    # derive_seed(seed, "bar", c), however the tasks are blocked.
    cfg = RLConfig(group_size=2, use_bar=True, bar_stride=2, bar_n_max=12)
    whole, first, second = RareSuccess(), RareSuccess(), RareSuccess()
    engine = CountingEngine()
    asyncio.run(rollout_groups({"a": whole}, engine, [0, 1, 2], ["a"] * 3, cfg, RolloutConfig(), seed=9))
    asyncio.run(rollout_groups({"a": first}, engine, [0], ["a"], cfg, RolloutConfig(), seed=9))
    asyncio.run(rollout_groups({"a": second}, engine, [1, 2], ["a"] * 2, cfg, RolloutConfig(), seed=9))
    by_task = _seeds_by_task(whole.calls)
    assert by_task == _seeds_by_task(first.calls + second.calls)
    for draws in by_task.values():
        assert draws == [derive_seed(9, "bar", c) for c in range(len(draws))]
    assert any(len(draws) > 1 for draws in by_task.values())  # BAR drew more than once somewhere


def test_evaluate_passes_its_seed_to_every_harness():
    seen = []

    async def harness(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        seen.append(seed)
        return [Trajectory(reward=1.0, task_id=str(t)) for t in tasks for _ in range(group_size)]

    asyncio.run(evaluate({"x": harness, "y": harness}, None, ["a", "b"], attempts=2, temperature=1.0, seed=4))
    asyncio.run(evaluate({"x": harness}, None, ["a"], attempts=1, temperature=1.0))
    assert seen == [4, 4, None]



def test_every_stage_of_a_recipe_run_is_evaluated_on_the_same_seed(tmp_path):
    seen = []

    async def harness(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        seen.append(seed)
        return [Trajectory(reward=1.0, task_id=str(t)) for t in tasks for _ in range(group_size)]

    for seed in (3, 4):
        run = RecipeRun(tmp_path / str(seed), seed=seed, eval_cfg=EvalConfig(attempts=1, harnesses=["x"]))
        for stage in ("base", "sft", "rl"):
            asyncio.run(run.evaluate(stage, 0, {"x": harness}, None, ["a"]))
    # the stages compare on the same draws; another run seed draws others
    assert seen == [derive_seed(3, "eval")] * 3 + [derive_seed(4, "eval")] * 3
