"""Monte-Carlo turn values against the embedded sandbox service: a finished shell episode is replayed, its
workspace snapshotted at each state, and scripted continuations forked from there are scored by the harness's check.

The episode: ``cat state.txt`` (state 1), ``echo fixed > state.txt`` (state 2), an answer without a call (state 3,
the end). The task's check passes when ``state.txt`` says ``fixed``. Every continuation appends a line to a marker
file, reads the count back, and stops: it never fixes anything itself, so a state's value is whether its
workspace already holds the fix (0, 0, 1, 1), and a count above 1 would show a workspace shared between forks."""

import asyncio
import json

import pytest
import torch

from orchard.data import Message, Trajectory
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.losses import credit_runs, interpolate_step_values, td_credit
from orchard.rollout import EnvironmentFailure, ShellHarness, TurnValueEstimator, step_value_lookup
from orchard.rollout.agent_loop import AgentLoop
from orchard.rollout.engine import SamplingParams
from orchard.rollout.scripted import ScriptedEngine

FAST = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
TASK = {"id": "fix", "prompt": "Make state.txt say fixed.", "files": {"state.txt": "broken\n"},
        "check": "grep -qx fixed state.txt"}
MARKER = "echo x >> marker.txt; wc -l < marker.txt"


def exec_call(command):
    return f'<tool_call>\n{{"name": "exec", "arguments": {json.dumps({"command": command})}}}\n</tool_call>'


@pytest.fixture(scope="module")
def service():
    with serve() as svc:
        yield svc


class FlakyHarness(ShellHarness):
    """A shell whose ``BOOM`` command fails as the environment would (a lost sandbox), and whose set-up can fail."""

    setup_fails = False

    async def setup(self, sandbox, task):
        if self.setup_fails:
            raise EnvironmentFailure("the image could not be pulled")
        return await super().setup(sandbox, task)

    async def act(self, sandbox, call, task):
        if "BOOM" in call.arguments_dict().get("command", ""):
            raise EnvironmentFailure("the sandbox died")
        return await super().act(sandbox, call, task)


def played(service, tokenizer, harness):
    """The finished episode, played through the same harness."""
    script = [exec_call("cat state.txt"), exec_call("echo fixed > state.txt"), "Fixed: state.txt says fixed."]

    async def main():
        async with AsyncSandboxClient(service.url, service.api_key, retry=FAST) as client:
            loop = AgentLoop(ScriptedEngine(tokenizer, script), client, harness, tokenizer, progress=False,
                             start_jitter_s=0.0, max_steps=6)
            return await loop.run(TASK)

    traj = asyncio.run(main())
    assert traj.termination_reason == "done" and traj.reward == 1.0 and traj.num_steps == 3
    return traj


def estimate(service, tokenizer, harness, engine, traj, **kwargs):
    states = kwargs.pop("states", None)

    async def main():
        async with AsyncSandboxClient(service.url, service.api_key, retry=FAST) as client:
            loop = AgentLoop(engine, client, harness, tokenizer, progress=False, start_jitter_s=0.0, max_steps=6,
                             concurrency=4, retry_backoff_s=0.01)
            values = await TurnValueEstimator(loop, keep_continuations=True, **kwargs).estimate(
                traj, TASK, states=states, seed=7)
            left = {s["sandbox_id"] for s in await client.list_sandboxes()}
            return values, left, await client.list_snapshots()

    return asyncio.run(main())


def marker_engine(tokenizer):
    def script(prompt):
        # the continuation's own turns come after the recorded prefix: its last assistant turn ran the marker
        last_turn = prompt.rsplit("<|im_start|>assistant", 2)
        return "Done." if len(last_turn) == 3 and MARKER in last_turn[1] else exec_call(MARKER)

    return ScriptedEngine(tokenizer, script, logprob=-0.5)


def test_values_follow_the_workspace_and_forks_are_isolated(service, tokenizer):
    harness = FlakyHarness(max_steps=6)
    traj = played(service, tokenizer, harness)
    values, left, snapshots = estimate(service, tokenizer, harness, marker_engine(tokenizer), traj, k=3)
    assert values.states == [0, 1, 2, 3] and values.error is None
    # states 0 and 1 hold the broken file: 0 of 3; state 2 holds the replayed fix: 3 of 3; state 3 is the end of an
    # episode that stopped itself, scored once as it is (terminal), its score in all 3 columns
    assert values.rewards.tolist() == [[0.0] * 3, [0.0] * 3, [1.0] * 3, [1.0] * 3]
    assert values.valid.all() and values.terminal == [False, False, False, True]
    assert values.step_values() == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0}
    # the interval of 3 of 3 at 95 %: [3 / (3 + 1.96²), 1] = [0.4385, 1]
    assert float(values.estimate.low[2]) == pytest.approx(0.4385, abs=1e-4) and float(values.estimate.high[2]) == 1
    # credit: V = 0, 0, 1, 1 -> c = 0, 1, 0: the fix (step 1) is the one run
    assert credit_runs(td_credit(interpolate_step_values(values.step_values(), 3)), eps=0.05) == [(1, 2)]
    # each of the 9 sampled continuations saw a marker file of one line: no fork shares a workspace with another,
    # with the replay sandbox, or with a snapshot another state's forks came from
    counts = []
    starts = [i for i, m in enumerate(traj.messages) if m.role == "assistant"]
    for state, row in enumerate(values.continuations[:3]):
        for c in row:
            # the continuation goes on from the recorded messages before step `state`
            assert c.metadata["prefix_steps"] == state and c.messages[: starts[state]] == traj.messages[: starts[state]]
            counts += [m.text.split("stdout:\n")[1].strip() for m in c.messages[starts[state]:] if m.role == "tool"]
    assert counts == ["1"] * 9
    # the terminal state sampled nothing: scored as it is
    [end] = [c for c in values.continuations[3] if c is not None]
    assert end.metadata["steps"] == 0 and end.messages == traj.messages
    # cost: 4 snapshots; 3 x 3 + 1 forks; the replay ran the 2 recorded calls up to state 2 (none after); 2 model
    # calls per sampled continuation (the marker, then the answer)
    cost = values.cost
    assert (cost["mc/states"], cost["mc/snapshots"], cost["mc/forks"], cost["mc/continuations"]) == (4, 4, 10, 10)
    assert (cost["mc/replayed_calls"], cost["mc/replay_mismatches"], cost["mc/env_errors"]) == (2, 0, 0)
    assert cost["mc/model_calls"] == 18 and cost["mc/sampled_tokens"] > 0 and cost["mc/prompt_tokens"] > 0
    sampled = sum(len(m.token_ids) for state, row in enumerate(values.continuations[:3]) for c in row
                  for m in c.messages[starts[state]:] if m.role == "assistant")
    assert cost["mc/sampled_tokens"] == sampled
    assert left == set() and snapshots == []  # every fork, the replay sandbox and every snapshot are gone
    # the values feed credit-assigned SFT as hindsight values do
    lookup = step_value_lookup([traj], [values])
    assert lookup(traj) == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0} and lookup(end) is None  # not one of the valued


def test_a_lost_continuation_is_dropped_not_scored_zero(service, tokenizer):
    harness = FlakyHarness(max_steps=6)
    traj = played(service, tokenizer, harness)
    calls = []

    def script(prompt):
        calls.append(prompt)
        return exec_call("BOOM") if len(calls) == 1 else "Done."  # the first continuation's sandbox dies

    values, left, _ = estimate(service, tokenizer, harness, ScriptedEngine(tokenizer, script), traj, k=3,
                               states=[2])
    # which of the 3 concurrent continuations asked first is not fixed: one of them is lost
    assert values.states == [2] and sorted(values.valid.tolist()[0]) == [False, True, True]
    # 2 valid continuations, both resolved: 2 / 2 = 1, not 2 / 3
    assert values.step_values() == {2: 1.0} and values.estimate.counts.tolist() == [2]
    assert values.cost["mc/env_errors"] == 1 and torch.isnan(values.rewards[~values.valid]).all()
    assert left == set()


def test_a_failed_replay_values_nothing(service, tokenizer):
    harness = FlakyHarness(max_steps=6)
    traj = played(service, tokenizer, harness)
    harness.setup_fails = True
    values, left, snapshots = estimate(service, tokenizer, harness, marker_engine(tokenizer), traj, k=2,
                                       states=[0, 2])
    assert "setup" in values.error and "could not be pulled" in values.error
    assert not values.valid.any() and values.step_values() == {} and values.cost["mc/forks"] == 0
    assert values.estimate.values.tolist() == [0.5, 0.5] and values.estimate.valued.tolist() == [False, False]
    assert step_value_lookup([traj], [values])(traj) is None  # unvalued, as an unreadable hindsight answer
    assert left == set() and snapshots == []


class SeedRecordingEngine(ScriptedEngine):
    """Answers "Done." and keeps the seed of every request."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, lambda prompt: "Done.")
        self.seeds = []

    async def generate(self, requests):
        self.seeds += [r.params.seed for r in requests]
        return await super().generate(requests)


def test_continuations_are_seeded_apart(service, tokenizer):
    # the loop's sampling seed would give every continuation the same seed; each gets derive_seed(., t, j) instead
    harness = ShellHarness(max_steps=6)
    traj = played(service, tokenizer, harness)
    engine = SeedRecordingEngine(tokenizer)

    async def main():
        async with AsyncSandboxClient(service.url, service.api_key, retry=FAST) as client:
            loop = AgentLoop(engine, client, harness, tokenizer, progress=False, start_jitter_s=0.0,
                             sampling=SamplingParams(max_tokens=64, seed=5))
            return await TurnValueEstimator(loop, k=3).estimate_many([traj, traj], [TASK, TASK], states=[[1], [1]])

    first, second = asyncio.run(main())
    assert first.step_values() == second.step_values() == {1: 0.0}
    assert len(engine.seeds) == 6 and len(set(engine.seeds)) == 6  # 2 trajectories x 3 continuations, all apart


class OffScaleHarness(ShellHarness):
    """Rewards of 2 for a solved task: not a success rate."""

    async def evaluate(self, sandbox, task, trajectory):
        reward = await super().evaluate(sandbox, task, trajectory)
        return 2.0 * reward[0]


def test_rewards_off_the_success_scale_need_a_map(service, tokenizer):
    harness = OffScaleHarness(max_steps=6)
    script = [exec_call("echo fixed > state.txt"), "Fixed."]

    async def main(success):
        async with AsyncSandboxClient(service.url, service.api_key, retry=FAST) as client:
            loop = AgentLoop(ScriptedEngine(tokenizer, script), client, harness, tokenizer, progress=False,
                             start_jitter_s=0.0, max_steps=6)
            episode = await loop.run(TASK)
            loop.engine = ScriptedEngine(tokenizer, lambda prompt: "Done.")
            try:
                return await TurnValueEstimator(loop, k=2, success=success).estimate(episode, TASK, states=[1])
            finally:
                assert await client.list_sandboxes() == [] and await client.list_snapshots() == []

    with pytest.raises(ValueError, match=r"success must map rewards into \[0, 1\], got 2.0.*pass success="):
        asyncio.run(main(None))
    values = asyncio.run(main(lambda reward: float(reward > 1)))
    assert values.step_values() == {1: 1.0}


def test_arguments_are_checked(service, tokenizer):
    harness = ShellHarness()
    loop = AgentLoop(ScriptedEngine(tokenizer, ["x"]), AsyncSandboxClient(service.url, service.api_key), harness,
                     tokenizer, progress=False)
    for kwargs, match in (({"k": 0}, "k must"), ({"horizon": 0}, "horizon"), ({"confidence": 1.5}, "confidence"),
                          ({"success": 1}, "success")):
        with pytest.raises(ValueError, match=match):
            TurnValueEstimator(loop, **kwargs)
    with pytest.raises(ValueError, match="loop must be an AgentLoop"):
        TurnValueEstimator(object())
    traj = Trajectory(messages=[Message("user", "hi"), Message("assistant", "done")], reward=2.0)
    estimator = TurnValueEstimator(loop)
    for states, match in (([2], r"\[0, 1\]"), ([True], "state indices"), ("01", "sequence")):
        with pytest.raises(ValueError, match=match):
            asyncio.run(estimator.estimate(traj, TASK, states=states))
    other = Trajectory(messages=traj.messages, tools=[{"type": "function", "function": {"name": "bash"}}])
    with pytest.raises(ValueError, match=r"played with the tools \['bash'\].*offers \['exec'\]"):
        asyncio.run(estimator.estimate(other, TASK))
    with pytest.raises(ValueError, match="trajectory must be a Trajectory"):
        asyncio.run(estimator.estimate({"messages": []}, TASK))
    with pytest.raises(ValueError, match="one entry per trajectory"):
        step_value_lookup([traj], [])
