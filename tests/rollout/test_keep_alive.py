"""An episode's sandbox outlives the service's heartbeat timeout while the episode waits on something that touches
no sandbox (a slow policy's turn; a harness program that reaches its episode late): the agent loop, the harness-
program runner and Monte-Carlo replays keep the sandboxes they hold alive (`orchard.rollout.keep_alive`). Against a
real embedded service that reaps a sandbox idle for 1.5 s; each wait is 4 s (over 2.5 timeouts). Before the fix the
sandbox was reaped under the waiting episode, which then ended ``env_error`` ("404: Sandbox ... not found" at its
next exec or at scoring: seen in a SmolLM2 run whose model calls took minutes)."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout import (
    AgentLoop,
    HarnessProgram,
    ScriptedEngine,
    ShellHarness,
    keep_alive,
    run_program_episodes,
)
from orchard.rollout.program import read_episodes
from orchard.rollout.proxy import RecordingProxy

FAST = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
WAIT_S = 4.0


@pytest.fixture(scope="module")
def reaping_service():
    """A service that deletes a sandbox idle for 1.5 s (its reaper looks every 0.2 s)."""
    with serve(heartbeat_timeout_s=1.5, reap_interval_s=0.2) as svc:
        yield svc


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


class SlowEngine:
    """The scripted policy, each turn taking `WAIT_S` (a CPU model's long turn)."""

    def __init__(self, inner):
        self.inner = inner

    async def generate(self, requests):
        await asyncio.sleep(WAIT_S)
        return await self.inner.generate(requests)

    async def update_weights(self, weights):
        raise NotImplementedError

    async def close(self):
        return None


def test_a_slow_turn_does_not_lose_the_episodes_sandbox(reaping_service, tokenizer, sandbox_ids):
    call = '<tool_call>\n{"name": "exec", "arguments": {"command": "echo hi > a.txt"}}\n</tool_call>'
    engine = SlowEngine(ScriptedEngine(tokenizer, [call, "Done."]))
    task = {"prompt": "go", "check": "test -e a.txt"}

    async def main():
        async with AsyncSandboxClient(reaping_service.url, reaping_service.api_key, retry=FAST) as client:
            loop = AgentLoop(engine, client, ShellHarness(), tokenizer, progress=False, start_jitter_s=0.0)
            [traj] = await loop.run_many([task])
            return traj, await sandbox_ids(client)

    traj, left = asyncio.run(main())
    # two turns of 4 s each: the exec after the first and the check after the second found the sandbox
    assert traj.termination_reason == "done" and traj.reward == 1.0, traj.metadata.get("error")
    assert traj.metadata["tool_calls"] == 1 and left == set()


def test_episodes_a_program_reaches_late_keep_their_sandboxes(reaping_service, tokenizer, sandbox_ids):
    async def late_program(argv, env, timeout_s):
        # the program starts its episodes only after WAIT_S, as one with fewer workers than episodes would
        await asyncio.sleep(WAIT_S)
        with open(argv[argv.index("--out") + 1], "w") as out:
            for episode in read_episodes(argv[argv.index("--episodes") + 1]):
                out.write(json.dumps({
                    "session_id": episode["session_id"], "sandbox_id": episode["sandbox_id"],
                    "termination_reason": "done", "error": None, "steps": 1, "format_errors": 0, "tool_calls": 0,
                    "messages": [{"role": "user", "content": episode["prompt"]},
                                 {"role": "assistant", "content": "Done."}], "wall_s": 0.1}) + "\n")
        return 0, ""

    async def score(sandbox, task):
        result = await sandbox.exec(["true"])  # scoring needs the sandbox: a reaped one is a 404, env_error
        return SimpleNamespace(reward=1.0 if result.exit_code == 0 else -1.0, components={})

    async def main():
        async with AsyncSandboxClient(reaping_service.url, reaping_service.api_key, retry=FAST) as client:
            program = HarnessProgram(
                harness="late", run=late_program, key_env="ORCHARD_TEST_KEEP_ALIVE_KEY", task_id=lambda t: t,
                prompt=lambda t: f"task {t}", create=lambda task, session_id: client.create(),
                prepare=lambda sandbox, task: sandbox.exec(["true"]), prepare_timeout_s=60.0, score=score,
                score_timeout_s=60.0)
            proxy = RecordingProxy(ScriptedEngine(tokenizer, []), tokenizer)
            try:
                trajectories = await run_program_episodes(program, ["a", "b"], client=client, proxy=proxy,
                                                          group_size=2, run_id="keep-alive")
            finally:
                await proxy.aclose()
            return trajectories, await sandbox_ids(client)

    trajectories, left = asyncio.run(main())
    assert [(t.termination_reason, t.reward) for t in trajectories] == [("done", 1.0)] * 4, [
        t.metadata.get("error") for t in trajectories]
    assert left == set()


def test_keep_alive_leaves_a_sandbox_without_it_alone():
    keep_alive(SimpleNamespace())  # a test's fake sandbox: nothing to start, no error
    beats = []
    keep_alive(SimpleNamespace(keep_alive=lambda: beats.append(1)))
    assert beats == [1]
