"""The evaluation table: success, pass@k, pass^k and counts, by hand; the printed table."""

import asyncio

import pytest

from orchard.data import Trajectory
from orchard.stages import evaluate, format_table, success_row


def ep(task, reward, reason="done", **components):
    return Trajectory(reward=reward, termination_reason=reason, task_id=task, reward_components=components)


def test_success_row_by_hand():
    trajectories = [ep("a", 1.0), ep("a", -1.0), ep("b", 1.0), ep("b", -1.0, passed=1.0),
                    ep("c", 1.0), ep("c", None, "env_error")]
    row = success_row(trajectories, 2)
    # a: 1 of 2 passed, b: 2 of 2 (the second by the evaluation rule), c: not fully scored (env error).
    # success = 3 / 4; pass@2 = (1 + 1) / 2; pass^2 = (0 + 1) / 2.
    assert row == {"success": 0.75, "pass@2": 1.0, "pass^2": 0.5, "tasks": 2, "env_errors": 1}
    assert success_row([], 3) == {"success": 0.0, "pass@3": 0.0, "pass^3": 0.0, "tasks": 0, "env_errors": 0}
    with pytest.raises(ValueError, match="attempts"):
        success_row(trajectories, 0)


def test_evaluate_runs_each_harness_with_k_attempts():
    calls = []

    async def harness(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        calls.append((engine, tuple(tasks), group_size, temperature))
        return [ep(t, 1.0 if i % 2 else -1.0) for t in tasks for i in range(group_size)]

    rows = asyncio.run(evaluate({"x": harness, "y": harness}, "E", ["a", "b"], attempts=2, temperature=0.5))
    assert calls == [("E", ("a", "b"), 2, 0.5)] * 2
    assert rows["x"] == rows["y"] == {"success": 0.5, "pass@2": 1.0, "pass^2": 0.0, "tasks": 2, "env_errors": 0}
    with pytest.raises(ValueError, match="harnesses"):
        asyncio.run(evaluate({}, "E", ["a"], attempts=1, temperature=1.0))


def test_format_table_aligns_and_prints_counts_as_integers():
    row = {"success": 0.5, "pass@2": 1.0, "pass^2": 0.0, "tasks": 2, "env_errors": 0}
    lines = format_table({"base": {"react": row}, "sft": {"text": row}}, 2).splitlines()
    assert lines[0].split() == ["stage", "harness", "success", "pass@2", "pass^2", "tasks", "env_errors"]
    assert lines[1].split() == ["base", "react", "0.500", "1.000", "0.000", "2", "0"]
    assert len({len(line) for line in lines}) == 1  # every row as wide as the header
