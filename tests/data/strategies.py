"""Hypothesis strategies for trajectories with every schema feature (shared by the data tests)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from orchard.data import TERMINATION_REASONS, Message, ToolCall, Trajectory

# Text with the characters that stress JSON escaping and byte-level tokenizers.
text = st.text(alphabet=st.sampled_from(list("ab xyz\n\t{}\":,\\é中🙂0123")), max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
logprob = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)
json_leaf = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | finite | text
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
json_object = st.dictionaries(text, json_value, max_size=3)


@st.composite
def tool_calls(draw):
    name = draw(st.sampled_from(["exec", "read_file", "click"]))
    args = draw(
        st.one_of(
            json_object,
            json_object.map(json.dumps),
            st.just('{"command": "ls"'),  # a malformed string is kept as given
        )
    )
    call_id = draw(st.none() | st.text(alphabet="abc123_", min_size=1, max_size=6))
    return ToolCall(name=name, arguments=args, id=call_id)


@st.composite
def messages(draw, role):
    if role == "assistant":
        calls = draw(st.lists(tool_calls(), max_size=2))
        content = draw(st.none() | text) if calls else draw(text)
        ids = draw(st.none() | st.lists(st.integers(0, 600), min_size=1, max_size=6))
        lps = None if ids is None else draw(st.none() | st.lists(logprob, min_size=len(ids), max_size=len(ids)))
        return Message(role="assistant", content=content, tool_calls=calls, token_ids=ids, logprobs=lps)
    if role == "tool":
        return Message(role="tool", content=draw(text), tool_call_id=draw(st.none() | text), name=draw(st.none() | text))
    return Message(role=role, content=draw(text))


@st.composite
def trajectories(draw):
    roles = ["system", "user", *draw(st.lists(st.sampled_from(["assistant", "tool", "user"]), max_size=5))]
    return Trajectory(
        messages=[draw(messages(r)) for r in roles],
        tools=draw(st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": json_object}), max_size=2)),
        reward=draw(st.none() | finite),
        reward_components=draw(st.dictionaries(text, finite, max_size=2)),
        task_id=draw(st.none() | text),
        group_id=draw(st.none() | text),
        termination_reason=draw(st.sampled_from(TERMINATION_REASONS)),
        metadata=draw(json_object),
    )
