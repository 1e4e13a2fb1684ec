"""JudgedRolloutsBase: one wrapper of a Rollouts that judges every batch, for every domain's judge."""

import asyncio

import pytest

from orchard.data import Trajectory
from orchard.rollout import Rollouts
from orchard.rollout.rollouts import JudgedRolloutsBase

URL = "http://judge:8000/v1"


class Played:
    """Two rollouts per task, rewards as the verifier gave them; remembers the call it got."""

    def __init__(self):
        self.calls = []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        self.calls.append((engine, list(tasks), group_size, temperature, max_tokens))
        return [Trajectory(messages=[], task_id=t, reward=r) for t in tasks for r in (1.0, 0.0)]


class Halving(JudgedRolloutsBase):
    """A judge that halves every reward and removes the zero-reward rollouts from the loss."""

    counted = ("rl/judged", "rl/judge_failures")

    async def judge_batch(self, trajectories, tasks):
        for traj in trajectories:
            if traj.reward == 0.0:
                traj.metadata["removed"] = "judge_failure"
            else:
                traj.reward *= self.kwargs["scale"]
        removed = sum(1 for t in trajectories if t.metadata.get("removed"))
        return {"rl/judged": float(len(trajectories) - removed), "rl/judge_failures": float(removed),
                "rl/reward_mean": sum(t.reward for t in trajectories) / len(trajectories), "rl/tasks": len(tasks)}


def test_every_batch_is_judged_and_the_counts_add_up():
    played = Played()
    judged = Halving(played, URL, scale=0.5)
    assert isinstance(judged, Rollouts)
    first = asyncio.run(judged("engine", ["a", "b"], group_size=2, temperature=0.7, max_tokens=9))
    # 2 tasks x rewards (1, 0): the 1s halved to 0.5, the 0s removed
    assert [t.reward for t in first] == [0.5, 0.0, 0.5, 0.0]
    assert [t.metadata.get("removed") for t in first] == [None, "judge_failure"] * 2
    assert played.calls == [("engine", ["a", "b"], 2, 0.7, 9)]
    asyncio.run(judged("engine", ["c"], group_size=2, temperature=0.7))
    # the last call's stats: 1 task, 1 judged, 1 removed, mean (0.5 + 0) / 2 = 0.25
    assert judged.stats == {"rl/judged": 1.0, "rl/judge_failures": 1.0, "rl/reward_mean": 0.25, "rl/tasks": 1}
    # totals sum only the counted keys over both calls: judged 2 + 1 = 3, failures 2 + 1 = 3; no summed mean
    assert judged.totals == {"rl/judged": 3.0, "rl/judge_failures": 3.0}


def test_bad_arguments():
    with pytest.raises(ValueError, match="rollouts must be a Rollouts"):
        Halving(object(), URL)
    with pytest.raises(ValueError, match="judge must be an http"):
        Halving(Played(), "localhost:8000")
    with pytest.raises(ValueError, match="judge must be an http"):
        Halving(Played(), 42)
