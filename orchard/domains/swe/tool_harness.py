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

with requires_extra("rollout"):
    import httpx

from orchard.domains.swe.convention import (
    BASH_SYSTEM,
    MAX_OUTPUT_CHARS,
    TOOL_SCHEMAS,
    TOOL_SYSTEM,
    BadArguments,
    FileTools,
    ToolError,
    bash_observation,
    command_observation,
    editor_call,
    is_submission,
    parse_bash_action,
    run_command,
    truncate_output,
)
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
    SandboxError, ConnectionError, asyncio.TimeoutError, OSError, httpx.HTTPError)


@dataclass(frozen=True)
class Settings:
    """How the program plays every episode (the command line's options)."""

    model_url: str
    convention: str = "tool"
    model_key: str | None = None
    model: str = "orchard"
    max_steps: int = 30
    max_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    max_format_errors: int = 3
    max_time_s: float = 600.0
    model_timeout_s: float = 300.0
    model_retries: int = 2
    exec_timeout_s: float = 60.0
    max_output_chars: int = MAX_OUTPUT_CHARS


_ModelFailed = ModelCallFailed
_OutOfTime = OutOfTime


async def _complete(http: httpx.AsyncClient, settings: Settings, session_id: str,
                    messages: list[dict[str, Any]], deadline: float) -> dict[str, Any]:
    """One chat completion; returns the reply message (`orchard.rollout.program.chat_completion` retries)."""
    body: dict[str, Any] = {"model": settings.model, "messages": messages, "max_tokens": settings.max_tokens,
                            "temperature": settings.temperature, "top_p": settings.top_p}
    if settings.convention == "tool":
        body["tools"] = TOOL_SCHEMAS
    else:
        body["tool_choice"] = "none"  # the bash convention parses its own text: no server-side tool parsing
    return await chat_completion(http, settings.model_url, body, session_id=session_id,
                                 api_key=settings.model_key, deadline=deadline,
                                 timeout_s=settings.model_timeout_s, retries=settings.model_retries)


async def _bounded(coro: Any, settings: Settings, deadline: float) -> Any:
    """A sandbox call under min(its own limit, the time left); the episode's deadline gives ``time_budget``."""
    left = deadline - time.monotonic()
    if left <= 0:
        coro.close()
        raise _OutOfTime
    try:
        return await asyncio.wait_for(coro, min(left, settings.exec_timeout_s + 30))
    except asyncio.TimeoutError as exc:
        if time.monotonic() >= deadline:
            raise _OutOfTime from exc
        raise


async def _tool_turn(sandbox: Any, settings: Settings, message: dict[str, Any], tools: FileTools,
                     deadline: float) -> tuple[list[dict[str, Any]], bool, bool]:
    """Run a tool-convention reply's calls; returns (tool or user messages, a format error, finished)."""
    calls = message.get("tool_calls") or []
    if not calls:
        return [{"role": "user", "content": "Error: no tool was called. Call one of the tools; when the task is "
                 "done, call finish."}], True, False
    out: list[dict[str, Any]] = []
    malformed = finished = False
    for call in calls:
        function = call.get("function") or {}
        name = function.get("name")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
            if not isinstance(arguments, dict):
                raise BadArguments("the arguments must be a JSON object")
            if name == "finish":
                content, finished = "Finished.", True
            elif name == "execute_bash":
                command = arguments.get("command")
                if not isinstance(command, str) or not command.strip():
                    raise BadArguments(f"argument 'command' must be a non-empty string, got {command!r:.80}")
                code, output, timed_out = await _bounded(
                    run_command(sandbox, command, timeout=settings.exec_timeout_s), settings, deadline)
                content = command_observation(code, output, timed_out=timed_out, max_chars=settings.max_output_chars)
            elif name == "str_replace_editor":
                content = truncate_output(await _bounded(editor_call(tools, arguments), settings, deadline),
                                          settings.max_output_chars)
            else:
                raise BadArguments(f"unknown tool {name!r}; the tools are execute_bash, str_replace_editor, finish")
        except (BadArguments, json.JSONDecodeError) as exc:
            content, malformed = f"Error: {exc}", True
        except ToolError as exc:
            content = f"Error: {exc}"
        out.append({"role": "tool", "tool_call_id": call.get("id"), "name": name, "content": content})
        if finished:
            break
    return out, malformed, finished


async def run_episode(http: httpx.AsyncClient, env: AsyncSandboxClient, settings: Settings,
                      episode: dict[str, Any]) -> dict[str, Any]:
    """Play one episode to its end; never raises for model or sandbox failures (they give ``env_error``)."""
    t0 = time.monotonic()
    deadline = t0 + settings.max_time_s
    system = TOOL_SYSTEM if settings.convention == "tool" else BASH_SYSTEM
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": episode["prompt"]}]
    out: dict[str, Any] = {"session_id": episode["session_id"], "sandbox_id": episode["sandbox_id"],
                           "termination_reason": "step_budget", "steps": 0, "format_errors": 0,
                           "tool_calls": 0, "error": None}
    consecutive = 0
    try:
        sandbox = await asyncio.wait_for(env.sandbox(episode["sandbox_id"]), settings.exec_timeout_s)
        tools = FileTools(sandbox, timeout=settings.exec_timeout_s, require_absolute=True)
        for _ in range(settings.max_steps):
            reply = await _complete(http, settings, episode["session_id"], messages, deadline)
            out["steps"] += 1
            finished = False
            if settings.convention == "tool":
                assistant = {"role": "assistant", "content": reply.get("content")}
                if reply.get("tool_calls"):
                    assistant["tool_calls"] = reply["tool_calls"]
                messages.append(assistant)
                observations, malformed, finished = await _tool_turn(sandbox, settings, reply, tools, deadline)
                out["tool_calls"] += len(reply.get("tool_calls") or [])
                messages += observations
            else:
                text = reply.get("content") or ""
                messages.append({"role": "assistant", "content": text})
                action = parse_bash_action(text)
                malformed = action.command is None
                if malformed:
                    messages.append({"role": "user", "content": f"Format error: {action.error}"})
                else:
                    code, output, timed_out = await _bounded(
                        run_command(sandbox, action.command or "", timeout=settings.exec_timeout_s), settings,
                        deadline)
                    out["tool_calls"] += 1
                    finished = is_submission(output)
                    messages.append({"role": "user", "content": bash_observation(
                        code, output, timed_out=timed_out, max_chars=settings.max_output_chars)})
            if finished:
                out["termination_reason"] = "done"
                break
            out["format_errors"] += malformed
            consecutive = consecutive + 1 if malformed else 0
            if consecutive >= settings.max_format_errors:
                out["termination_reason"] = "format_error"
                break
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
    p = argparse.ArgumentParser(prog="python -m orchard.domains.swe.tool_harness",
                                description="Play SWE episodes in the tool or bash convention against an OpenAI "
                                            "endpoint.")
    p.add_argument("--convention", choices=("tool", "bash"), default="tool")
    p.add_argument("--model-url", required=True, help="OpenAI-compatible base URL (with or without /v1)")
    p.add_argument("--model-key-env", default=None, help="environment variable holding the model's API key")
    p.add_argument("--model", default="orchard", help="the request's model field")
    p.add_argument("--env-url", required=True, help="sandbox service URL")
    p.add_argument("--env-key-env", required=True,
                   help="environment variable holding the sandbox service key (empty: the service has none)")
    p.add_argument("--episodes", required=True, help="JSONL: session_id, sandbox_id, prompt")
    p.add_argument("--out", required=True, help="JSONL written here, one line per episode")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-format-errors", type=int, default=3)
    p.add_argument("--max-time-s", type=float, default=600.0, help="wall-clock budget of one episode")
    p.add_argument("--model-timeout-s", type=float, default=300.0)
    p.add_argument("--exec-timeout-s", type=float, default=60.0)
    p.add_argument("--max-output-chars", type=int, default=MAX_OUTPUT_CHARS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("concurrency", "max_steps", "max_tokens", "max_format_errors"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_output_chars < 2:
        parser.error(f"--max-output-chars must be >= 2, got {args.max_output_chars}")
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
    settings = Settings(model_url=args.model_url, convention=args.convention, model_key=model_key,
                        model=args.model, max_steps=args.max_steps, max_tokens=args.max_tokens,
                        temperature=args.temperature, top_p=args.top_p, max_format_errors=args.max_format_errors,
                        max_time_s=args.max_time_s, model_timeout_s=args.model_timeout_s,
                        exec_timeout_s=args.exec_timeout_s, max_output_chars=args.max_output_chars)
    counts = asyncio.run(play_all(episodes, partial(_play, settings=settings), env_url=args.env_url,
                                  env_key=env_key, out_path=args.out,
                                  concurrency=args.concurrency))
    print(json.dumps({"episodes": len(episodes), "termination": counts}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
