"""The SWE harness program (tool and bash conventions) behind the recording proxy, against the real embedded sandbox
service: the scripted teacher resolves one instance per level in each convention, malformed replies get error
observations and end in format_error, and the proxy's samples equal rendering the recorded conversation; with a
sandbox that hangs (a fake), a command past the episode's deadline ends it in time_budget."""

import asyncio
import re

import pytest
import torch

from orchard.data import Message, Trajectory, merge_prefix_samples, render_turns, sequence_length
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe import tool_harness
from orchard.domains.swe.convention import unparseable_actions
from orchard.domains.swe.generator import make_instance
from orchard.domains.swe.harness import SWEToolHarness
from orchard.domains.swe.teacher import SWETeacherEngine
from orchard.domains.swe.tool_rollout import SWEBashRollouts, run_swe_episodes
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout import AgentLoopRollouts
from orchard.rollout.engine import Completion, GenerateResult
from orchard.rollout.proxy import RecordingProxy
from orchard.stages import curate_sft

MALFORMED = {
    "tool": ["I think the bug is in the interest module.",  # no tool call
             '<tool_call>\n{"name": "str_replace_editor", "arguments": {"command": "view"}}\n</tool_call>',  # no path
             '<tool_call>\n{"name": "open_file", "arguments": {"path": "/workspace"}}\n</tool_call>'],  # unknown tool
    "bash": ["I think the bug is in the interest module.",  # no block
             "```bash\nls\n```\n```bash\npwd\n```",  # two blocks
             "```bash\n\n```"],  # an empty block
}


class FaultyTeacher:
    """The scripted teacher, except on one issue, where it answers the convention's malformed replies in turn."""

    def __init__(self, teacher, tokenizer, malformed_issue, replies):
        self.teacher, self.tokenizer, self.issue, self.replies = teacher, tokenizer, malformed_issue, replies

    async def generate(self, requests):
        out = []
        for request in requests:
            text = self.tokenizer.decode(list(request.prompt_ids))
            if self.issue in text:
                done = text.count("<|im_start|>assistant\n") - 1
                ids = self.tokenizer.encode(self.replies[done % 3] + self.tokenizer.eos_token, add_special_tokens=False)
                out.append(GenerateResult(tuple(request.prompt_ids), [Completion(ids, [-0.5] * len(ids), "stop")]))
            else:
                out.extend(await self.teacher.generate([request]))
        return out

    async def update_weights(self, weights):
        raise NotImplementedError

    async def close(self):
        return None


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def batches(tokenizer):
    """Per convention, one batch: levels 1-3 by the teacher, then one instance answered with malformed replies.
    The tool batch goes through `run_swe_episodes` (per-call samples), the bash one through `SWEBashRollouts`; the
    same tool-convention replies once more in process (`SWEToolHarness` in the agent loop)."""
    solved = [make_instance("ledger", 5, level=level) for level in (1, 2, 3)]
    malformed = make_instance("ledger", 6, level=1)
    instances = [*solved, malformed]
    teacher = SWETeacherEngine(tokenizer, instances, failure_rate=0.0)

    async def main(service):
        retry = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
        async with AsyncSandboxClient(service.url, service.api_key, retry=retry) as client:
            out = {}
            engine = FaultyTeacher(teacher, tokenizer, malformed.problem_statement.strip(), MALFORMED["tool"])
            proxy = RecordingProxy(engine, tokenizer)
            try:
                out["tool"] = await run_swe_episodes(instances, client=client, proxy=proxy, convention="tool",
                                                     concurrency=4, temperature=0.0, max_tokens=4096)
            finally:
                await proxy.aclose()
            engine = FaultyTeacher(teacher, tokenizer, malformed.problem_statement.strip(), MALFORMED["bash"])
            out["bash"] = await SWEBashRollouts(client, tokenizer, concurrency=4)(
                engine, instances, group_size=1, temperature=0.0, max_tokens=4096)
            engine = FaultyTeacher(teacher, tokenizer, malformed.problem_statement.strip(), MALFORMED["tool"])
            out["in_process"] = await AgentLoopRollouts(client, SWEToolHarness(), tokenizer, concurrency=4)(
                engine, instances, group_size=1, temperature=0.0, max_tokens=4096)
            out["left"] = await client.list_sandboxes()
            return out

    with serve() as service:
        out = asyncio.run(main(service))
    return {**out, "solved": solved, "malformed": malformed}


@pytest.mark.slow
@pytest.mark.parametrize("convention", ["tool", "bash"])
def test_teacher_resolves_every_level_through_the_program(batches, convention):
    for traj, instance in zip(batches[convention], batches["solved"], strict=False):
        meta = traj.metadata
        assert traj.task_id == instance.instance_id and meta["harness"] == convention
        assert traj.termination_reason == "done", (meta["error"], [m.to_openai() for m in traj.messages[-2:]])
        assert traj.reward == 1.0 and traj.reward_components["resolved"] == 1.0, traj.reward_components
        assert meta["tests"] == dict.fromkeys(instance.tests, True) and meta["format_errors"] == 0
        assert meta["patch"].startswith("diff --git")
    assert batches["left"] == []  # every sandbox deleted


@pytest.mark.slow
def test_tool_convention_uses_openhands_tools(batches):
    traj = batches["tool"][2]  # level 3: two places
    names = [(c.name, c.arguments_dict().get("command")) for m in traj.messages for c in m.tool_calls]
    assert names[0] == ("str_replace_editor", "view") and names[-1] == ("finish", None)
    assert names.count(("str_replace_editor", "str_replace")) == 2 and ("execute_bash", None) not in names
    assert all(m.role == "tool" for m in traj.messages[3::2]), "every call answered by a tool message"


@pytest.mark.slow
def test_bash_convention_observes_in_user_messages_and_submits_with_the_marker(batches):
    traj = batches["bash"][0]
    assert traj.tools == [] and batches["tool"][0].tools and all(not m.tool_calls for m in traj.messages)
    observations = [m.text for m in traj.messages[2:] if m.role == "user"]
    assert observations and all(o.startswith("<returncode>") for o in observations)
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in observations[-1]


@pytest.mark.slow
@pytest.mark.parametrize("convention", ["tool", "bash"])
def test_malformed_replies_get_error_observations_then_format_error(batches, convention):
    traj = batches[convention][-1]
    assert traj.task_id == batches["malformed"].instance_id
    assert traj.termination_reason == "format_error" and traj.metadata["format_errors"] == 3
    assert traj.reward == -1.0 and traj.valid and traj.reward_components["empty_patch"] == 1.0
    observations = [m.text for m in traj.messages if m.role in ("user", "tool")][1:]
    assert len(observations) == 3, observations
    if convention == "tool":
        assert "no tool was called" in observations[0]
        assert "path must be a non-empty string" in observations[1] and "unknown tool 'open_file'" in observations[2]
    else:
        assert "found 0 bash blocks" in observations[0] and "found 2 bash blocks" in observations[1]
        assert "empty" in observations[2]


@pytest.mark.slow
def test_the_in_process_tool_harness_plays_the_programs_episodes(batches):
    # the same replies (the teacher's, then the malformed ones) through SWEToolHarness in the agent loop observe
    # exactly what the program observed, error answers included, and end and score alike: a trajectory the program
    # recorded replays in process call for call (Monte-Carlo turn values)
    def transcript(traj):  # a test run's timing ("7 passed in 0.05s") is the one text that may differ
        return [(m.role, re.sub(r" in [0-9.]+s\b", " in Ts", m.text) if m.role != "assistant" else None,
                 [(c.name, c.arguments_dict()) for c in m.tool_calls]) for m in traj.messages]

    for program, in_process in zip(batches["tool"], batches["in_process"], strict=True):
        assert transcript(in_process) == transcript(program), program.task_id
        assert in_process.tools == program.tools
        assert (in_process.termination_reason, in_process.reward, in_process.metadata["format_errors"]) == (
            program.termination_reason, program.reward, program.metadata["format_errors"])


@pytest.mark.slow
@pytest.mark.parametrize("convention", ["tool", "bash"])
def test_proxy_samples_equal_rendering_the_conversation(batches, tokenizer, convention):
    for traj in batches[convention]:
        # text only: the template's own ids of every assistant turn, rendered from the recorded conversation
        text_only = Trajectory(messages=[Message.from_dict(m.to_openai()) for m in traj.messages], tools=traj.tools)
        reference = render_turns(text_only, tokenizer)
        assert len(reference) == traj.metadata["steps"]
        if convention == "bash":  # SWEBashRollouts chains the per-call samples by prefix
            reference = merge_prefix_samples(reference)
        assert len(traj.samples) == len(reference), traj.task_id
        for got, want in zip(traj.samples, reference, strict=True):
            assert torch.equal(got.input_ids, want.input_ids), traj.task_id
            assert torch.equal(got.action_mask, want.action_mask), traj.task_id


@pytest.mark.slow
@pytest.mark.parametrize("convention", ["tool", "bash"])
def test_curation_keeps_the_teachers_episodes_and_drops_the_malformed_one(batches, convention):
    # levels 1-3 by the teacher are kept; the malformed episode (no call, a call without its required path, an
    # unknown tool / no block, two blocks, an empty block) is dropped as invalid
    kept, stats = curate_sft(batches[convention], unparseable=unparseable_actions)
    assert kept == batches[convention][:3]
    assert stats == {"sft/dropped_over_length": 0, "sft/dropped_invalid_calls": 1}
    longest = max(sequence_length(t) for t in kept)
    assert curate_sft(kept, max_len=longest)[0] == kept  # the limit is inclusive
    assert curate_sft(kept, max_len=longest - 1)[1]["sft/dropped_over_length"] >= 1


def test_a_sandbox_call_past_the_episode_deadline_is_time_budget_on_python_310(python_310_timeouts, episode_against_a_hanging_sandbox):
    # Before the fix the sandbox wait caught the builtin TimeoutError, which 3.10's wait_for does not raise: the
    # 3.10 error escaped the episode instead of ending it in time_budget.
    call = {"id": "c1", "type": "function", "function": {"name": "execute_bash", "arguments": '{"command": "ls"}'}}
    reply = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}
    # the episode has 1 s; the command's wait is min(1 s left, exec_timeout_s 60 + 30) = the time left
    settings = tool_harness.Settings(model_url="http://model", max_time_s=1.0, exec_timeout_s=60.0)
    episode = {"session_id": "e", "sandbox_id": "s", "prompt": "Fix the bug."}

    out = episode_against_a_hanging_sandbox(tool_harness, settings, episode, reply)
    assert (out["termination_reason"], out["steps"], out["error"]) == ("time_budget", 1, None)
