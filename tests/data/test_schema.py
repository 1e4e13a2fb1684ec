import json
import math

import pytest
from hypothesis import given, settings

from orchard.data import TERMINATION_REASONS, Message, ToolCall, Trajectory

from .strategies import trajectories


def _example() -> Trajectory:
    return Trajectory(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "exec", "arguments": {"command": "ls"}}},
                    {"id": "c2", "type": "function", "function": {"name": "exec", "arguments": '{"command": "pwd"}'}},
                ],
                "token_ids": [5, 6, 2],
                "logprobs": [-0.25, -1.0 / 3.0, -0.0],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "exec", "content": "a.txt"},
            {"role": "tool", "tool_call_id": "c2", "name": "exec", "content": "/w"},
            {"role": "assistant", "content": "done", "token_ids": [7, 2]},
        ],
        tools=[{"type": "function", "function": {"name": "exec", "parameters": {"type": "object"}}}],
        reward=0.1 + 0.2,  # 0.30000000000000004: must survive bit for bit
        reward_components={"tests": 1.0, "length": -0.5},
        task_id="t1",
        group_id="g1",
        termination_reason="step_budget",
        metadata={"site": "mail", "nested": {"a": [1, 2.5, None, "é"]}},
    )


def test_dict_and_json_round_trip_exact():
    traj = _example()
    again = Trajectory.from_json(traj.to_json())
    assert again == traj
    assert again.to_json() == traj.to_json()
    assert again.reward == 0.1 + 0.2
    assert math.copysign(1.0, again.messages[2].logprobs[2]) == -1.0  # -0.0 keeps its sign
    # The dict form is OpenAI-shaped: the tool-call arguments keep their original form (dict vs string).
    d = traj.to_dict()
    calls = d["messages"][2]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"command": "ls"}
    assert calls[1]["function"]["arguments"] == '{"command": "pwd"}'
    assert "token_ids" not in traj.openai_messages()[2]


@settings(max_examples=60, deadline=None)
@given(trajectories())
def test_round_trip_property(traj):
    text = traj.to_json()
    again = Trajectory.from_json(text)
    assert again == traj
    assert again.to_json() == text
    assert json.loads(text) == traj.to_dict()


def test_tool_call_arguments_dict_and_string_normalise_alike():
    as_dict = ToolCall(name="exec", arguments={"command": "ls", "n": 2})
    as_str = ToolCall.from_dict({"function": {"name": "exec", "arguments": '{"command": "ls", "n": 2}'}})
    flat = ToolCall.from_dict({"id": "x", "name": "exec", "arguments": {"command": "ls", "n": 2}})
    assert as_dict.arguments_dict() == as_str.arguments_dict() == flat.arguments_dict() == {"command": "ls", "n": 2}
    assert json.loads(as_dict.arguments_json()) == json.loads(as_str.arguments_json())
    assert as_str.arguments_json() == '{"command": "ls", "n": 2}'  # the original string, untouched
    assert ToolCall.from_dict({"function": {"name": "f", "arguments": None}}).arguments_dict() == {}


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [('{"command": "ls"', "not valid JSON"), ("[1, 2]", "JSON object, got list"), ("3", "JSON object, got int")],
)
def test_tool_call_unparseable_arguments(arguments, reason):
    call = ToolCall(name="exec", arguments=arguments, id="c")
    parsed, why = call.parse_arguments()
    assert parsed is None and reason in why
    with pytest.raises(ValueError, match="tool call 'exec'"):
        call.arguments_dict()
    assert call.arguments_json() == arguments


def test_helpers():
    traj = _example()
    assert traj.num_steps == 2
    assert traj.assistant_indices == [2, 5]
    assert traj.num_tool_calls == 2
    assert traj.has_token_ids
    assert traj.num_sampled_tokens == 5  # 3 + 2
    assert not traj.is_env_error
    assert Trajectory(termination_reason="env_error").is_env_error
    assert not Trajectory(messages=[{"role": "user", "content": "x"}]).has_token_ids
    assert Message(role="assistant", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]).text == "ab"
    assert Message(role="assistant").text == ""
    assert set(TERMINATION_REASONS) == {"done", "step_budget", "time_budget", "format_error", "env_error"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(role="robot", content="x"), "Message.role"),
        (dict(role="user", content=3), "Message.content"),
        (dict(role="user", content="x", token_ids=[1]), "only allowed on assistant"),
        (dict(role="tool", content="x", tool_calls=[{"name": "f"}]), "tool_calls is only allowed"),
        (dict(role="assistant", content="x", token_ids=[1, 2], logprobs=[-1.0]), "align 1:1"),
        (dict(role="assistant", content="x", logprobs=[-1.0]), "without token_ids"),
        (dict(role="assistant", content="x", token_ids=[1, -2]), "non-negative ints"),
        (dict(role="assistant", content="x", token_ids=[1, True]), "non-negative ints"),
        (dict(role="assistant", content="x", token_ids=[1], logprobs=[float("nan")]), r"logprobs\[0\]"),
        (dict(role="assistant", tool_calls=[{"function": {"arguments": "{}"}}]), "no function name"),
        (dict(role="assistant", tool_calls=[{"function": {"name": "f", "arguments": 3}}]), "ToolCall.arguments"),
    ],
)
def test_message_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Message(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(termination_reason="timeout"), "termination_reason must be one of"),
        (dict(reward=float("inf")), "Trajectory.reward"),
        (dict(reward="1"), "Trajectory.reward"),
        (dict(reward=True), "Trajectory.reward"),
        (dict(reward_components={"a": float("nan")}), "reward_components"),
        (dict(task_id=3), "task_id"),
        (dict(tools=["exec"]), "Trajectory.tools"),
        (dict(metadata=[1]), "Trajectory.metadata"),
        (dict(messages="hi"), "Trajectory.messages"),
    ],
)
def test_trajectory_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Trajectory(**kwargs)


def test_from_dict_rejects_unknown_keys_and_bad_shapes():
    with pytest.raises(ValueError, match="unknown keys"):
        Trajectory.from_dict({"messages": [], "rewrd": 1.0})
    with pytest.raises(ValueError, match="unknown keys"):
        Message.from_dict({"role": "user", "content": "x", "contnet": "y"})
    with pytest.raises(ValueError, match="no role"):
        Message.from_dict({"content": "x"})
    with pytest.raises(ValueError, match="must be a mapping"):
        Trajectory.from_dict([])
    with pytest.raises(ValueError, match="must be a str"):
        Trajectory.from_json(b"{}")
    # Missing optional keys take their defaults.
    assert Trajectory.from_dict({}) == Trajectory()


def test_non_json_metadata_is_a_value_error():
    traj = Trajectory(metadata={"when": object()})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        traj.to_json()
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        Trajectory(metadata={"x": float("nan")}).to_json()


def _openai_dump(**kwargs) -> dict:
    """What the ``openai`` client hands back: ``message.model_dump()`` of its pydantic type (all keys, nulls too)."""
    from openai.types.chat import ChatCompletionMessage

    return ChatCompletionMessage(role="assistant", **kwargs).model_dump()


def test_openai_client_dumps_are_read_as_they_are():
    from openai.types.chat.chat_completion_message_function_tool_call import (
        ChatCompletionMessageFunctionToolCall,
        Function,
    )

    call = ChatCompletionMessageFunctionToolCall(
        id="call_1", type="function", function=Function(name="exec", arguments='{"command":"ls"}')
    )
    text = _openai_dump(content="hi")
    calls = _openai_dump(content=None, tool_calls=[call])
    assert {"refusal", "annotations", "audio", "function_call"} <= set(text)  # the keys the schema lacks
    traj = Trajectory(messages=[{"role": "user", "content": "go"}, text, calls])
    # The null keys are dropped; what the schema holds is kept, the arguments string untouched.
    assert traj.to_dict()["messages"][1:] == [
        {"role": "assistant", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "exec", "arguments": '{"command":"ls"}'}}
            ],
        },
    ]
    assert Trajectory.from_dict({"messages": [text]}) == Trajectory(messages=[{"role": "assistant", "content": "hi"}])
    # An empty annotations list carries nothing either.
    assert Message.from_dict(_openai_dump(content="hi", annotations=[])).content == "hi"


def test_openai_legacy_function_call_becomes_the_tool_call():
    from openai.types.chat.chat_completion_message import FunctionCall

    dump = _openai_dump(content=None, function_call=FunctionCall(name="exec", arguments='{"command": "ls"}'))
    msg = Message.from_dict(dump)
    assert msg.tool_calls == [ToolCall(name="exec", arguments='{"command": "ls"}', id=None)]
    both = dict(dump, tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}])
    with pytest.raises(ValueError, match="both 'function_call' and 'tool_calls'"):
        Message.from_dict(both)


def test_openai_fields_the_schema_cannot_keep_are_refused_by_name():
    from openai.types.chat import ChatCompletionAudio
    from openai.types.chat.chat_completion_message import Annotation, AnnotationURLCitation

    citation = Annotation(
        type="url_citation",
        url_citation=AnnotationURLCitation(end_index=2, start_index=0, title="t", url="https://example.org"),
    )
    audio = ChatCompletionAudio(id="a1", data="AAAA", expires_at=0, transcript="hi")
    cases = {"refusal": dict(refusal="I can't help with that."), "annotations": dict(annotations=[citation]),
             "audio": dict(audio=audio)}
    for key, kwargs in cases.items():
        dump = _openai_dump(content="x", **kwargs)
        # The message index and the field are both named: the user knows which turn of which dump to look at.
        with pytest.raises(ValueError, match=rf"messages\[1\]: message field '{key}' is not supported"):
            Trajectory(messages=[{"role": "user", "content": "q"}, dump])


def test_developer_role_is_read_as_system():
    traj = Trajectory.from_dict({"messages": [{"role": "developer", "content": "Be brief."}]})
    assert traj.messages == [Message(role="system", content="Be brief.")]
    assert Message(role="developer", content="x").role == "system"
    with pytest.raises(ValueError, match=r"or 'developer'.*got 'robot'"):
        Message(role="robot")


def test_tools_given_as_a_json_string():
    tools = [{"type": "function", "function": {"name": "exec", "parameters": {"type": "object"}}}]
    as_list = Trajectory(tools=tools)
    assert Trajectory(tools=json.dumps(tools)) == as_list
    assert Trajectory.from_dict({"tools": json.dumps(tools)}) == as_list
    with pytest.raises(ValueError, match=r"Trajectory\.tools is a str but not JSON"):
        Trajectory(tools='[{"type": ')
    with pytest.raises(ValueError, match=r"Trajectory\.tools must be a list of dicts"):
        Trajectory(tools='{"type": "function"}')  # one schema, not a list of them
