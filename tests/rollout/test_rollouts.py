"""AgentLoopRollouts: the in-process harness path of the one Rollouts interface, against real sandboxes."""

import asyncio
import json

import pytest
import torch

from orchard.data import RolloutGroup, render_trajectory
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout import AgentLoopRollouts, Rollouts
from orchard.rollout.harness import ShellHarness
from orchard.rollout.scripted import ScriptedEngine

FAST = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)


def exec_call(command):
    return f'<tool_call>\n{{"name": "exec", "arguments": {json.dumps({"command": command})}}}\n</tool_call>'


@pytest.fixture(scope="module")
def service():
    with serve() as svc:
        yield svc


def test_trajectories_come_task_major_with_their_samples(service, tokenizer):
    # Task "a" writes the file its check wants (reward 1), task "b" does not (reward 0): 2 tasks x 2 episodes.
    def answer(text):
        if "<|im_start|>tool" in text:
            return "Done."
        return exec_call("echo hi > out.txt" if "Task a" in text else "true")

    tasks = [{"id": "a", "prompt": "Task a", "check": "grep -qx hi out.txt"},
             {"id": "b", "prompt": "Task b", "check": "grep -qx hi out.txt"}]

    async def main():
        async with AsyncSandboxClient(service.url, service.api_key, retry=FAST) as client:
            rollouts = AgentLoopRollouts(client, ShellHarness(), tokenizer, max_tokens=64, seed=0,
                                         start_jitter_s=0.0)
            assert isinstance(rollouts, Rollouts)
            return await rollouts(ScriptedEngine(tokenizer, answer), tasks, group_size=2, temperature=1.0)

    trajectories = asyncio.run(main())
    assert [t.task_id for t in trajectories] == ["a", "a", "b", "b"]
    assert [t.reward for t in trajectories] == [1.0, 1.0, 0.0, 0.0]
    for traj in trajectories:
        # One rendered sample per scored trajectory, equal to rendering it again, with the sampled ids as actions.
        [sample] = traj.samples
        again = render_trajectory(traj, tokenizer)
        assert torch.equal(sample.input_ids, again.input_ids) and torch.equal(sample.action_mask, again.action_mask)
        assert sample.action_mask.any()
    groups = [RolloutGroup(t, tuple(trajectories[2 * i:2 * i + 2])) for i, t in enumerate("ab")]
    assert [g.rewards_N.tolist() for g in groups] == [[1.0, 1.0], [0.0, 0.0]]


def test_rejects_arguments_the_call_owns(tokenizer):
    with pytest.raises(ValueError, match="sampling"):
        AgentLoopRollouts(object(), ShellHarness(), tokenizer, sampling=None)
    with pytest.raises(ValueError, match="max_tokens"):
        AgentLoopRollouts(object(), ShellHarness(), tokenizer, max_tokens=0)
