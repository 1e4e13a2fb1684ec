"""A harness we do not control, as a separate program: both sides of the contract, once for every domain.

A domain's harness program (the Claw text harness, the SWE bash / tool harness) reaches the model only through an
OpenAI endpoint (the recording proxy) and its sandboxes through the service. The launcher writes an episodes
file, runs the program, and reads one JSON result per episode back::

    launcher (this process)                          program (python -m <module> ...)
    episodes.jsonl: {session_id, sandbox_id, prompt}  read_episodes(path)
    run_program(module, argv, program_env(...))  -->  play_all(episodes, play, ...)  # one line per finished episode
    read_results(out.jsonl)                      <--  results.jsonl: {session_id, termination_reason, ...}

The service's key travels to the child in an environment variable (``program_env``), never on its command line.
An episode the program never reported (it crashed, or ran past its time) is simply absent from ``read_results``:
the launcher marks it ``env_error``.

The launcher's batch (sandboxes, episodes file, proxy, program,
verdicts) is `orchard.rollout.program_runner.run_program_episodes`; the program's episode loop (model calls through
the proxy, step and format-error accounting) is `play_episode`, its command line `harness_parser` and
`harness_main`. A domain gives only its prompts, its tools (an ``actor`` that acts on each reply) and its verdicts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard._extras import requires_extra
from orchard._retry import backoff_s
from orchard.env import AsyncSandboxClient, RetryPolicy, SandboxError
from orchard.rollout.session import SESSION_HEADER

__all__ = ["SESSION_HEADER", "Actor", "HarnessSettings", "ModelCallFailed", "OutOfTime", "Turn", "bounded",
           "chat_completion", "chat_url", "check_engine_or_url", "check_launch", "harness_main", "harness_parser",
           "play_all", "play_episode", "program_env", "read_episodes", "read_results", "run_program", "text_reply"]


class ModelCallFailed(RuntimeError):
    """The model did not answer (after retries): the episode ends as ``env_error``, not as the policy's failure."""


class OutOfTime(Exception):
    """The episode's wall-clock budget ran out (``time_budget``)."""

EPISODE_KEYS = ("session_id", "sandbox_id", "prompt")
"""What every line of an episodes file holds (non-empty strings; ``session_id`` unique)."""


def check_launch(*, client: Any, proxy: Any, counts: Mapping[str, Any], seconds: Mapping[str, Any],
                 program_timeout_s: Any, temperature: Any, top_p: Any, run_id: Any, env_url: str | None,
                 env_key: str | None) -> tuple[str, str, str | None]:
    """The checks every launcher of a harness program makes; returns ``(run_id, env_url, env_key)`` with the
    defaults filled in (a random run id; the client's URL and key).

    ``counts`` must be ints >= 1 and ``seconds`` finite numbers > 0, each checked by its name.
    """
    from orchard.rollout.proxy import RecordingProxy

    if not hasattr(client, "create"):
        raise ValueError(f"client must be an AsyncSandboxClient, got {type(client).__name__}")
    if not isinstance(proxy, RecordingProxy):
        raise ValueError(f"proxy must be a RecordingProxy, got {type(proxy).__name__}")
    for name, count in counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be an int >= 1, got {count!r}")
    for name, value in seconds.items():
        if not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if program_timeout_s is not None and not 0 < program_timeout_s < math.inf:
        raise ValueError(f"program_timeout_s must be a finite number > 0 or None, got {program_timeout_s!r}")
    if not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    run_id = secrets.token_hex(4) if run_id is None else run_id
    if not isinstance(run_id, str) or not run_id.replace("-", "").replace("_", "").isalnum() or len(run_id) > 40:
        raise ValueError(f"run_id must be up to 40 letters, digits, '-' or '_', got {run_id!r}")
    return run_id, env_url or client.base_url, env_key if env_key is not None else client.api_key


def program_env(key_env: str, env_key: str | None) -> dict[str, str]:
    """The child's environment: this one, the service key in ``key_env``, and the orchard package importable."""
    env = dict(os.environ)
    env[key_env] = env_key or ""
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds the orchard package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


async def run_program(module: str, argv: list[str], env: Mapping[str, str], timeout_s: float,
                      ) -> tuple[int | None, str]:
    """``python -m module *argv``; returns (exit status, or None when it was killed for time; the tail of its
    stderr). The child is killed and reaped on timeout, error or cancellation."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *argv, env=dict(env),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
        return proc.returncode, stderr.decode(errors="replace")[-2000:]
    except asyncio.TimeoutError:
        return None, f"the harness program ran past {timeout_s:.0f} s and was killed"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """The program's results by ``session_id``; a line cut by a crash is an episode that was not reported."""
    results: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return results
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            result = json.loads(line)
            if isinstance(result, dict) and isinstance(result.get("session_id"), str):
                results[result["session_id"]] = result
    return results


def read_episodes(path: str) -> list[dict[str, Any]]:
    """The episodes file: JSONL objects with str ``session_id``, ``sandbox_id`` and ``prompt``; ids unique."""
    episodes, seen = [], set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                episode = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"episodes line {n} is not JSON: {exc.msg}") from exc
            for key in EPISODE_KEYS:
                if not isinstance(episode, dict) or not isinstance(episode.get(key), str) or not episode[key]:
                    raise ValueError(f"episodes line {n} needs a non-empty str {key!r}, got {line.strip()[:120]!r}")
            if episode["session_id"] in seen:
                raise ValueError(f"episodes line {n} repeats session_id {episode['session_id']!r}")
            seen.add(episode["session_id"])
            episodes.append(episode)
    return episodes


async def play_all(episodes: list[dict[str, Any]], play: Callable[[Any, AsyncSandboxClient, dict[str, Any]],
                                                                  Awaitable[dict[str, Any]]],
                   *, env_url: str, env_key: str | None, out_path: str, concurrency: int) -> dict[str, int]:
    """``await play(http, sandboxes, episode)`` for every episode, at most ``concurrency`` at once, appending each
    result to ``out_path`` as it ends (a bug in one episode is reported as its ``env_error``, never losing the
    others); returns the count of each termination reason."""
    with requires_extra("rollout"):
        import httpx

    semaphore = asyncio.Semaphore(concurrency)
    counts: dict[str, int] = {}
    retry = RetryPolicy(max_attempts=3, backoff_base_s=0.2, backoff_max_s=2.0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with AsyncSandboxClient(env_url, env_key, retry=retry, auto_cleanup=False) as env, \
            httpx.AsyncClient(limits=limits) as http:
        with open(out_path, "w") as out:

            async def one(episode: dict[str, Any]) -> None:
                async with semaphore:
                    try:
                        result = await play(http, env, episode)
                    except Exception as exc:  # a bug here must not lose the other episodes' reports
                        result = {"session_id": episode["session_id"], "sandbox_id": episode["sandbox_id"],
                                  "termination_reason": "env_error", "steps": 0, "format_errors": 0,
                                  "tool_calls": 0, "error": f"harness: {type(exc).__name__}: {exc}",
                                  "messages": [], "wall_s": 0.0}
                out.write(json.dumps(result) + "\n")
                out.flush()
                counts[result["termination_reason"]] = counts.get(result["termination_reason"], 0) + 1

            await asyncio.gather(*(one(e) for e in episodes))
    return counts


def chat_url(model_url: str) -> str:
    """``{model_url}/v1/chat/completions``, accepting a base URL with or without its ``/v1``."""
    if not isinstance(model_url, str) or not model_url.startswith(("http://", "https://")):
        raise ValueError(f"model_url must be an http(s) URL, got {model_url!r}")
    base = model_url.rstrip("/")
    return (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"


async def chat_completion(http: Any, model_url: str, body: Mapping[str, Any], *, session_id: str,
                          api_key: str | None, deadline: float, timeout_s: float, retries: int) -> dict[str, Any]:
    """One chat completion for an episode's session; returns the reply message (a dict).

    Transport failures and 5xx answers are retried ``retries`` times with jittered backoff
    (``orchard._retry.backoff_s``, base 0.5 s); a 4xx is not (the request is wrong). Raises `OutOfTime` when
    ``deadline`` (``time.monotonic()``) passes, `ModelCallFailed` when no usable answer came.
    """
    with requires_extra("rollout"):
        import httpx

    headers = {SESSION_HEADER: session_id}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    error = ""
    for attempt in range(retries + 1):
        left = deadline - time.monotonic()
        if left <= 0:
            raise OutOfTime
        try:
            r = await http.post(chat_url(model_url), json=dict(body), headers=headers, timeout=min(left, timeout_s))
        except httpx.TimeoutException as exc:
            if time.monotonic() >= deadline:
                raise OutOfTime from exc
            error = f"timeout: {exc}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            if r.status_code == 200:
                try:
                    message = r.json()["choices"][0]["message"]
                    if not isinstance(message, dict):
                        raise TypeError("message is not an object")
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    raise ModelCallFailed(f"model: not a chat completion: {r.text[:300]!r}") from exc
                return message
            error = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code < 500:  # the request is wrong; asking again will not help
                break
        if attempt < retries:
            await asyncio.sleep(backoff_s(attempt, base_s=0.5))
    raise ModelCallFailed(f"model: {error}")


@dataclass(frozen=True)
class HarnessSettings:
    """How a harness program plays every episode: the options every program's command line takes. A domain
    subclasses it with its own defaults and options (`orchard.domains.claw.text_harness.Settings`); `harness_parser`
    takes the command line's defaults from it."""

    model_url: str
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


@dataclass
class Turn:
    """What a harness made of one model reply: the messages that follow the reply (its observations), the tool
    calls it ran, whether the reply was malformed (a format error) and whether it ended the episode (``done``)."""

    observations: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: int = 0
    malformed: bool = False
    finished: bool = False


Actor = Callable[[dict[str, Any], float], Awaitable[Turn]]
"""``await act(reply, deadline)``: one model reply (its message) acted on in the episode's sandbox."""


def text_reply(reply: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message of a harness that parses text: the reply's content. A reply the server parsed into
    tool calls has none, so to such a harness it is malformed."""
    return {"role": "assistant", "content": reply.get("content") or ""}


async def bounded(coro: Any, exec_timeout_s: float, deadline: float) -> Any:
    """A sandbox call under min(its own limit + 30 s, the episode's time left); the deadline gives `OutOfTime`."""
    left = deadline - time.monotonic()
    if left <= 0:
        coro.close()
        raise OutOfTime
    try:
        return await asyncio.wait_for(coro, min(left, exec_timeout_s + 30))
    except asyncio.TimeoutError as exc:
        if time.monotonic() >= deadline:
            raise OutOfTime from exc
        raise


async def play_episode(http: Any, env: AsyncSandboxClient, settings: HarnessSettings, episode: Mapping[str, Any],
                       *, system: str, actor: Callable[[Any], Actor], request: Mapping[str, Any] | None = None,
                       assistant: Callable[[Mapping[str, Any]], dict[str, Any]] = text_reply,
                       env_failures: tuple[type[BaseException], ...] = ()) -> dict[str, Any]:
    """Play one episode of a harness program to its end; returns its result line. Never raises for model or sandbox
    failures (they give ``env_error``)::

        messages = [system, user prompt]; act = actor(the episode's sandbox)
        repeat up to settings.max_steps:
            reply = chat_completion(...)   # through the proxy: X-Session-Id is the episode's session
            messages += [assistant(reply)]; turn = await act(reply, deadline); messages += turn.observations
            turn.finished -> done; settings.max_format_errors malformed turns in a row -> format_error
        a sandbox or model failure -> env_error; out of steps -> step_budget; out of settings.max_time_s -> time_budget

    Args:
        http: an ``httpx.AsyncClient``; env: the sandbox service's client.
        settings: the program's options; episode: one line of the episodes file.
        system: the system prompt.
        actor: ``actor(sandbox)`` gives the episode's `Actor` (it may keep the episode's state, e.g. an editor's).
        request: added to every request's body (the tool schemas, ``tool_choice``).
        assistant: the reply as the assistant message kept in the conversation (default `text_reply`).
        env_failures: the domain's own errors that fail the environment, beyond the sandbox client's, timeouts,
            ``OSError`` and httpx's.
    """
    with requires_extra("rollout"):
        import httpx

    failures = (SandboxError, ConnectionError, asyncio.TimeoutError, OSError, httpx.HTTPError, *env_failures)
    t0 = time.monotonic()
    deadline = t0 + settings.max_time_s
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": episode["prompt"]}]
    out: dict[str, Any] = {"session_id": episode["session_id"], "sandbox_id": episode["sandbox_id"],
                           "termination_reason": "step_budget", "steps": 0, "format_errors": 0,
                           "tool_calls": 0, "error": None}
    consecutive = 0
    try:
        sandbox = await asyncio.wait_for(env.sandbox(episode["sandbox_id"]), settings.exec_timeout_s)
        act = actor(sandbox)
        for _ in range(settings.max_steps):
            body = {"model": settings.model, "messages": messages, "max_tokens": settings.max_tokens,
                    "temperature": settings.temperature, "top_p": settings.top_p, **(request or {})}
            reply = await chat_completion(http, settings.model_url, body,
                                          session_id=episode["session_id"], api_key=settings.model_key,
                                          deadline=deadline, timeout_s=settings.model_timeout_s,
                                          retries=settings.model_retries)
            out["steps"] += 1
            messages.append(assistant(reply))
            turn = await act(reply, deadline)
            messages += turn.observations
            out["tool_calls"] += turn.tool_calls
            if turn.finished:
                out["termination_reason"] = "done"
                break
            out["format_errors"] += turn.malformed
            consecutive = consecutive + 1 if turn.malformed else 0
            if consecutive >= settings.max_format_errors:
                out["termination_reason"] = "format_error"
                break
    except OutOfTime:
        out["termination_reason"] = "time_budget"
    except ModelCallFailed as exc:
        out["termination_reason"], out["error"] = "env_error", str(exc)
    except failures as exc:
        out["termination_reason"], out["error"] = "env_error", f"sandbox: {type(exc).__name__}: {exc}"
    out["messages"] = messages
    out["wall_s"] = round(time.monotonic() - t0, 3)
    return out


def harness_parser(prog: str, description: str, settings_type: type[HarnessSettings]) -> argparse.ArgumentParser:
    """The command line every harness program takes, its defaults ``settings_type``'s; a domain adds its own."""
    default = {f.name: f.default for f in dataclasses.fields(settings_type)}
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model-url", required=True, help="OpenAI-compatible base URL (with or without /v1)")
    p.add_argument("--model-key-env", default=None, help="environment variable holding the model's API key")
    p.add_argument("--model", default=default["model"], help="the request's model field")
    p.add_argument("--env-url", required=True, help="sandbox service URL")
    p.add_argument("--env-key-env", required=True,
                   help="environment variable holding the sandbox service key (empty: the service has none)")
    p.add_argument("--episodes", required=True, help="JSONL: session_id, sandbox_id, prompt")
    p.add_argument("--out", required=True, help="JSONL written here, one line per episode")
    p.add_argument("--concurrency", type=int, default=8)
    for name, kind in [("max_steps", int), ("max_tokens", int), ("temperature", float), ("top_p", float),
                       ("max_format_errors", int), ("max_time_s", float), ("model_timeout_s", float),
                       ("exec_timeout_s", float)]:
        text = "wall-clock budget of one episode" if name == "max_time_s" else None
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default[name], help=text)
    return p


def harness_main(parser: argparse.ArgumentParser, argv: list[str] | None, settings_type: type[HarnessSettings],
                 run_episode: Callable[[Any, AsyncSandboxClient, Any, dict[str, Any]], Awaitable[dict[str, Any]]],
                 check: Callable[[argparse.Namespace], str | None] | None = None) -> int:
    """A harness program's ``main``: check the command line (``check`` gives the domain's own error, or None),
    read the episodes, play them all with ``run_episode(http, env, settings, episode)`` and write their results.
    Exit status 0 when every episode has a line, 2 (``parser.error``) for unusable arguments or input."""
    args = parser.parse_args(argv)
    for name in ("concurrency", "max_steps", "max_tokens", "max_format_errors"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    error = check(args) if check is not None else None
    if error:
        parser.error(error)
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
    settings = settings_type(model_key=model_key, **{  # type: ignore[arg-type]
        f.name: getattr(args, f.name) for f in dataclasses.fields(settings_type)
        if f.name != "model_key" and hasattr(args, f.name)})

    async def play(http: Any, env: AsyncSandboxClient, episode: dict[str, Any]) -> dict[str, Any]:
        return await run_episode(http, env, settings, episode)

    counts = asyncio.run(play_all(episodes, play, env_url=args.env_url, env_key=env_key, out_path=args.out,
                                  concurrency=args.concurrency))
    print(json.dumps({"episodes": len(episodes), "termination": counts}), file=sys.stderr)
    return 0


def check_engine_or_url(model: object, tokenizer: Any, name: str = "judge") -> Any:
    """The chat tokenizer an in-process model (an `Engine`) needs to render its prompts: ``tokenizer``, else the
    engine's own; None for an OpenAI-compatible server's http(s) URL, which renders its own. ``name`` is the
    argument the errors name (a judge, a teacher)."""
    from orchard.rollout.engine import Engine

    if isinstance(model, str):
        if not model.startswith(("http://", "https://")):
            raise ValueError(f"{name} must be an http(s) URL or an Engine, got {model!r}")
        return None
    if not isinstance(model, Engine):
        raise ValueError(f"{name} must be an http(s) URL or an Engine, got {type(model).__name__}")
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer must be given (a tokenizer with a chat_template) when the {name} engine has none")
    return tokenizer
