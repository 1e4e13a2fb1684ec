"""The SWE bash and tool harnesses as a separate program that reaches the model only through an OpenAI endpoint.

    python -m orchard.domains.swe.tool_harness --convention tool|bash --model-url URL --env-url URL \\
        --env-key-env VAR --episodes episodes.jsonl --out results.jsonl [--concurrency 8] [--max-steps 30] \\
        [--max-tokens 2048] [--temperature 1.0] [--top-p 1.0] [--max-format-errors 3] [--max-time-s 600] \\
        [--model-timeout-s 300] [--exec-timeout-s 60] [--max-output-chars 10000] [--model-key-env VAR]

It stands in for harnesses we do not control (OpenHands, mini-swe-agent): it knows nothing of token ids,
log-probs, rewards or training, sees each episode's sandbox (prepared by the caller: the repository at its base
commit) and its opening user message, and plays one convention of `orchard.domains.swe.convention`:

- ``tool`` (OpenHands'): the request carries the tool schemas (``execute_bash``, ``str_replace_editor``,
  ``finish``); each returned tool call runs in the sandbox and its result comes back as a ``tool`` message;
  ``finish`` ends the episode. A reply without a tool call, an unknown tool or unusable arguments is a format
  error (an error observation).
- ``bash`` (mini-swe-agent's): no tool schemas; the reply's one ```` ```bash ```` block runs in the repository root
  and its output comes back as a user message; a command whose output starts with
  ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` ends the episode. Zero or several blocks is a format error.

``--max-format-errors`` malformed turns in a row end the episode (``format_error``); a sandbox or model failure
gives ``env_error``; out of steps ``step_budget``; out of ``--max-time-s`` ``time_budget``. It does not score.
Input and output files as `orchard.domains.claw.text_harness`: episodes are JSONL objects with ``session_id``,
``sandbox_id`` and ``prompt``; results are one JSONL line per episode, written as it ends, with
``session_id``, ``sandbox_id``, ``termination_reason``, ``steps``, ``format_errors``, ``tool_calls``,
``messages`` (OpenAI chat dicts), ``error`` and ``wall_s``. Keys come from environment variables named on the
command line. Exit status: 0 when every episode has a line, 2 for unusable arguments or input.

The episode loop, the files and the command line are every harness program's (`orchard.rollout.program.play_episode`,
`harness_main`); this module gives the two conventions' system prompts, requests and actors.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

from orchard.domains.swe.convention import (
    BASH_SYSTEM,
    MAX_OUTPUT_CHARS,
    NO_TOOL_CALL,
    TOOL_NAMES,
    TOOL_SCHEMAS,
    TOOL_SYSTEM,
    BadArguments,
    FileTools,
    ToolError,
    bash_observation,
    is_submission,
    parse_bash_action,
    run_command,
    tool_convention_call,
    unknown_tool,
)
from orchard.env import AsyncSandboxClient
from orchard.rollout.program import (
    Actor,
    HarnessSettings,
    Turn,
    bounded,
    harness_main,
    harness_parser,
    play_episode,
)

__all__ = ["Settings", "main", "run_episode"]


@dataclass(frozen=True)
class Settings(HarnessSettings):
    """How the program plays every episode (the command line's options): the convention and its output limit."""

    convention: str = "tool"
    max_output_chars: int = MAX_OUTPUT_CHARS


async def _tool_turn(sandbox: Any, settings: Settings, message: dict[str, Any], tools: FileTools,
                     deadline: float) -> tuple[list[dict[str, Any]], bool, bool]:
    """Run a tool-convention reply's calls; returns (tool or user messages, a format error, finished)."""
    calls = message.get("tool_calls") or []
    if not calls:
        return [{"role": "user", "content": NO_TOOL_CALL}], True, False
    out: list[dict[str, Any]] = []
    malformed = finished = False
    for call in calls:
        function = call.get("function") or {}
        name = function.get("name")
        try:
            if name not in TOOL_NAMES:
                content, malformed = unknown_tool(name, TOOL_NAMES), True
            else:
                arguments = json.loads(function.get("arguments") or "{}")
                if not isinstance(arguments, dict):
                    raise BadArguments("the arguments must be a JSON object")
                content, finished = await tool_convention_call(
                    sandbox, tools, name, arguments, exec_timeout_s=settings.exec_timeout_s,
                    max_output_chars=settings.max_output_chars,
                    bound=lambda step: bounded(step, settings.exec_timeout_s, deadline))
        except (BadArguments, json.JSONDecodeError) as exc:
            content, malformed = f"Error: {exc}", True
        except ToolError as exc:
            content = f"Error: {exc}"
        out.append({"role": "tool", "tool_call_id": call.get("id"), "name": name, "content": content})
        if finished:
            break
    return out, malformed, finished


def _tool_actor(sandbox: Any, settings: Settings) -> Actor:
    """The tool convention (OpenHands'): each tool call runs; ``finish`` ends the episode."""
    tools = FileTools(sandbox, timeout=settings.exec_timeout_s, require_absolute=True)

    async def act(reply: dict[str, Any], deadline: float) -> Turn:
        observations, malformed, finished = await _tool_turn(sandbox, settings, reply, tools, deadline)
        return Turn(observations, len(reply.get("tool_calls") or []), malformed, finished)

    return act


def _bash_actor(sandbox: Any, settings: Settings) -> Actor:
    """The bash convention (mini-swe-agent's): the reply's one bash block runs; a submission ends the episode."""

    async def act(reply: dict[str, Any], deadline: float) -> Turn:
        action = parse_bash_action(reply.get("content") or "")
        if action.command is None:
            return Turn([{"role": "user", "content": f"Format error: {action.error}"}], malformed=True)
        code, output, timed_out = await bounded(
            run_command(sandbox, action.command, timeout=settings.exec_timeout_s), settings.exec_timeout_s, deadline)
        observation = bash_observation(code, output, timed_out=timed_out, max_chars=settings.max_output_chars)
        return Turn([{"role": "user", "content": observation}], tool_calls=1, finished=is_submission(output))

    return act


def _tool_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """The tool convention's assistant message: the reply's content and its tool calls, as the model gave them."""
    assistant = {"role": "assistant", "content": reply.get("content")}
    if reply.get("tool_calls"):
        assistant["tool_calls"] = reply["tool_calls"]
    return assistant


async def run_episode(http: Any, env: AsyncSandboxClient, settings: Settings,
                      episode: dict[str, Any]) -> dict[str, Any]:
    """Play one episode to its end; never raises for model or sandbox failures (they give ``env_error``)."""
    if settings.convention == "tool":
        return await play_episode(http, env, settings, episode, system=TOOL_SYSTEM,
                                  actor=partial(_tool_actor, settings=settings), request={"tools": TOOL_SCHEMAS},
                                  assistant=_tool_reply)
    # the bash convention parses its own text: no server-side tool parsing
    return await play_episode(http, env, settings, episode, system=BASH_SYSTEM,
                              actor=partial(_bash_actor, settings=settings), request={"tool_choice": "none"})


def _check(args: Any) -> str | None:
    return f"--max-output-chars must be >= 2, got {args.max_output_chars}" if args.max_output_chars < 2 else None


def main(argv: list[str] | None = None) -> int:
    parser = harness_parser("python -m orchard.domains.swe.tool_harness",
                            "Play SWE episodes in the tool or bash convention against an OpenAI endpoint.", Settings)
    parser.add_argument("--convention", choices=("tool", "bash"), default="tool")
    parser.add_argument("--max-output-chars", type=int, default=MAX_OUTPUT_CHARS)
    return harness_main(parser, argv, Settings, run_episode, check=_check)


if __name__ == "__main__":
    sys.exit(main())
