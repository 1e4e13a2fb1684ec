"""The task filter stage on known pools: scripted harnesses whose per-task outcomes are fixed in advance."""

import asyncio
import math

import pytest

from orchard.stages import TaskFilterConfig, filter_tasks, split_attempts


def run(harnesses, tasks, **kw):
    return asyncio.run(filter_tasks(harnesses, None, tasks, **kw))


def test_keeps_tasks_solved_sometimes_but_at_most_half_the_time(scripted_rollouts):
    # 8 attempts each: p̂ = 0/8, 1/8, 4/8, 5/8, 8/8 -> keep 1/8 and 4/8 (0 < p̂ <= 0.5; 0.5 itself is kept).
    T, F = True, False
    outcomes = {"never": [F], "rare": [T, F, F, F, F, F, F, F], "half": [T, F], "most": [T, T, T, T, T, F, F, F],
                "always": [T]}
    result = run({"bash": scripted_rollouts(outcomes)}, list(outcomes))
    assert result.tasks == ["rare", "half"]
    assert result.pass_rate.tolist() == [0.0, 0.125, 0.5, 0.625, 1.0]
    # 40 episodes, 1 + 4 + 5 + 8 = 18 passed.
    assert result.stats == {"filter/candidates": 5.0, "filter/kept": 2.0, "filter/too_hard": 1.0,
                            "filter/too_easy": 2.0, "filter/unscored": 0.0, "filter/episodes": 40.0,
                            "filter/env_errors": 0.0, "filter/success": 18 / 40}
    assert len(result.trajectories) == 40


def test_attempts_spread_over_harnesses_and_pooled_per_task(scripted_rollouts):
    # 8 attempts over two harnesses: 4 each. Task "a" passes every bash episode and fails every tool one:
    # p̂ = 4/8 = 0.5, kept, though each harness alone would say 1.0 (dropped) or 0.0 (dropped).
    bash, tool = scripted_rollouts({"a": [True], "b": [True]}), scripted_rollouts({"a": [False], "b": [True]})
    result = run({"bash": bash, "tool": tool}, ["a", "b"])
    assert bash.calls == [(["a", "b"], 4)] and tool.calls == [(["a", "b"], 4)]
    assert result.tasks == ["a"] and result.pass_rate.tolist() == [0.5, 1.0]


def test_env_errors_are_not_outcomes(scripted_rollouts):
    # "a": 2 passes, 2 fails, 4 dead sandboxes -> p̂ = 2/4 = 0.5, kept (scoring the dead ones 0 would give 2/8).
    # "b": every sandbox died -> unscored, dropped, p̂ NaN.
    result = run({"bash": scripted_rollouts({"a": [True, None, False, None], "b": [None]})}, ["a", "b"])
    assert result.tasks == ["a"]
    assert result.pass_rate[0] == 0.5 and math.isnan(result.pass_rate[1])
    assert result.stats["filter/unscored"] == 1.0 and result.stats["filter/env_errors"] == 12.0
    assert result.stats["filter/success"] == 2 / 4


def test_bounds_are_the_difficulty_filter_s(scripted_rollouts):
    # p̂ = 3/4 = 0.75: dropped by the paper's (0, 0.5], kept by (0.5, 1.0].
    harness = {"bash": scripted_rollouts({"a": [True, True, True, False]})}
    assert run(harness, ["a"], attempts=4).tasks == []
    assert run(harness, ["a"], attempts=4, low=0.5, high=1.0).tasks == ["a"]


def test_no_candidates_is_a_defined_empty_answer(scripted_rollouts):
    result = run({"bash": scripted_rollouts({})}, [])
    assert result.tasks == [] and result.stats["filter/kept"] == 0.0 and result.stats["filter/success"] == 0.0


def test_split_attempts():
    assert split_attempts(8, ["bash", "tool"]) == {"bash": 4, "tool": 4}
    assert split_attempts(3, ["bash", "tool"]) == {"bash": 2, "tool": 1}
    assert split_attempts(1, ["bash", "tool"]) == {"bash": 1, "tool": 0}


@pytest.mark.parametrize(("kw", "message"), [
    ({"attempts": 0}, "attempts must be an int >= 1, got 0"),
    ({"high": 1.5}, "high must be a number in"),
    ({"low": 0.5, "high": 0.5}, "low must be < high"),
])
def test_bad_arguments_name_themselves(kw, message, scripted_rollouts):
    with pytest.raises(ValueError, match=message):
        run({"bash": scripted_rollouts({"a": [True]})}, ["a"], **kw)
    with pytest.raises(ValueError, match="harnesses must name at least one"):
        run({}, ["a"])


def test_config_rates_the_whole_pool_or_a_seeded_sample_of_it():
    pool = list(range(10))
    assert TaskFilterConfig().candidates_of(pool, seed=0) == pool  # 0: the paper's whole pool
    assert TaskFilterConfig(candidates=10).candidates_of(pool, seed=0) == pool  # covers the pool
    four = TaskFilterConfig(candidates=4).candidates_of(pool, seed=3)
    # 4 distinct pool tasks in pool order; the same seed draws the same ones, some other seed other ones.
    assert len(set(four)) == 4 and four == sorted(four) and set(four) <= set(pool)
    assert TaskFilterConfig(candidates=4).candidates_of(pool, seed=3) == four
    assert any(TaskFilterConfig(candidates=4).candidates_of(pool, seed=s) != four for s in range(4, 10))
    assert TaskFilterConfig(candidates=2).candidates_of([], seed=0) == []


@pytest.mark.parametrize(("kw", "message"), [
    ({"attempts": 0}, "attempts must be an int >= 1, got 0"),
    ({"candidates": -1}, "candidates must be an int >= 0, got -1"),
    ({"high": 1.5}, "high must be a number in"),
    ({"low": 0.5, "high": 0.5}, "low must be < high"),
])
def test_config_mistakes_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        TaskFilterConfig(**kw)
