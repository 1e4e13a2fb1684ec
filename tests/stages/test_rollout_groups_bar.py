"""rollout_groups under BAR takes its balanced band from the RL config (the paper's [0.375, 0.625] by default), and
chooses only among rollouts that can train: a judge-removed rollout or a dropped timeout never fills a group; and
`bar_groups` reports the choice it made."""

import asyncio

import pytest

from orchard.data import Trajectory
from orchard.stages import RecordedRollouts, RLConfig, RolloutConfig, bar_groups, rollout_groups
from orchard.stages import rl as rl_module


class Pool:
    """Every call returns the pool 3 passed, 5 failed (in that order), cut to the size asked for."""

    def __init__(self):
        self.asked = []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
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


class Judged:
    """A pool of 3 passed then 5 failed, all ended by the agent (``done``), one step each; ``removed`` and
    ``timed_out`` name the members a judge removed from the loss / the wall clock cut."""

    def __init__(self, removed=(), timed_out=()):
        self.removed, self.timed_out = set(removed), set(timed_out)

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        out = []
        for i, passed in enumerate([True] * 3 + [False] * 5):
            t = Trajectory(task_id="a", reward=1.0 if passed else -1.0,
                           termination_reason="time_budget" if i in self.timed_out else "done",
                           metadata={"removed": "judge_failure"} if i in self.removed else {})
            t.metadata["arrival"] = i
            out.append(t)
        return out[:group_size]


def kept(harness, **cfg_kw):
    cfg = RLConfig(group_size=4, bar_n_max=8, bar_stride=8, use_bar=True, tasks_per_step=1, **cfg_kw)
    [group], generated = asyncio.run(rollout_groups({"bash": harness}, None, ["a"], ["bash"], cfg, RolloutConfig()))
    return [t.metadata["arrival"] for t in group.trajectories], len(generated)


def test_bar_never_picks_a_judge_removed_rollout():
    # Without removals BAR keeps k = 2 positives of n = 4 (band {2}, as above); all end "done" with equal length,
    # so arrival decides: positives 0, 1 and negatives 3, 4.
    assert kept(Judged()) == ([0, 1, 3, 4], 8)
    # The judge removed positive 0, which BAR would have picked: the candidates are positives 1, 2 and negatives
    # 3..7, so BAR keeps 1, 2, 3, 4: still 4 members that all train, 2 of them positive. The removed rollout
    # stays among the generated (8: it spent budget and is counted as removed).
    assert kept(Judged(removed={0})) == ([1, 2, 3, 4], 8)
    # A removed negative likewise: negatives 4, 5 fill in for 3.
    assert kept(Judged(removed={3})) == ([0, 1, 4, 5], 8)


def test_bar_never_picks_a_timeout_the_group_drops():
    # Positives 0 and 1 timed out: BAR ranks truncated members last, but with only positive 2 left besides them a
    # balanced set (2 positives) would need one. Dropped timeouts are no candidates: 1 positive, 5 negatives, no
    # balanced set within the budget -> relaxed: k+ in [max(0, 4 - 5), min(4, 1)] = [0, 1] nearest 2 -> 1, so
    # positive 2 and negatives 3, 4, 5.
    assert kept(Judged(timed_out={0, 1})) == ([2, 3, 4, 5], 8)
    # Kept when the config keeps timeouts (drop_timeouts=False): the band is met, with the terminated positive 2
    # first and then timed-out 0 (truncated, earlier arrival).
    assert kept(Judged(timed_out={0, 1}), drop_timeouts=False) == ([0, 2, 3, 4], 8)


def test_success_counts_the_kept_group_and_success_generated_the_whole_pool():
    # BAR generated 3 passed + 5 failed and kept 2 passed + 2 failed: rl/success (what trains) = 2 / 4 = 0.5,
    # rl/success_generated (every scored episode) = 3 / 8 = 0.375; without BAR the 4 members are both: 3 / 4.
    for use_bar, success, generated_success, episodes in [(True, 0.5, 0.375, 8.0), (False, 0.75, 0.75, 4.0)]:
        cfg = RLConfig(group_size=4, bar_n_max=8, bar_stride=8, use_bar=use_bar, tasks_per_step=1)
        groups, generated = asyncio.run(rollout_groups({"bash": Pool()}, None, ["a"], ["bash"], cfg, RolloutConfig()))
        stats = rl_module._rollout_stats(rl_module._rollout_counts(groups, generated))
        assert (stats["rl/success"], stats["rl/success_generated"]) == (success, generated_success)
        assert stats["rl/episodes"] == episodes


def test_bar_groups_report_the_choice_bar_made_by_hand():
    """bar_groups reads BAR's choice from rollout_groups (it chooses nothing itself): with strides smaller than
    the budget a group's pool spans several generation calls, and the report still matches the groups that train."""
    # Per task, the outcomes of its successive strides of 4: +1 resolved, -1 not, None a dead sandbox.
    strides = {"a": [[1, 1, 1, 1], [-1, -1, 1, -1]], "b": [[1, -1, -1, 1]], "c": [[None, -1, -1, -1], [-1] * 4]}
    played = {task: 0 for task in strides}

    async def scripted(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        [task] = tasks
        outcomes = strides[task][played[task]]
        played[task] += 1
        return [Trajectory(task_id=task, reward=r, termination_reason="done" if r is not None else "env_error")
                for r in outcomes[:group_size]]

    cfg = RLConfig(group_size=4, bar_n_max=8, bar_stride=4, use_bar=True, tasks_per_step=3)
    calls = []
    groups, _ = asyncio.run(rollout_groups({"bash": RecordedRollouts(scripted, calls)}, None, ["a", "b", "c"],
                                           ["bash"] * 3, cfg, RolloutConfig()))
    rows = {row["pool_positive_ratio"]: row for row in bar_groups([calls])}
    # a: 4 of 4 resolved has no balanced set (k+ in [ceil(0.375 x 4), floor(0.625 x 4)] = {2}), so BAR draws a
    #    second stride: 5 of 8 = 0.625 in the pool, 2 of 4 kept = 0.5. (Read call by call, as bar_groups did
    #    before, the first call alone would be a pool of 4 of 4 = 1.0.)
    # b: 2 of 4 at once: kept whole, 0.5 both.
    # c: the dead sandbox is no candidate: 0 of 7, no signal, dropped.
    assert rows == {0.625: {"step": 1, "pool_positive_ratio": 0.625, "kept_positive_ratio": 0.5},
                    0.5: {"step": 1, "pool_positive_ratio": 0.5, "kept_positive_ratio": 0.5},
                    0.0: {"step": 1, "pool_positive_ratio": 0.0, "kept_positive_ratio": None}}
    # ... and they are the groups that train: the kept ratios are those of the groups' members.
    trained = sorted(sum(t.reward > 0 for t in g.trajectories) / len(g.trajectories) for g in groups if g.trajectories)
    assert trained == sorted(r["kept_positive_ratio"] for r in rows.values() if r["kept_positive_ratio"] is not None)
    # a step with no candidate at all (every sandbox dead) still has its row
    dead = [Trajectory(task_id="d", reward=None, termination_reason="env_error")]
    assert bar_groups([[dead]]) == [{"step": 1, "pool_positive_ratio": None, "kept_positive_ratio": None}]
