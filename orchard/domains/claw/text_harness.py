"""The Claw text harness as a separate program: it talks to the model only through an OpenAI-compatible endpoint.

    python -m orchard.domains.claw.text_harness --model-url URL --env-url URL --env-key-env VAR \\
        --episodes episodes.jsonl --out results.jsonl [--concurrency 8] [--max-steps 6] [--max-tokens 96] \\
        [--temperature 1.0] [--top-p 1.0] [--max-time-s 600] [--model-timeout-s 300] [--model-key-env VAR]

This stands in for a harness we do not control: it knows nothing of token ids, log-probs, rewards or training.
It sees each episode's sandbox (already prepared by the caller: world program and initial state uploaded) and
its user request, and plays the text convention of `orchard.domains.claw.harness`:

    messages = [system TEXT_SYSTEM, user prompt]
    repeat up to --max-steps:
        POST {model}/v1/chat/completions  (header X-Session-Id: <session_id>, so the recording proxy files the call)
        parse the reply (`parse_text_action`)
        'Action: <tool> <json>' -> run the tool in the sandbox -> user 'Observation: <text>'
        'Final: <summary>'      -> done
        malformed               -> user 'Observation: error: <why>'; --max-format-errors in a row -> format_error
    sandbox or model failure -> env_error; out of steps -> step_budget; out of --max-time-s -> time_budget

It does not score: the caller verifies each sandbox afterwards. Input (``--episodes``, JSONL): one object per
episode with ``session_id``, ``sandbox_id`` and ``prompt``. Output (``--out``, JSONL, one line per episode written
as it finishes, in completion order): ``session_id``, ``sandbox_id``, ``termination_reason``, ``steps``,
``format_errors``, ``tool_calls``, ``messages`` (OpenAI chat dicts), ``error`` (None unless env_error) and
``wall_s``. API keys come from environment variables named on the command line, never from the command line.
Exit status: 0 when every episode has a line (whatever its outcome), 2 for unusable arguments or input.

The loop above, the files and the command line are every harness program's (`orchard.rollout.program.play_episode`,
`harness_main`); this module gives the text convention's system prompt and its actor (parse the reply, run the tool).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

from orchard.domains.claw.convention import TEXT_SYSTEM, ToolProgramError, parse_text_action, run_tool
from orchard.env import AsyncSandboxClient
from orchard.rollout.program import (
    Actor,
    HarnessSettings,
    Turn,
    bounded,
    chat_url,
    harness_main,
    harness_parser,
    play_episode,
)

__all__ = ["Settings", "chat_url", "main", "run_episode"]


@dataclass(frozen=True)
class Settings(HarnessSettings):
    """How the program plays every episode (the command line's options), with the text harness's defaults."""

    max_steps: int = 6
    max_tokens: int = 96
    exec_timeout_s: float = 30.0


def _actor(sandbox: Any, settings: Settings) -> Actor:
    """The text convention in the episode's sandbox: 'Action: <tool> <json>' runs the tool, 'Final: ...' ends."""

    async def act(reply: dict[str, Any], deadline: float) -> Turn:
        action = parse_text_action(reply.get("content") or "")
        if action.kind == "final":
            return Turn(finished=True)
        if action.kind == "error":
            return Turn([{"role": "user", "content": f"Observation: error: {action.text}"}], malformed=True)
        observation = await bounded(run_tool(sandbox, action.name, action.arguments or {},
                                             timeout=settings.exec_timeout_s), settings.exec_timeout_s, deadline)
        return Turn([{"role": "user", "content": f"Observation: {observation}"}], tool_calls=1)

    return act


async def run_episode(http: Any, env: AsyncSandboxClient, settings: Settings,
                      episode: dict[str, Any]) -> dict[str, Any]:
    """Play one episode to its end; never raises for model or sandbox failures (they give ``env_error``)."""
    return await play_episode(http, env, settings, episode, system=TEXT_SYSTEM,
                              actor=partial(_actor, settings=settings), env_failures=(ToolProgramError,))


def main(argv: list[str] | None = None) -> int:
    parser = harness_parser("python -m orchard.domains.claw.text_harness",
                            "Play Claw episodes in the text convention against an OpenAI endpoint.", Settings)
    return harness_main(parser, argv, Settings, run_episode)


if __name__ == "__main__":
    sys.exit(main())
