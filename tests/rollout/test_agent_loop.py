"""Real rollouts: the agent loop against the embedded sandbox service (real sandboxes, real execs)."""

import asyncio
import json
import math
from types import SimpleNamespace

import pytest
import torch

from orchard.data import render_trajectory
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout.agent_loop import AgentLoop
from orchard.rollout.engine import SamplingParams
from orchard.rollout.harness import ShellHarness
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.scripted import ScriptedEngine

FAST = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)


@pytest.fixture(scope="module")
def service():
    with serve() as svc:  # a temporary root the sandboxes' uids can reach
        yield svc


def exec_call(command):
    return f'<tool_call>\n{{"name": "exec", "arguments": {json.dumps({"command": command})}}}\n</tool_call>'


class RecordingEngine:
    """Wraps an engine and keeps every prompt it was asked to continue."""

    def __init__(self, inner):
        self.inner, self.prompts = inner, []

    async def generate(self, requests):
        self.prompts.extend(list(r.prompt_ids) for r in requests)
        return await self.inner.generate(requests)

    async def update_weights(self, weights):
        await self.inner.update_weights(weights)

    async def close(self):
        await self.inner.close()


class GatedEngine(RecordingEngine):
    """Counts the ``generate`` calls in flight and holds each until ``width`` of them are in flight together.

    Only episodes that run at the same time can fill the gate: a loop that ran them one by one would wait at the
    first call until the gate's timeout (a model failure, hence an env_error) and never reach ``width``.
    """

    def __init__(self, inner, width, timeout_s=120.0):
        super().__init__(inner)
        self.width, self.timeout_s = width, timeout_s
        self.in_flight = self.peak = 0
        self.opened = None

    async def generate(self, requests):
        if self.opened is None:
            self.opened = asyncio.Event()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.in_flight >= self.width:
                self.opened.set()
            await asyncio.wait_for(self.opened.wait(), self.timeout_s)
            return await super().generate(requests)
        finally:
            self.in_flight -= 1


def run_loop(service, engine, harness, tokenizer, tasks, group_size=1, client_kwargs=None, **kwargs):
    async def main():
        async with AsyncSandboxClient(
            service.url, service.api_key, retry=FAST, **(client_kwargs or {})
        ) as client:
            loop = AgentLoop(
                engine, client, harness, tokenizer, progress=False, start_jitter_s=0.0, seed=0, **kwargs
            )
            return await loop.run_many(tasks, group_size=group_size)

    return asyncio.run(main())


def assert_no_drift(traj, prompts, tokenizer):
    """Each turn's prompt is exactly the trainer's rendering up to that turn's first action token."""
    sample = render_trajectory(traj, tokenizer)
    assert sample.report.ok, sample.report
    assistants = [m for m in traj.messages if m.role == "assistant"]
    assert len(prompts) == len(assistants)
    for k, (prompt, message) in enumerate(zip(prompts, assistants, strict=True)):
        start = int((sample.turn_index == k).nonzero()[0])
        assert sample.input_ids[:start].tolist() == prompt
        assert sample.input_ids[start : start + len(message.token_ids)].tolist() == message.token_ids
        assert sample.old_logprobs[start : start + len(message.token_ids)].tolist() == pytest.approx(
            message.logprobs
        )


def test_scripted_rollout_acts_in_a_real_sandbox(service, tokenizer):
    engine = RecordingEngine(
        ScriptedEngine(
            tokenizer,
            ["Writing.\n" + exec_call("echo hi > hello.txt"), exec_call("cat hello.txt a.txt"), "Done."],
        )
    )
    task = {
        "id": "t1",
        "prompt": "Write hi to hello.txt.",
        "files": {"a.txt": "from setup\n"},
        "check": "grep -qx hi hello.txt",
    }
    (traj,) = run_loop(service, engine, ShellHarness(), tokenizer, [task])
    assert (
        traj.termination_reason == "done" and traj.reward == 1.0 and traj.reward_components == {"check": 1.0}
    )
    assert (traj.task_id, traj.group_id) == ("t1", "t1")
    roles = [m.role for m in traj.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert traj.messages[5].content == "exit code: 0\nstdout:\nhi\nfrom setup\n"  # the sandbox really ran it
    assert (
        traj.metadata["format_errors"] == 0
        and traj.metadata["steps"] == 3
        and traj.metadata["tool_calls"] == 2
    )
    assert_no_drift(traj, engine.prompts, tokenizer)


def test_malformed_calls_are_counted_and_end_the_rollout(service, tokenizer):
    bad = [
        '<tool_call>\n{"name": "exec", "arguments": {"command": "ls"\n</tool_call>',  # invalid JSON
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # unknown tool
        '<tool_call>\n{"name": "exec", "arguments": {"cmd": "ls"}}\n</tool_call>',  # unusable arguments
    ]
    engine = RecordingEngine(ScriptedEngine(tokenizer, [bad[0], exec_call("true"), *bad]))
    (traj,) = run_loop(service, engine, ShellHarness(), tokenizer, [{"prompt": "go", "check": "true"}])
    # turn 1 errs, turn 2 is fine (resets the streak), turns 3-5 err three times in a row -> format_error
    assert traj.termination_reason == "format_error"
    assert traj.metadata["format_errors"] == 4 and traj.metadata["steps"] == 5
    errors = [m.content for m in traj.messages if m.role == "tool" and m.content.startswith("Error")]
    assert len(errors) == 4 and "invalid JSON" in errors[0] and "invalid JSON" in errors[1]
    assert "unknown tool 'rm_rf'" in errors[2] and "non-empty string 'command'" in errors[3]
    assert traj.reward == 1.0  # still scored: a format error is the policy's failure, not the environment's
    assert_no_drift(traj, engine.prompts, tokenizer)


def test_one_call_per_turn_makes_call_less_and_multi_call_turns_format_errors(service, tokenizer):
    two = exec_call("echo a > a.txt") + "\n" + exec_call("echo b > b.txt")
    script = ["I am done.", exec_call("true"), two, "no call", "still none"]
    engine = RecordingEngine(ScriptedEngine(tokenizer, script))
    task = {"prompt": "go", "check": "test ! -e a.txt && test ! -e b.txt"}
    (traj,) = run_loop(service, engine, ShellHarness(), tokenizer, [task], one_call_per_turn=True)
    # turn 1 (no call) errs instead of ending the rollout; turn 2 runs; turns 3-5 (two calls, none, none) err three
    # times in a row -> format_error after 5 steps, and neither call of turn 3 ran (the check passes)
    assert traj.termination_reason == "format_error"
    assert traj.metadata["format_errors"] == 4 and traj.metadata["steps"] == 5 and traj.metadata["tool_calls"] == 1
    assert traj.reward == 1.0
    errors = [m.content for m in traj.messages if m.role == "tool" and m.content.startswith("Error")]
    assert [e.count("exactly one tool call a turn is required") for e in errors] == [1, 1, 1, 1]
    assert "got 0" in errors[0] and "got 2" in errors[1]
    assert [m.tool_calls for m in traj.messages if m.role == "assistant"][2] == []  # kept as raw text
    assert_no_drift(traj, engine.prompts, tokenizer)


def test_require_tool_call_makes_call_less_turns_format_errors_and_runs_every_call(service, tokenizer):
    two = exec_call("echo a > a.txt") + "\n" + exec_call("echo b > b.txt")
    engine = RecordingEngine(ScriptedEngine(tokenizer, ["I am done.", two, "no call", "none", "still none"]))
    task = {"prompt": "go", "check": "test -e a.txt && test -e b.txt"}
    (traj,) = run_loop(service, engine, ShellHarness(), tokenizer, [task], require_tool_call=True)
    # turn 1 (no call) errs instead of ending the rollout; turn 2 runs both its calls (the check passes); turns 3-5
    # err three times in a row -> format_error after 5 steps
    assert traj.termination_reason == "format_error" and traj.reward == 1.0
    assert traj.metadata["format_errors"] == 4 and traj.metadata["steps"] == 5 and traj.metadata["tool_calls"] == 2
    errors = [m.content for m in traj.messages if m.role == "tool" and m.content.startswith("Error")]
    assert [e.count("a tool call a turn is required, got none") for e in errors] == [1, 1, 1, 1]
    assert_no_drift(traj, engine.prompts, tokenizer)
    with pytest.raises(ValueError, match="require_tool_call must be a bool"):
        AgentLoop(engine, SimpleNamespace(create=None), ShellHarness(), tokenizer, require_tool_call="yes")


class AnsweringShellHarness(ShellHarness):
    """A convention where only a tool ends the episode: a reply without a call is answered, not taken as done."""

    no_call_reply = "Call a tool."


def test_a_harness_no_call_reply_answers_call_less_turns_as_format_errors(service, tokenizer):
    script = ["Let me think.", exec_call("echo a > a.txt"), "no call", "none", "still none"]
    engine = RecordingEngine(ScriptedEngine(tokenizer, script))
    task = {"prompt": "go", "check": "test -e a.txt"}
    (traj,) = run_loop(service, engine, AnsweringShellHarness(), tokenizer, [task])
    # turn 1 (no call) is answered by the harness's user message and goes on; turn 2 runs; turns 3-5 are answered
    # three times in a row -> format_error after 5 steps (a plain ShellHarness would have ended at turn 1, done)
    assert traj.termination_reason == "format_error" and traj.reward == 1.0
    assert traj.metadata["format_errors"] == 4 and traj.metadata["steps"] == 5 and traj.metadata["tool_calls"] == 1
    assert [m.role for m in traj.messages[2:6]] == ["assistant", "user", "assistant", "tool"]
    assert [m.content for m in traj.messages if m.role == "user"][1:] == ["Call a tool."] * 4
    assert_no_drift(traj, engine.prompts, tokenizer)
    (plain,) = run_loop(service, ScriptedEngine(tokenizer, script), ShellHarness(), tokenizer, [task])
    assert plain.termination_reason == "done" and plain.metadata["steps"] == 1 and plain.reward == 0.0


def test_budgets(service, tokenizer):
    always = ScriptedEngine(tokenizer, lambda prompt: exec_call("true"))
    (traj,) = run_loop(service, always, ShellHarness(max_steps=2), tokenizer, [{"prompt": "go"}])
    assert traj.termination_reason == "step_budget" and traj.metadata["steps"] == 2 and traj.reward is None
    slow = ScriptedEngine(tokenizer, lambda prompt: exec_call("true"), delay_s=0.3)
    (traj,) = run_loop(service, slow, ShellHarness(), tokenizer, [{"prompt": "go"}], max_time_s=0.8)
    assert traj.termination_reason == "time_budget" and 1 <= traj.metadata["steps"] <= 3
    # the context is a budget too: the second prompt (first + the turn + its observation) is over the limit
    first = RecordingEngine(ScriptedEngine(tokenizer, lambda prompt: exec_call("true")))
    run_loop(service, first, ShellHarness(max_steps=1), tokenizer, [{"prompt": "go"}])
    limit = len(first.prompts[0]) + 5
    (traj,) = run_loop(
        service, always, ShellHarness(), tokenizer, [{"prompt": "go"}], max_prompt_tokens=limit
    )
    assert traj.termination_reason == "step_budget" and traj.metadata["context_exhausted"]
    assert traj.metadata["steps"] == 1
    # a turn cut by max_tokens: the template's end-of-turn token is context, and the prompt stays exact
    engine = RecordingEngine(ScriptedEngine(tokenizer, ["x" * 40, "ok"]))
    (traj,) = run_loop(
        service, engine, ShellHarness(), tokenizer, [{"prompt": "go"}], sampling=SamplingParams(max_tokens=3)
    )
    assert traj.metadata["cut_turns"] >= 1
    assert_no_drift(traj, engine.prompts, tokenizer)


def test_environment_failures_mark_env_error(service, tokenizer, tmp_path):
    # 1. the service is unreachable: creation fails after retries
    async def unreachable():
        async with AsyncSandboxClient("http://127.0.0.1:9", "k", retry=FAST) as client:
            loop = AgentLoop(
                ScriptedEngine(tokenizer, ["Done."]),
                client,
                ShellHarness(),
                tokenizer,
                progress=False,
                env_retries=1,
                retry_backoff_s=0.0,
            )
            return await loop.run({"id": "u", "prompt": "go", "check": "true"})

    traj = asyncio.run(unreachable())
    assert traj.termination_reason == "env_error" and traj.is_env_error and traj.reward is None
    assert traj.metadata["error"].startswith("create:")

    # 2. the sandbox dies mid-rollout (deleted behind the loop's back): the next exec fails -> env_error, unscored
    async def main():
        async with AsyncSandboxClient(service.url, service.api_key, retry=FAST) as client:

            class Killer(ScriptedEngine):
                """A scripted "model" that deletes every sandbox before answering with a tool call."""

                async def generate(self, requests):
                    for info in await client.list_sandboxes():
                        await (await client.sandbox(info["sandbox_id"])).delete()
                    return await super().generate(requests)

            loop = AgentLoop(
                Killer(tokenizer, [exec_call("ls")]), client, ShellHarness(), tokenizer, progress=False
            )
            return await loop.run({"prompt": "go", "check": "true"})

    traj = asyncio.run(main())
    assert traj.termination_reason == "env_error" and traj.reward is None
    assert traj.metadata["error"].startswith("tool exec:")

    # 3. a failing set-up command is an environment failure too
    (traj,) = run_loop(
        service,
        ScriptedEngine(tokenizer, ["Done."]),
        ShellHarness(),
        tokenizer,
        [{"prompt": "go", "setup": "exit 3"}],
    )
    assert traj.termination_reason == "env_error" and "setup" in traj.metadata["error"]

    # 4. an engine that keeps failing is an infrastructure failure: env_error after retries, never scored
    class Broken(ScriptedEngine):
        calls = 0

        async def generate(self, requests):
            Broken.calls += 1
            raise RuntimeError("CUDA error: out of memory")

    (traj,) = run_loop(
        service,
        Broken(tokenizer, []),
        ShellHarness(),
        tokenizer,
        [{"prompt": "go", "check": "true"}],
        model_retries=2,
        retry_backoff_s=0.0,
    )
    assert (
        traj.termination_reason == "env_error"
        and traj.metadata["error"].startswith("model:")
        and Broken.calls == 3
    )


def test_tiny_model_rollouts_run_concurrently(service, tokenizer, tiny_model):
    # Six episodes, at most four at once: the gate opens only once four model calls are in flight together.
    engine = GatedEngine(HFEngine(tiny_model, max_batch_size=8), width=4)
    tasks = [{"id": f"t{i}", "prompt": f"Task {i}: list the files.", "check": "true"} for i in range(3)]
    trajs = run_loop(
        service,
        engine,
        ShellHarness(max_steps=2),
        tokenizer,
        tasks,
        group_size=2,
        sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=None),
        concurrency=4,
    )
    assert [t.group_id for t in trajs] == ["t0", "t0", "t1", "t1", "t2", "t2"]
    # Four episodes overlapped, and never more than the loop's concurrency (one model call in flight per episode).
    assert engine.opened.is_set() and engine.peak == 4
    for traj in trajs:
        assert traj.termination_reason in ("done", "step_budget", "format_error")
        assert traj.has_token_ids and traj.reward == 1.0
        for m in traj.messages:
            if m.role == "assistant":
                assert len(m.logprobs) == len(m.token_ids) and all(
                    math.isfinite(x) and x <= 0 for x in m.logprobs
                )
        sample = render_trajectory(traj, tokenizer)
        # every prompt the engine saw for this trajectory is a prefix of its rendering (no drift)
        ids = sample.input_ids.tolist()
        starts = [int((sample.turn_index == k).nonzero()[0]) for k in range(traj.num_steps)]
        for start in starts:
            assert ids[:start] in engine.prompts
    assert torch.tensor([len(p) for p in engine.prompts]).min() > 0


def test_timeouts_end_the_rollout_on_python_310(service, tokenizer, python_310_timeouts):
    # Before the fix both waits caught the builtin TimeoutError, which 3.10's wait_for does not raise.
    # 1. the model call outlives the episode's 3 s (30 s delay; 3 s left < model_timeout_s 300, so the budget
    #    binds): time_budget; before, the 3.10 error fell to the engine-failure branch and, with no retry, gave
    #    env_error
    slow = RecordingEngine(ScriptedEngine(tokenizer, ["Done."], delay_s=30.0))
    (traj,) = run_loop(service, slow, ShellHarness(), tokenizer, [{"prompt": "go"}], max_time_s=3.0,
                       model_retries=0)
    assert len(slow.prompts) == 1  # the model was asked (the sandbox was ready within the 3 s)
    assert traj.termination_reason == "time_budget" and traj.metadata["model_calls"] == 0
    # 2. a tool call outlives env_timeout_s 3 s (sleep 30 < exec_timeout_s 60, and the 600 s budget is free): the
    #    environment failed, env_error and unscored; before, the 3.10 error escaped the rollout
    engine = ScriptedEngine(tokenizer, [exec_call("sleep 30"), "Done."])
    (traj,) = run_loop(service, engine, ShellHarness(exec_timeout_s=60), tokenizer,
                       [{"prompt": "go", "check": "true"}], env_timeout_s=3.0)
    assert traj.termination_reason == "env_error" and traj.reward is None
    assert traj.metadata["error"].startswith("tool exec: _Py310TimeoutError")
