import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.data import ToolCall
from orchard.rollout.tool_calls import ParsedOutput, parse_tool_calls, render_tool_call_text


def test_template_rendering_round_trips(tokenizer):
    calls = [
        {"type": "function", "function": {"name": "exec", "arguments": {"command": "ls -la", "timeout": 5}}},
        {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a b/ü.txt"}}},
    ]
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
    ]
    prompt = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    output = full[len(prompt) :].removesuffix("<|im_end|>\n")
    parsed = parse_tool_calls(output)
    assert parsed.errors == [] and parsed.content == "Let me look."
    assert [(c.name, c.arguments_dict(), c.id) for c in parsed.tool_calls] == [
        ("exec", {"command": "ls -la", "timeout": 5}, "call_0"),
        ("read_file", {"path": "a b/ü.txt"}, "call_1"),
    ]
    # re-rendering the parsed message reproduces the text exactly (no drift from parsing)
    again = {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": [c.to_dict() for c in parsed.tool_calls],
    }
    assert tokenizer.apply_chat_template([*msgs[:1], again], tokenize=False) == full


@settings(max_examples=60, deadline=None)
@given(
    content=st.text(st.characters(blacklist_characters="<>"), max_size=20),
    names=st.lists(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), max_size=3),
    value=st.one_of(st.integers(), st.text(max_size=10), st.booleans()),
)
def test_parse_inverts_render_property(content, names, value):
    calls = [ToolCall(name=n, arguments=json.dumps({"x": value, "i": i})) for i, n in enumerate(names)]
    text = content + ("\n" if content and calls else "") + "\n".join(render_tool_call_text(c) for c in calls)
    parsed = parse_tool_calls(text)
    assert parsed.errors == []
    assert [(c.name, c.arguments_dict()) for c in parsed.tool_calls] == [
        (c.name, c.arguments_dict()) for c in calls
    ]
    assert parsed.content == content


@pytest.mark.parametrize(
    ("text", "n_ok", "error"),
    [
        ('<tool_call>\n{"name": "exec", "arguments": {"command": "ls"}\n</tool_call>', 0, "invalid JSON"),
        ('<tool_call>\n["exec"]\n</tool_call>', 0, "expected a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 0, "'name'"),
        ('<tool_call>{"name": "exec", "arguments": [1]}</tool_call>', 0, "'arguments' must be an object"),
        ('<tool_call>{"name": "exec", "arguments": "{bad"}</tool_call>', 0, "arguments string is not JSON"),
        (
            '<tool_call>{"name": "exec", "arguments": {}}</tool_call>\n<tool_call>{"name": "x"',
            1,
            "without a closing",
        ),
        ("done</tool_call>", 0, "stray"),
    ],
)
def test_malformed_calls_become_errors_not_exceptions(text, n_ok, error):
    parsed = parse_tool_calls(text)
    assert len(parsed.tool_calls) == n_ok
    assert len(parsed.errors) == 1 and error in parsed.errors[0]


def test_double_encoded_arguments_and_plain_text():
    parsed = parse_tool_calls(
        'Checking.\n<tool_call>{"name": "exec", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>'
    )
    # The string-encoded arguments are decoded once and kept as the JSON string of the object; the one newline
    # between the content and the call belongs to the template; the first block is call_0.
    assert parsed == ParsedOutput(
        content="Checking.", tool_calls=[ToolCall(name="exec", arguments='{"command": "pwd"}', id="call_0")]
    )
    assert parse_tool_calls("just an answer\n") == ParsedOutput(content="just an answer\n")
    with pytest.raises(ValueError, match="text"):
        parse_tool_calls(None)


def test_public_names_resolve_lazily():
    import orchard.rollout as rollout

    for name in rollout.__all__:
        if name != "VLLMEngine":  # resolves too; constructing it needs vLLM
            assert getattr(rollout, name).__name__ == name
    with pytest.raises(AttributeError):
        rollout.NoSuchThing  # noqa: B018
