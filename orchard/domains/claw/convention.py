"""The Claw harness conventions without heavy imports: prompts, the tool command, the text-action format.

The separate text-harness program imports only this module, the world and the sandbox client, so it starts in
about a second (no torch). The in-process pieces (sandbox set-up, verification, the ReAct harness) are in
`orchard.domains.claw.harness`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from orchard.domains.claw import world

PYTHON = "python3"
"""The interpreter inside the sandbox (any image with a python3 on PATH hosts the world)."""

REACT_SYSTEM = "You are a personal assistant. Call one tool per turn; when the task is done, reply with a summary."

TEXT_SYSTEM = (
    "You are a personal assistant. Each turn write one line: 'Action: <tool> <json arguments>', "
    "or 'Final: <summary>' when the task is done.\nTools: "
    + "; ".join(f"{name} {{{', '.join(params)}}}" for name, (_, params) in world.TOOLS.items())
)

FINAL_TEXT = "Done."


def tool_command(name: str, arguments: dict[str, Any] | str) -> list[str]:
    """The sandbox argv that runs one tool call (arguments given as a dict or as the model's JSON string)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    payload = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return [PYTHON, "-I", "-S", ".claw/world.py", "call", name, payload]


_ACTION = re.compile(r"^\s*Action:\s*([A-Za-z_]\w*)\s*(\{.*\})?\s*$", re.S)
_FINAL = re.compile(r"^\s*Final:\s*(.*)$", re.S)


@dataclass(frozen=True)
class TextAction:
    """One parsed turn of the text harness: a tool call, a final answer, or a format error."""

    kind: str
    """'call', 'final' or 'error'."""
    name: str = ""
    arguments: dict[str, Any] | None = None
    text: str = ""
    """The final summary, or the error message."""


def format_text_action(name: str, arguments: dict[str, Any]) -> str:
    """The text harness's rendering of a tool call."""
    return f"Action: {name} {json.dumps(arguments)}"


def parse_text_action(text: str) -> TextAction:
    """Parse one assistant turn of the text harness; malformed output becomes ``kind='error'``, never an exception."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    final = _FINAL.match(text)
    if final:
        return TextAction("final", text=final.group(1).strip())
    match = _ACTION.match(text)
    if not match:
        return TextAction("error", text="expected 'Action: <tool> <json>' or 'Final: <summary>'")
    name, raw = match.group(1), match.group(2) or "{}"
    if name not in world.TOOLS:
        return TextAction("error", name=name, text=f"unknown tool {name!r}")
    try:
        arguments = json.loads(raw)
    except json.JSONDecodeError as exc:
        return TextAction("error", name=name, text=f"arguments are not JSON: {exc.msg}")
    if not isinstance(arguments, dict):
        return TextAction("error", name=name, text="arguments must be a JSON object")
    return TextAction("call", name=name, arguments=arguments)


class ToolProgramError(RuntimeError):
    """The in-sandbox world program itself failed (an environment failure, not a refused call)."""


async def run_tool(sandbox: Any, name: str, arguments: dict[str, Any], *, timeout: float = 30.0) -> str:
    """Run one tool call in the sandbox and return its observation. A refused call is an observation
    (``error: ...``) the policy must handle; a broken world program raises `ToolProgramError`."""
    result = await sandbox.exec(tool_command(name, arguments), timeout=timeout)
    if result.exit_code != 0:
        raise ToolProgramError(f"world.py failed (exit {result.exit_code}): {result.stderr[-300:]}")
    return result.stdout.rstrip("\n")
