"""`search_temperature`: validation success at each temperature of a grid per harness, the best mean over the
harnesses chosen, ties nearest the reference; `best_temperature`'s tie rule; the grid's checks;
`start_at_best_temperature`: the search logged, its choice folded into the policy against the reference and pushed
to the engine."""

import asyncio
import math

import pytest
import torch

from orchard.data import Trajectory
from orchard.models import tiny_qwen3
from orchard.stages import TemperatureSearch, best_temperature, search_temperature, start_at_best_temperature


class ByTemperature:
    """A `Rollouts` whose episodes pass with the pattern ``passes[temperature]`` (cycled over each call's episodes);
    records the temperatures it was called at."""

    def __init__(self, passes):
        self.passes, self.temperatures = passes, []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        self.temperatures.append(temperature)
        pattern = self.passes[temperature]
        episodes = [task for task in tasks for _ in range(group_size)]
        return [Trajectory(task_id=task, reward=1.0 if pattern[i % len(pattern)] else -1.0, termination_reason="done")
                for i, task in enumerate(episodes)]


T, F = True, False


def search(harnesses, **kwargs):
    return asyncio.run(search_temperature(harnesses, None, ["a", "b"], attempts=2, **kwargs))


def test_the_best_mean_over_the_harnesses_is_chosen():
    # 2 tasks x 2 attempts = 4 episodes per harness and temperature:
    #   react 4/4, 2/4, 0/4 and text 0/4, 3/4, 2/4 at 0.5, 1.0, 1.5
    #   means (1 + 0) / 2 = 0.5, (0.5 + 0.75) / 2 = 0.625, (0 + 0.5) / 2 = 0.25 -> 1.0, though react alone is best
    #   at 0.5 (a choice per harness would differ)
    react = ByTemperature({0.5: [T], 1.0: [T, F], 1.5: [F]})
    text = ByTemperature({0.5: [F], 1.0: [T, T, T, F], 1.5: [T, F]})
    found = search({"react": react, "text": text}, temperatures=[0.5, 1.0, 1.5], reference=1.0)
    assert found.temperature == 1.0
    assert found.mean_success == {0.5: 0.5, 1.0: 0.625, 1.5: 0.25}
    assert [found.rows[t]["react"]["success"] for t in (0.5, 1.0, 1.5)] == [1.0, 0.5, 0.0]
    assert [found.rows[t]["text"]["success"] for t in (0.5, 1.0, 1.5)] == [0.0, 0.75, 0.5]
    assert found.rows[1.0]["text"]["pass^2"] == 0.5  # task a: T, T; task b: T, F
    assert react.temperatures == text.temperatures == [0.5, 1.0, 1.5]  # each evaluated at the grid's temperature


def test_ties_go_to_the_temperature_nearest_the_reference_then_the_lower():
    # 0.5 and 1.5 both 0.5 mean success, 1.0 is 0.25
    react = ByTemperature({0.5: [T, F], 1.0: [T, F, F, F], 1.5: [T, F]})
    harnesses = {"react": react}
    assert search(harnesses, temperatures=[0.5, 1.0, 1.5], reference=1.2).temperature == 1.5  # |0.3| < |0.7|
    assert search(harnesses, temperatures=[0.5, 1.0, 1.5], reference=0.6).temperature == 0.5
    assert search(harnesses, temperatures=[1.5, 1.0, 0.5], reference=1.0).temperature == 0.5  # equally near


def test_log_rows_hold_each_temperature_and_the_choice():
    found = TemperatureSearch(rows={0.3: {"react": {"success": 0.5, "tasks": 2}}, 0.6: {"react": {"success": 0.25,
                                                                                                  "tasks": 2}}},
                              mean_success={0.3: 0.5, 0.6: 0.25}, temperature=0.3)
    assert found.log_rows() == [
        {"temperature/value": 0.3, "temperature/mean_success": 0.5, "temperature/react/success": 0.5,
         "temperature/react/tasks": 2.0},
        {"temperature/value": 0.6, "temperature/mean_success": 0.25, "temperature/react/success": 0.25,
         "temperature/react/tasks": 2.0},
        {"temperature/chosen": 0.3}]


def test_the_highest_validation_success_wins():
    # 0.35 at T=0.6 beats 0.30 at T=1.0 (the reference) and 0.20 at T=0.3.
    assert best_temperature({0.3: 0.20, 0.6: 0.35, 1.0: 0.30}, reference=1.0) == 0.6


def test_best_temperature_ties_go_to_the_temperature_nearest_the_reference():
    # All three at 0.30: |0.9 - 1.0| = 0.1 < |0.6 - 1.0| = 0.4 and |1.2 - 1.0| = 0.2.
    assert best_temperature({0.6: 0.3, 0.9: 0.3, 1.2: 0.3}, reference=1.0) == 0.9
    # Equally near (|0.5 - 1.0| = |1.5 - 1.0| = 0.5): the cooler one, so the answer never depends on dict order.
    assert best_temperature({1.5: 0.3, 0.5: 0.3}, reference=1.0) == 0.5
    assert best_temperature({0.5: 0.3, 1.5: 0.3}, reference=1.0) == 0.5
    # A policy that never succeeds (all 0.0) keeps the reference temperature.
    assert best_temperature({0.3: 0.0, 1.0: 0.0, 1.2: 0.0}, reference=1.0) == 1.0


def test_best_temperature_refuses_an_empty_grid_and_a_negative_reference():
    with pytest.raises(ValueError, match=r"^success_by_temperature must hold at least one temperature, got none$"):
        best_temperature({}, reference=1.0)
    with pytest.raises(ValueError, match=r"^reference must be a number >= 0, got -1\.0$"):
        best_temperature({0.5: 0.0}, reference=-1.0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperatures": []}, r"^temperatures must be a non-empty list of numbers > 0, got \[\]$"),
    ({"temperatures": [0.5, 0.0]}, r"^temperatures must hold finite numbers > 0, got 0.0 in \[0.5, 0.0\]$"),
    ({"temperatures": [-1]}, r"^temperatures must hold finite numbers > 0, got -1 in \[-1\]$"),
    ({"temperatures": [math.inf]}, r"^temperatures must hold finite numbers > 0, got inf in \[inf\]$"),
    ({"temperatures": [0.5, 0.5]}, r"^temperatures must not repeat a temperature, got \[0.5, 0.5\]$"),
    ({"temperatures": [0.5], "attempts": 0}, r"^attempts must be an int >= 1, got 0$"),
    ({"temperatures": [0.5], "reference": -0.1}, r"^reference must be a number >= 0, got -0.1$"),
])
def test_bad_arguments_are_refused_before_any_episode(kwargs, message):
    react = ByTemperature({0.5: [T]})
    with pytest.raises(ValueError, match=message):
        asyncio.run(search_temperature({"react": react}, None, ["a"], **{"attempts": 1, **kwargs}))
    assert react.temperatures == []


class Engine:
    """Keeps the weights it was given."""

    def __init__(self):
        self.pushed = []

    async def update_weights(self, state_dict):
        self.pushed.append({k: v.detach().clone() for k, v in state_dict.items()})


def test_start_at_best_temperature_folds_the_choice_against_the_reference(recording_log):
    # 2 tasks x 2 attempts per temperature: 0.25 at 0.5, 0.75 at 1.5 -> T = 1.5. RL samples at the reference 0.75,
    # so the fold is 1.5 / 0.75 = 2: the final norm halves, and the policy sampled at 0.75 is the original at 1.5.
    model, engine, log = tiny_qwen3(64, seed=0), Engine(), recording_log()
    norm = model.model.norm.weight.detach().clone()
    react = ByTemperature({0.5: [T, F, F, F], 1.5: [T, T, T, F]})
    found = asyncio.run(start_at_best_temperature(model, engine, {"react": react}, ["a", "b"], temperatures=[0.5, 1.5],
                                                  attempts=2, reference=0.75, seed=0, log=log, step=7))
    assert found.temperature == 1.5 and found.mean_success == {0.5: 0.25, 1.5: 0.75}
    torch.testing.assert_close(model.model.norm.weight.detach(), norm / 2)
    (pushed,) = engine.pushed  # once, after the fold
    torch.testing.assert_close(pushed["model.norm.weight"], norm / 2)
    # every row at the given step, under the prefix: one per temperature, then the choice
    assert [(row.get("start_temperature/value", row.get("start_temperature/chosen")), step) for row, step in log.rows] \
        == [(0.5, 7), (1.5, 7), (1.5, 7)]
    assert log.lines == ["start temperature T=0.5: react 0.250 mean 0.250 (2 validation tasks)",
                         "start temperature T=1.5: react 0.750 mean 0.750 (2 validation tasks)",
                         "start temperature: T=1.5 (mean validation success 0.750); final norm divided by 2"]


@pytest.mark.parametrize("reference", [0, -1.0, True])
def test_start_at_best_temperature_needs_a_reference_to_fold_against(reference, recording_log):
    model, react = tiny_qwen3(64, seed=0), ByTemperature({0.5: [T]})
    norm = model.model.norm.weight.detach().clone()
    with pytest.raises(ValueError, match=r"^reference must be a number > 0 \(T is folded against it\), got "):
        asyncio.run(start_at_best_temperature(model, Engine(), {"react": react}, ["a"], temperatures=[0.5],
                                              attempts=1, reference=reference, log=recording_log(), step=0))
    assert react.temperatures == [] and torch.equal(model.model.norm.weight, norm)  # nothing played, nothing folded
