"""The SWE conventions (bash-action parsing, output truncation, observations) and the in-process evaluation
harness against the real embedded sandbox service: the teacher resolves one instance per level through it, and
malformed tool calls get error observations, then end the episode in format_error."""

import asyncio

import pytest

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe.convention import (
    SUBMIT_MARKER,
    bash_observation,
    is_submission,
    parse_bash_action,
    task_prompt,
    truncate_output,
)
from orchard.domains.swe.generator import make_instance
from orchard.domains.swe.harness import SWEEvalHarness
from orchard.domains.swe.teacher import SWETeacherEngine
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout import AgentLoopRollouts, ScriptedEngine


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def service():
    with serve() as svc:
        yield svc


@pytest.fixture(scope="module")
def instances():
    return [make_instance("ledger", 5, level=level) for level in (1, 2, 3)]


def sandbox_client(service):
    return AsyncSandboxClient(service.url, service.api_key,
                              retry=RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01))


def test_bash_action_takes_exactly_one_block():
    assert parse_bash_action("THOUGHT: look\n\n```bash\nls -la\n```").command == "ls -la"
    assert parse_bash_action("```bash\n  git diff  \n```\ntrailing words").command == "git diff"
    for text, count in (("I will list the files.", 0), ("```bash\nls\n```\n```bash\npwd\n```", 2),
                        ("```python\nprint(1)\n```", 0)):
        action = parse_bash_action(text)
        assert action.command is None and f"found {count} bash blocks" in action.error
    assert "empty" in parse_bash_action("```bash\n   \n```").error
    with pytest.raises(ValueError, match="text must be a str"):
        parse_bash_action(None)


def test_submission_is_the_marker_on_the_first_line_of_output():
    assert is_submission(f"{SUBMIT_MARKER}\n")
    assert is_submission(f"\n  {SUBMIT_MARKER}\ndiff --git a/x b/x\n")  # mini-swe-agent's submit-and-diff
    assert not is_submission(f"building\n{SUBMIT_MARKER}\n")  # a later line does not submit
    assert not is_submission("")


def test_truncation_keeps_head_and_tail():
    assert truncate_output("abcdef", 6) == "abcdef"  # fits: unchanged
    # 10 chars into 4: head 4 // 2 = 2 ("ab"), tail 4 - 2 = 2 ("ij"), 10 - 2 - 2 = 6 cut
    assert truncate_output("abcdefghij", 4) == "ab\n[... 6 characters cut ...]\nij"
    # odd bound 5: head 2, tail 3, 10 - 5 = 5 cut
    assert truncate_output("abcdefghij", 5) == "ab\n[... 5 characters cut ...]\nhij"
    with pytest.raises(ValueError, match="max_chars"):
        truncate_output("x", 1)
    # the observation cuts the output, not its frame
    assert bash_observation(1, "abcdefghij", max_chars=4) == (
        "<returncode>1</returncode>\n<output>\nab\n[... 6 characters cut ...]\nij</output>")
    with pytest.raises(ValueError, match="problem_statement"):
        task_prompt("  ")


def test_eval_harness_validates_arguments():
    for kwargs, name in (({"max_steps": 0}, "max_steps"), ({"exec_timeout_s": 0}, "exec_timeout_s"),
                         ({"max_output_chars": 1}, "max_output_chars"), ({"test_timeout_s": -1}, "test_timeout_s")):
        with pytest.raises(ValueError, match=name):
            SWEEvalHarness(**kwargs)


@pytest.mark.slow
def test_teacher_resolves_every_level_through_the_eval_harness(service, tokenizer, instances):
    teacher = SWETeacherEngine(tokenizer, instances, failure_rate=0.0)

    async def main():
        async with sandbox_client(service) as client:
            rollouts = AgentLoopRollouts(client, SWEEvalHarness(), tokenizer, max_tokens=4096, concurrency=3)
            return await rollouts(teacher, instances, group_size=1, temperature=0.0)

    trajectories = asyncio.run(main())
    for traj, instance in zip(trajectories, instances, strict=True):
        assert traj.task_id == instance.instance_id
        assert traj.termination_reason == "done" and traj.reward == 1.0, (traj.metadata, traj.messages[-2:])
        assert traj.reward_components["resolved"] == 1.0 and traj.reward_components["empty_patch"] == 0.0
        assert traj.metadata["tests"] == dict.fromkeys(instance.tests, True)
        assert traj.metadata["format_errors"] == 0 and len(traj.samples) == 1
        names = [c.name for m in traj.messages for c in m.tool_calls]
        # the unseen convention's names only: explore and reproduce and test with run_command, read, replace, done
        assert set(names) == {"run_command", "read_file", "replace_in_file", "done"} and names[-1] == "done"
    # level 3 (two places): two replacements, one per hunk of the gold patch
    assert [c.name for m in trajectories[2].messages for c in m.tool_calls].count("replace_in_file") == 2


@pytest.mark.slow
def test_malformed_calls_get_error_observations_then_format_error(service, tokenizer, instances):
    instance = instances[0]
    script = [
        # a well-formed call that fails is an observation, not a format error
        '<tool_call>\n{"name": "replace_in_file", "arguments": {"path": "ledger/account.py", "old": "no such '
        'text", "new": "x"}}\n</tool_call>',
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "edit_file", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "ledger/account.py", "start": "one"}}\n</tool_call>',
    ]

    async def main():
        async with sandbox_client(service) as client:
            rollouts = AgentLoopRollouts(client, SWEEvalHarness(), tokenizer)
            return await rollouts(ScriptedEngine(tokenizer, script), [instance], group_size=1, temperature=1.0)

    [traj] = asyncio.run(main())
    assert traj.termination_reason == "format_error" and traj.metadata["format_errors"] == 3
    # unresolved (nothing changed), scored -1: a format error is the policy's failure, not the environment's
    assert traj.reward == -1.0 and traj.valid and traj.reward_components["empty_patch"] == 1.0
    observations = [m.text for m in traj.messages if m.role == "tool"]
    assert len(observations) == 4 and all(o.startswith("Error: ") for o in observations)
    assert "did not appear" in observations[0] and "invalid JSON" in observations[1]
    assert "unknown tool 'edit_file'" in observations[2] and "start and end must be integers" in observations[3]
