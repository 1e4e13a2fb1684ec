"""Hindsight values: the scripted value teacher follows the prompt's rules on hand-built trajectories, its answer
round-trips through the parser, its values become credit runs through `orchard.losses`, and `step_values` reaches
it in process and as a real server on loopback (then feeds credit-assigned SFT)."""

import functools
import json
import random

import pytest
import torch

from orchard.data import Message, ToolCall, Trajectory
from orchard.data.render import render_trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe.prompts import parse_value_estimation, value_estimation_messages
from orchard.domains.swe.values import (
    ScriptedValueEstimator,
    estimate_values_text,
    hindsight_values,
    step_values,
    step_values_async,
)
from orchard.losses import credit_runs, interpolate_step_values, td_credit
from orchard.rollout.engine import GenerateRequest, SamplingParams
from orchard.rollout.scripted import ScriptedEngine
from orchard.rollout.server import build_app, serve_in_thread
from orchard.stages import sft_samples

ISSUE = """I ran into a problem with `inventory/items.py`. This snippet:

```python
from inventory.items import Item, cheapest, total_value
cheapest([Item('a', 5), Item('b', 2), Item('c', 9)])
```

That last expression gives `None`, but it should give `'b'`."""

LIST = ("ls", "exit code: 0\nstdout:\ninventory\nREADME.md\ntests")
OPEN = ("cat inventory/items.py", "exit code: 0\nstdout:\ndef cheapest(items):\n    best = None\n    for item in items:")
REPRODUCE = ("python -c \"from inventory.items import Item, cheapest; print(cheapest([Item('a', 5), Item('b', 2)]))"
             " == 'b'\" && python -m pytest -q tests/test_items.py",
             "exit code: 1\nstdout:\nFalse\nFAILED tests/test_items.py::test_cheapest - AssertionError\n"
             "1 failed, 4 passed in 0.05s")
UNRELATED_FAILURE = ("python -c 'import yaml'", "exit code: 1\nstderr:\nModuleNotFoundError: No module named 'yaml'")
FIX = ("sed -i 's/        pass/        best = min(items, key=lambda i: i.price)/' inventory/items.py", "exit code: 0")
WRONG_FIX = ("sed -i 's/price < best/price > best/' inventory/items.py", "exit code: 0")
PASS = ("python -m pytest -q tests", "exit code: 0\nstdout:\n14 passed in 0.12s")
FAIL = ("python -m pytest -q tests", "exit code: 1\nstdout:\nFAILED tests/test_stock.py::test_restock\n"
        "1 failed, 13 passed in 0.12s")
DONE = (None, "I fixed `cheapest`; the tests pass.")


def trajectory(steps, reward):
    """System, the issue, then one assistant turn per step: an exec call and its observation, or a final text."""
    messages = [Message("system", "You fix bugs in the repository in /workspace."), Message("user", ISSUE)]
    for i, (command, observation) in enumerate(steps):
        if command is None:
            messages.append(Message("assistant", observation))
            continue
        messages.append(Message("assistant", "Next.", tool_calls=[ToolCall("exec", {"command": command}, id=f"c{i}")]))
        messages.append(Message("tool", observation, tool_call_id=f"c{i}"))
    return Trajectory(messages=messages, reward=reward)


def answer(traj):
    prompt = value_estimation_messages(traj, resolved=traj.reward > 0)[1]["content"]
    return estimate_values_text(prompt)


def values_of(traj):
    return parse_value_estimation(answer(traj), num_steps=traj.num_steps).values


RESOLVED = trajectory([LIST, OPEN, REPRODUCE, FIX, PASS, DONE], 1.0)
FAILED = trajectory([REPRODUCE, OPEN, WRONG_FIX, PASS, WRONG_FIX, FAIL, DONE], -1.0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def test_resolved_trajectory_values():
    # start 0.4; step 2 opens the module (+0.05, state 1 listed at 0.4 so the gain is step 2's); step 3 reproduces
    # (+0.10 -> 0.55); step 4 edits (+0.10 -> 0.65); step 5 passes after the edit (+0.15 -> 0.80); resolved: 1.0.
    assert values_of(RESOLVED) == {0: 0.4, 1: 0.4, 2: 0.45, 3: 0.55, 4: 0.65, 5: 0.8, 6: 1.0}


def test_failed_trajectory_values_follow_the_prompt_rules():
    # step 1 reproduces (0.4 + 0.10 = 0.50), step 2 opens the module (+0.05 = 0.55); the edits (3, 5) and the pass
    # in between (4) hold the value: the outcome says the fix was wrong; step 6 fails where step 4 passed
    # (0.55 - 0.15 = 0.40, state 5 listed at 0.55); the failed end: min(0.1, 0.40) = 0.1.
    values = values_of(FAILED)
    assert values == {0: 0.4, 1: 0.5, 2: 0.55, 5: 0.55, 6: 0.4, 7: 0.1}
    assert 0.3 <= values[0] <= 0.5 and values[7] < 0.2
    assert values[1] - values[0] >= 0.05  # the reproducing step earns credit
    assert values[6] - values[5] < 0  # the regression loses it: not monotone


def test_a_failed_end_below_the_hindsight_cap_keeps_the_lower_value():
    # three rounds of edit (0 in a failed trajectory), pass (verify, 0), fail (regress, -0.15):
    # 0.4 -> 0.25 (step 3) -> 0.10 (step 6) -> max(0.05, -0.05) = 0.05 (step 9, the floor); each regression lists
    # the state before it (2, 5, 8); the failed end is min(0.1, 0.05) = 0.05, not the cap 0.1.
    traj = trajectory([WRONG_FIX, PASS, FAIL] * 3 + [DONE], -1.0)
    assert values_of(traj) == {0: 0.4, 2: 0.4, 3: 0.25, 5: 0.25, 6: 0.1, 8: 0.1, 9: 0.05, 10: 0.05}


def test_a_failure_that_does_not_touch_the_issue_is_no_reproduction():
    # a failing run about a missing package names neither `inventory/items.py` nor `cheapest`: no key step.
    traj = trajectory([UNRELATED_FAILURE, DONE], -1.0)
    assert values_of(traj) == {0: 0.4, 2: 0.1}
    traj = trajectory([REPRODUCE, DONE], -1.0)
    assert values_of(traj) == {0: 0.4, 1: 0.5, 2: 0.1}


def test_an_editor_tool_views_and_edits():
    # SWE-agent's editor: its "view" command reads the module (locate, +0.05), "str_replace" changes it (edit, +0.10
    # in a resolved trajectory): 0.40 -> 0.45 -> 0.55, then the resolved end 1.0.
    messages = [Message("user", ISSUE)]
    calls = [{"command": "view", "path": "/workspace/inventory/items.py"},
             {"command": "str_replace", "path": "/workspace/inventory/items.py", "old_str": "pass", "new_str": "x"}]
    for i, arguments in enumerate(calls):
        messages.append(Message("assistant", None, tool_calls=[ToolCall("str_replace_editor", arguments, id=f"e{i}")]))
        messages.append(Message("tool", "def cheapest(items):" if i == 0 else "The file has been edited.",
                                tool_call_id=f"e{i}"))
    messages.append(Message("assistant", "Done."))
    assert values_of(Trajectory(messages=messages, reward=1.0)) == {0: 0.4, 1: 0.45, 2: 0.55, 3: 1.0}


def test_rules_hold_over_random_trajectories():
    pool = [LIST, OPEN, REPRODUCE, UNRELATED_FAILURE, FIX, WRONG_FIX, PASS, FAIL, DONE]
    for seed in range(40):
        rng = random.Random(seed)
        steps = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        for reward in (1.0, -1.0):
            traj = trajectory(steps, reward)
            text = answer(traj)
            assert text == answer(traj)  # deterministic
            values = parse_value_estimation(text, num_steps=traj.num_steps).values
            n = traj.num_steps
            assert values is not None and min(values) == 0 and max(values) == n, (seed, text)
            assert all(0.0 <= v <= 1.0 for v in values.values())
            assert 0.3 <= values[0] <= 0.5
            assert values[n] < 0.2 if reward < 0 else values[n] >= 0.8
            credit = td_credit(interpolate_step_values(values, n))
            if reward > 0:
                assert values[n] == max(values.values())  # the outcome is worth the most
            else:
                # a failed trajectory gains only where evidence is: never on a listing, a failure off the issue or
                # the end, nor on an edit or a passing run (the outcome says the fix was wrong)
                idle = {LIST, UNRELATED_FAILURE, DONE, FIX, WRONG_FIX, PASS}
                assert all(credit[t] <= 1e-12 for t, step in enumerate(steps) if step in idle), (seed, text)


def test_answer_round_trips_through_the_parser():
    text = answer(RESOLVED)
    records = json.loads(text)["values"]
    assert all(set(r) == {"state", "value", "why"} and r["why"] for r in records)
    parsed = parse_value_estimation(text, num_steps=RESOLVED.num_steps)
    assert parsed.parseable and parsed.values == {r["state"]: r["value"] for r in records}


def test_credit_runs_of_the_failed_trajectory():
    # interpolated V(s_0..s_7) = 0.40, 0.50, 0.55, 0.55, 0.55, 0.55, 0.40, 0.10
    # c_t = V(s_{t+1}) - V(s_t) = 0.10, 0.05, 0, 0, 0, -0.15, -0.30 -> c >= eps 0.05 on steps 0-1: one run (0, 2)
    values = interpolate_step_values(values_of(FAILED), FAILED.num_steps)
    expected = torch.tensor([0.40, 0.50, 0.55, 0.55, 0.55, 0.55, 0.40, 0.10], dtype=torch.float64)
    assert torch.allclose(values, expected)
    credit = td_credit(values)
    assert torch.allclose(credit, torch.tensor([0.10, 0.05, 0, 0, 0, -0.15, -0.30], dtype=torch.float64))
    assert credit_runs(credit, eps=0.05) == [(0, 2)]
    # resolved: 0.40, 0.40, 0.45, 0.55, 0.65, 0.80, 1.00 -> credits 0, 0.05, 0.10, 0.10, 0.15, 0.20 -> run (1, 6)
    assert credit_runs(td_credit(interpolate_step_values(values_of(RESOLVED), RESOLVED.num_steps))) == [(1, 6)]


async def test_estimator_is_an_engine(tokenizer):
    estimator = ScriptedValueEstimator(tokenizer)
    messages = value_estimation_messages(FAILED, resolved=False)
    prompt = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    (result,) = await estimator.generate([GenerateRequest(prompt, SamplingParams(temperature=0.0, n=2,
                                                                                max_tokens=4096))])
    first, second = result.completions
    assert first.token_ids == second.token_ids and first.token_ids[-1] == tokenizer.eos_token_id
    assert first.finish_reason == "stop" and first.logprobs == [0.0] * len(first.token_ids)
    assert tokenizer.decode(first.token_ids, skip_special_tokens=True) == answer(FAILED)
    (cut,) = await estimator.generate([GenerateRequest(prompt, SamplingParams(max_tokens=5))])
    assert len(cut.completions[0].token_ids) == 5 and cut.completions[0].finish_reason == "length"


def test_step_values_in_process(tokenizer):
    estimator = ScriptedValueEstimator(tokenizer)
    assert step_values(FAILED, client_or_engine=estimator) == values_of(FAILED)
    # the outcome the teacher is told can be given explicitly (e.g. for an unscored trajectory)
    unscored = trajectory([REPRODUCE, DONE], None)
    assert step_values(unscored, client_or_engine=estimator, resolved=False) == {0: 0.4, 1: 0.5, 2: 0.1}
    # a reward of exactly 0 is no resolution: the teacher hears FAILED (reproduce +0.10, end min(0.1, 0.5) = 0.1),
    # not RESOLVED (which would end at 1.0)
    assert step_values(trajectory([REPRODUCE, DONE], 0.0), client_or_engine=estimator) == {0: 0.4, 1: 0.5, 2: 0.1}
    # an answer cut short is unparseable: None, not an error
    assert step_values(FAILED, client_or_engine=estimator, max_tokens=20) is None


async def test_hindsight_values_ask_for_the_failed_trajectories_only(tokenizer):
    import copy

    def with_samples(traj, reward, termination="done"):
        t = copy.deepcopy(traj)
        t.reward, t.termination_reason, t.samples = reward, termination, ["a sample"]
        return t

    failed, zero = with_samples(FAILED, -1.0), with_samples(FAILED, 0.0)  # 0 is no resolution
    resolved = with_samples(RESOLVED, 1.0)  # trains whole: needs no values
    dead = with_samples(FAILED, None, "env_error")  # no verdict: not a failure
    bare = copy.deepcopy(FAILED)  # no samples: trains on nothing
    asked = []

    class Counted(ScriptedValueEstimator):
        async def generate(self, requests):
            asked.extend(requests)
            return await super().generate(requests)

    values = await hindsight_values([failed, resolved, dead, bare, zero], tokenizer, estimator=Counted(tokenizer))
    assert set(values) == {id(failed), id(zero)} and len(asked) == 2
    assert values[id(failed)] == values_of(FAILED)
    # by default the scripted estimator answers, in process
    assert await hindsight_values([failed], tokenizer) == {id(failed): values_of(FAILED)}


async def test_step_values_inside_an_event_loop(tokenizer):
    estimator = ScriptedValueEstimator(tokenizer)
    assert await step_values_async(RESOLVED, client_or_engine=estimator) == values_of(RESOLVED)
    # the sync form, as sft_samples calls it from a recipe's coroutine, runs on a thread of its own
    assert step_values(RESOLVED, client_or_engine=estimator) == values_of(RESOLVED)


def test_step_values_by_url_against_a_server(tokenizer):
    app = build_app(ScriptedValueEstimator(tokenizer), tokenizer, model_name="value-teacher")
    with serve_in_thread(app) as url:
        assert step_values(FAILED, client_or_engine=url, model="value-teacher") == values_of(FAILED)
        assert step_values(RESOLVED, client_or_engine=url + "/v1", model="value-teacher") == values_of(RESOLVED)
        # the values feed credit-assigned SFT: the failed trajectory is supervised on its run, steps 0-1 only
        failed = trajectory([REPRODUCE, OPEN, WRONG_FIX, PASS, WRONG_FIX, FAIL, DONE], -1.0)
        failed.samples = [render_trajectory(failed, tokenizer)]
        samples, stats = sft_samples([failed], mode="credit",
                                     step_values=functools.partial(step_values, client_or_engine=url, model="value-teacher"))
        assert stats["sft/credit_trajectories"] == 1 and stats["sft/credit_steps"] == 2
        (sample,) = samples
        supervised = set(sample.turn_index[sample.action_mask].tolist())
        assert supervised == {0, 1}


def test_unreadable_answer_by_url_is_none(tokenizer):
    app = build_app(ScriptedEngine(tokenizer, lambda prompt: "The agent did fine, I think."), tokenizer)
    with serve_in_thread(app) as url:
        assert step_values(FAILED, client_or_engine=url) is None


def test_bad_arguments(tokenizer):
    estimator = ScriptedValueEstimator(tokenizer)
    with pytest.raises(ValueError, match="trajectory"):
        step_values(FAILED.openai_messages(), client_or_engine=estimator)
    with pytest.raises(ValueError, match="reward"):
        step_values(trajectory([DONE], None), client_or_engine=estimator)
    with pytest.raises(ValueError, match="client_or_engine"):
        step_values(FAILED, client_or_engine="localhost:8000")
    with pytest.raises(ValueError, match="client_or_engine"):
        step_values(FAILED, client_or_engine=42)
    with pytest.raises(ValueError, match="max_tokens"):
        step_values(FAILED, client_or_engine=estimator, max_tokens=0)
    with pytest.raises(ValueError, match="tokenizer"):
        step_values(FAILED, client_or_engine=estimator, tokenizer=object())
    with pytest.raises(ValueError, match="prompt_text"):
        estimate_values_text("Rate this trajectory.")
    with pytest.raises(ValueError, match="tokenizer"):
        ScriptedValueEstimator(object())
