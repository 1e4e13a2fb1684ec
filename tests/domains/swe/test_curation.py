"""The paper's SFT curation on SWE trajectories: each convention's unparseable replies are found, and the scripted
teacher's own turns (every attempt kind, both trained conventions) pass curation: no false positives."""

import pytest

from orchard.data import Message, Trajectory, check_tool_calls
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe.convention import TOOL_SCHEMAS, task_prompt, unparseable_actions
from orchard.domains.swe.generator import make_instance
from orchard.domains.swe.teacher import SWETeacherEngine
from orchard.rollout.server import chat_message


def conversation(replies, convention):
    """A trajectory of ``replies`` as the harness program records them: the server parses tool calls only in the
    tool convention (the bash one asks for ``tool_choice: none``); every reply is answered by an observation."""
    messages = [Message("user", "fix it")]
    for text in replies:
        reply, _ = chat_message(text, parse_tools=convention == "tool")
        messages.append(Message.from_dict(reply))
        calls = messages[-1].tool_calls
        messages += [Message("tool", "ok", tool_call_id=c.id, name=c.name) for c in calls] or [Message("user", "ok")]
    return Trajectory(messages=messages, tools=TOOL_SCHEMAS if convention == "tool" else [],
                      metadata={"harness": convention})


def test_unparseable_actions_of_each_convention():
    bash = conversation(["THOUGHT: look\n```bash\nls\n```",  # message 1: one block, parsed
                         "I think the bug is in the interest module.",  # 3: no block
                         "```bash\nls\n```\n```bash\npwd\n```",  # 5: two blocks
                         "```bash\n\n```"], "bash")  # 7: an empty block
    assert unparseable_actions(bash) == [3, 5, 7]
    call = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>'
    tool = conversation([call,  # message 1: a call (its tool message is 2)
                         "I think the bug is in the interest module.",  # 3: no call
                         '<tool_call>\n{"name": "execute_bash", "arguments": {"command": </tool_call>',  # 5: bad JSON
                         call], "tool")
    assert unparseable_actions(tool) == [3, 5]
    # The bad JSON stays as raw text: the generic check finds its tag as well; the no-call turn is the domain's.
    assert [(i.message_index, i.kind) for i in check_tool_calls(tool)] == [(5, "unparseable_call")]
    assert unparseable_actions(Trajectory(messages=tool.messages, metadata={"harness": "eval"})) == []
    with pytest.raises(ValueError, match="trajectory"):
        unparseable_actions({"messages": []})


def test_the_scripted_teachers_turns_pass_curation():
    tokenizer = build_chat_tokenizer()
    instances = [make_instance("ledger", 5, level=level) for level in (1, 2, 3)]
    teacher = SWETeacherEngine(tokenizer, instances)
    checked = set()
    for instance in instances:
        for kind in ["careful", *teacher.allowed_kinds(instance)]:
            steps = teacher.plan(instance, kind)
            for convention in ("bash", "tool"):
                traj = conversation([teacher.render(step, convention) for step in steps], convention)
                traj.messages[0] = Message("user", task_prompt(instance.problem_statement))
                assert traj.num_steps == len(steps)
                assert check_tool_calls(traj) == [], (instance.instance_id, kind, convention)
                assert unparseable_actions(traj) == [], (instance.instance_id, kind, convention)
                checked.add(kind)
    assert checked == {"careful", "wrong_file", "partial", "regression", "untested"}  # every attempt kind seen
