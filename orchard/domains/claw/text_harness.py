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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from orchard._extras import requires_extra

with requires_extra("all"):
    import httpx

from orchard.domains.claw.convention import TEXT_SYSTEM, ToolProgramError, parse_text_action, run_tool
from orchard.env import AsyncSandboxClient, SandboxError
from orchard.rollout.program import (
    ModelCallFailed,
    OutOfTime,
    chat_completion,
    chat_url,
    play_all,
    read_episodes,
)

ENV_FAILURES: tuple[type[BaseException], ...] = (
    SandboxError, ToolProgramError, ConnectionError, asyncio.TimeoutError, OSError, httpx.HTTPError)


@dataclass(frozen=True)
class Settings:
    """How the program plays every episode (the command line's options)."""

    model_url: str
    model_key: str | None = None
    model: str = "orchard"
    max_steps: int = 6
    max_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    max_format_errors: int = 3
    max_time_s: float = 600.0
    model_timeout_s: float = 300.0
    model_retries: int = 2
    exec_timeout_s: float = 30.0


_ModelFailed = ModelCallFailed
_OutOfTime = OutOfTime


async def _complete(http: httpx.AsyncClient, settings: Settings, session_id: str,
                    messages: list[dict[str, Any]], deadline: float) -> str:
    """One chat completion; returns the reply's text (`orchard.rollout.program.chat_completion` retries)."""
    body = {"model": settings.model, "messages": messages, "max_tokens": settings.max_tokens,
            "temperature": settings.temperature, "top_p": settings.top_p}
    message = await chat_completion(http, settings.model_url, body, session_id=session_id,
                                    api_key=settings.model_key, deadline=deadline,
                                    timeout_s=settings.model_timeout_s, retries=settings.model_retries)
    # A reply the server parsed into tool calls has no content: to this harness it is malformed.
    return message.get("content") or ""


async def run_episode(http: httpx.AsyncClient, env: AsyncSandboxClient, settings: Settings,
                      episode: dict[str, Any]) -> dict[str, Any]:
    """Play one episode to its end; never raises for model or sandbox failures (they give ``env_error``)."""
    t0 = time.monotonic()
    deadline = t0 + settings.max_time_s
    messages: list[dict[str, Any]] = [{"role": "system", "content": TEXT_SYSTEM},
                                      {"role": "user", "content": episode["prompt"]}]
    out: dict[str, Any] = {"session_id": episode["session_id"], "sandbox_id": episode["sandbox_id"],
                           "termination_reason": "step_budget", "steps": 0, "format_errors": 0,
                           "tool_calls": 0, "error": None}
    consecutive = 0
    try:
        sandbox = await asyncio.wait_for(env.sandbox(episode["sandbox_id"]), settings.exec_timeout_s)
        for _ in range(settings.max_steps):
            reply = await _complete(http, settings, episode["session_id"], messages, deadline)
            out["steps"] += 1
            messages.append({"role": "assistant", "content": reply})
            action = parse_text_action(reply)
            if action.kind == "final":
                out["termination_reason"] = "done"
                break
            if action.kind == "error":
                out["format_errors"] += 1
                consecutive += 1
                messages.append({"role": "user", "content": f"Observation: error: {action.text}"})
                if consecutive >= settings.max_format_errors:
                    out["termination_reason"] = "format_error"
                    break
                continue
            consecutive = 0
            left = deadline - time.monotonic()
            if left <= 0:
                raise _OutOfTime
            try:
                observation = await asyncio.wait_for(
                    run_tool(sandbox, action.name, action.arguments or {}, timeout=settings.exec_timeout_s),
                    min(left, settings.exec_timeout_s + 30))
            except asyncio.TimeoutError as exc:
                if time.monotonic() >= deadline:
                    raise _OutOfTime from exc
                raise
            out["tool_calls"] += 1
            messages.append({"role": "user", "content": f"Observation: {observation}"})
    except _OutOfTime:
        out["termination_reason"] = "time_budget"
    except _ModelFailed as exc:
        out["termination_reason"], out["error"] = "env_error", str(exc)
    except ENV_FAILURES as exc:
        out["termination_reason"], out["error"] = "env_error", f"sandbox: {type(exc).__name__}: {exc}"
    out["messages"] = messages
    out["wall_s"] = round(time.monotonic() - t0, 3)
    return out


async def _play(http: Any, env: Any, episode: dict[str, Any], *, settings: Settings) -> dict[str, Any]:
    return await run_episode(http, env, settings, episode)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m orchard.domains.claw.text_harness",
                                description="Play Claw episodes in the text convention against an OpenAI endpoint.")
    p.add_argument("--model-url", required=True, help="OpenAI-compatible base URL (with or without /v1)")
    p.add_argument("--model-key-env", default=None, help="environment variable holding the model's API key")
    p.add_argument("--model", default="orchard", help="the request's model field")
    p.add_argument("--env-url", required=True, help="sandbox service URL")
    p.add_argument("--env-key-env", required=True,
                   help="environment variable holding the sandbox service key (empty: the service has none)")
    p.add_argument("--episodes", required=True, help="JSONL: session_id, sandbox_id, prompt")
    p.add_argument("--out", required=True, help="JSONL written here, one line per episode")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-format-errors", type=int, default=3)
    p.add_argument("--max-time-s", type=float, default=600.0, help="wall-clock budget of one episode")
    p.add_argument("--model-timeout-s", type=float, default=300.0)
    p.add_argument("--exec-timeout-s", type=float, default=30.0)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("concurrency", "max_steps", "max_tokens", "max_format_errors"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("max_time_s", "model_timeout_s", "exec_timeout_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not args.temperature >= 0 or not 0 < args.top_p <= 1:
        parser.error(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature}, {args.top_p}")
    if args.env_key_env not in os.environ:  # set but empty: a service without a key
        parser.error(f"--env-key-env names {args.env_key_env!r}, which is not set in the environment")
    env_key = os.environ[args.env_key_env] or None
    model_key = os.environ.get(args.model_key_env) if args.model_key_env else None
    if args.model_key_env and not model_key:
        parser.error(f"--model-key-env names {args.model_key_env!r}, which is not set in the environment")
    try:
        chat_url(args.model_url)
        episodes = read_episodes(args.episodes)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    settings = Settings(model_url=args.model_url, model_key=model_key, model=args.model, max_steps=args.max_steps,
                        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        max_format_errors=args.max_format_errors, max_time_s=args.max_time_s,
                        model_timeout_s=args.model_timeout_s, exec_timeout_s=args.exec_timeout_s)
    counts = asyncio.run(play_all(episodes, partial(_play, settings=settings), env_url=args.env_url,
                                  env_key=env_key, out_path=args.out,
                                  concurrency=args.concurrency))
    print(json.dumps({"episodes": len(episodes), "termination": counts}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
