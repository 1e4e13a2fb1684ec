"""Hypothesis strategies for trajectories with every schema feature (shared by the data tests)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from orchard.data import TERMINATION_REASONS, Message, ToolCall, Trajectory

SPECIAL_TEXTS = (
    "<tool_call>",
    "</tool_call>",
    "<|im_end|>",
    "<|im_start|>",
    "<think>",
    "</think>",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "<|im_",
)
"""The chat format's markup as plain text, whole (a fake end of turn or generation prompt inside an observation
or a tool argument) and cut (``<|im_`` next to a template's ``<|im_end|>``)."""

CONTROL_CHARS = ("\x00", "\x1b", "\x7f", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029")
"""Control characters and the Unicode line and paragraph separators (``str.splitlines`` breaks at most of them,
JSON escapes some and not U+2028 / U+2029)."""

# Text with the characters that stress JSON escaping and byte-level tokenizers, and the chat markup as text.
text = st.lists(
    st.sampled_from([*"ab xyz\n\t{}\":,\\é中🙂0123<|>", *CONTROL_CHARS, *SPECIAL_TEXTS]), max_size=8
).map("".join)
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


@st.composite
def conversations(draw):
    """OpenAI chat dicts: system, user, then 1-4 assistant turns, each followed by a tool result per call (or a
    user turn when it made none); every content, observation, argument key and value is :data:`text`."""
    msgs = [{"role": "system", "content": draw(text)}, {"role": "user", "content": draw(text)}]
    for turn in range(draw(st.integers(1, 4))):
        calls = [
            {
                "id": f"c{turn}{j}",
                "type": "function",
                "function": {
                    "name": draw(st.sampled_from(["exec", "read_file"])),
                    "arguments": draw(
                        st.dictionaries(text, text, max_size=2)
                        | st.dictionaries(text, text, max_size=2).map(lambda a: json.dumps(a, ensure_ascii=False))
                    ),
                },
            }
            for j in range(draw(st.integers(0, 2)))
        ]
        msgs.append(
            {"role": "assistant", "content": draw(text | st.none()) if calls else draw(text), "tool_calls": calls}
        )
        for call in calls:
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": draw(text)})
        if not calls:
            msgs.append({"role": "user", "content": draw(text)})
    return msgs
