"""Parsing tool calls out of generated text.

Our chat template (and Hermes / Qwen models) write a tool call as::

    <tool_call>
    {"name": "exec", "arguments": {"command": "ls"}}
    </tool_call>

after the turn's text content, one block per call. `parse_tool_calls` never raises on model output: every block
that is not a JSON object with a string ``name`` and object ``arguments`` becomes an entry in ``errors`` (the agent
loop turns those into an error observation and counts them as format errors).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from orchard.data import ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass
class ParsedOutput:
    """One assistant output split into text and tool calls.

    Fields:
        content: the text outside the tool-call blocks: the text before the first block (minus the one newline
            the template puts between content and a call), then any non-blank text after blocks, joined by a
            newline.
        tool_calls: the well-formed calls, in order, with ``arguments`` as a JSON string (the OpenAI form, and
            what our template re-renders unchanged) and ``id`` ``call_{index}`` (index among all blocks).
        errors: one message per malformed block (bad JSON, missing or non-string name, non-object arguments,
            an unclosed or stray tag).
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _parse_block(body: str, index: int) -> tuple[ToolCall | None, str | None]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"tool call {index}: invalid JSON ({exc.msg} at char {exc.pos})"
    if not isinstance(obj, dict):
        return None, f"tool call {index}: expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f"tool call {index}: 'name' must be a non-empty string, got {name!r}"
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return None, f"tool call {index} ({name}): arguments string is not JSON ({exc.msg})"
    if not isinstance(arguments, dict):
        return (
            None,
            f"tool call {index} ({name}): 'arguments' must be an object, got {type(arguments).__name__}",
        )
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False), id=f"call_{index}"), None


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split generated text into content, well-formed tool calls and format errors (never raises on content).

    Args:
        text: the decoded assistant output, without the end-of-turn token.

    Returns:
        A `ParsedOutput`. Text without any ``<tool_call>`` tag is all content with no calls and no errors.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    calls: list[ToolCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    pos = 0
    index = 0
    for match in _BLOCK.finditer(text):
        pieces.append(text[pos : match.start()])
        call, error = _parse_block(match.group(1).strip(), index)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error or f"tool call {index}: malformed")
        index += 1
        pos = match.end()
    rest = text[pos:]
    if TOOL_CALL_OPEN in rest:
        errors.append(f"tool call {index}: '{TOOL_CALL_OPEN}' without a closing '{TOOL_CALL_CLOSE}'")
        rest = rest[: rest.index(TOOL_CALL_OPEN)]
    pieces.append(rest)
    for i, piece in enumerate(pieces):
        if TOOL_CALL_CLOSE in piece:
            errors.append(f"a stray '{TOOL_CALL_CLOSE}' without an opening '{TOOL_CALL_OPEN}'")
            pieces[i] = piece.replace(TOOL_CALL_CLOSE, "")
    head = pieces[0]
    if index > 0 and head.endswith("\n"):
        head = head[:-1]
    tail = [p.strip() for p in pieces[1:] if p.strip()]
    content = "\n".join([head, *tail]) if tail else head
    return ParsedOutput(content=content, tool_calls=calls, errors=errors)


def render_tool_call_text(call: ToolCall) -> str:
    """The block our template writes for one call (what a well-formatted model emits)."""
    return f'{TOOL_CALL_OPEN}\n{{"name": "{call.name}", "arguments": {call.arguments_json()}}}\n{TOOL_CALL_CLOSE}'
