"""rollout_groups under BAR takes its balanced band from the RL config (the paper's [0.375, 0.625] by default)."""

import asyncio

import pytest

from orchard.data import Trajectory
from orchard.stages import RLConfig, RolloutConfig, rollout_groups


class Pool:
    """Every call returns the pool 3 passed, 5 failed (in that order), cut to the size asked for."""

    def __init__(self):
        self.asked = []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None):
        self.asked.append(group_size)
        outcomes = [True] * 3 + [False] * 5
        return [Trajectory(task_id=str(t), reward=1.0 if o else -1.0) for t in tasks for o in outcomes[:group_size]]


def positives_kept(**band):
    cfg = RLConfig(group_size=4, bar_n_max=8, bar_stride=8, use_bar=True, tasks_per_step=1, **band)
    harness = Pool()
    groups, generated = asyncio.run(rollout_groups({"bash": harness}, None, ["a"], ["bash"], cfg, RolloutConfig()))
    assert harness.asked == [8] and len(generated) == 8  # one stride spends the whole budget
    [group] = groups
    return sum(t.reward > 0 for t in group.trajectories), len(group.trajectories)


def test_default_band_is_the_papers():
    # n = 4: counts k with 0.375 <= k / 4 <= 0.625 -> k in [ceil(1.5), floor(2.5)] = {2}: 2 passed of 4 kept.
    assert positives_kept() == (2, 4)


def test_band_from_the_config_reaches_bar():
    # Band [0.75, 0.75]: k / 4 = 0.75 -> k = 3; the pool has 3 passed, so 3 passed + 1 failed are kept.
    assert positives_kept(bar_rho_min=0.75, bar_rho_max=0.75) == (3, 4)


def test_band_mistakes_are_caught_when_the_config_is_made():
    with pytest.raises(ValueError, match="bar_rho_min / bar_rho_max: rho_min must be <= rho_max"):
        RLConfig(use_bar=True, bar_rho_min=0.7, bar_rho_max=0.6)
    # Without BAR the band is unused and not checked.
    assert RLConfig(bar_rho_min=0.7, bar_rho_max=0.6).bar_rho_min == 0.7
