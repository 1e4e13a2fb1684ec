"""Rollouts of a harness program that reaches the model only through the recording proxy: the launcher, once.

Running an outside program as a harness is a rollout capability, not a domain's. A domain (the Claw text harness,
`orchard.domains.claw.text_rollout`; the SWE tool and bash harnesses, `orchard.domains.swe.tool_rollout`) gives a
`HarnessProgram`: how to create and prepare a task's sandbox, the task's prompt, the program and its own options,
how to score a sandbox, and what of a verdict its `Trajectory` keeps. The training data comes from the recording
proxy in front of the policy, never from the program: per model call, the prompt ids the engine saw (context,
masked) and the ids it sampled (actions, supervised, with their sampling log-probs).

One batch (`run_program_episodes`)::

    for each task x group member:  seed its proxy session; create a sandbox and prepare it (program.create, .prepare)
    write the episodes file (session id, sandbox id, prompt)
    python -m <program.run's module> ...         # child process; the proxy answers it from this process
    for each episode the program reported as not failed: program.score(sandbox, task) -> reward, components
    samples = proxy.samples(session id)            # then the session is dropped from the proxy
    delete every sandbox (always, errors and cancellation included)

Where the proxy runs: on the caller's event loop (`orchard.rollout.serving.serve_app`), not in a thread, so the
program's model calls and the caller's other rollouts reach the engine together (`HFEngine` batches them
continuously). The child process blocks nothing: it is awaited.

Environment failures (a sandbox that could not be created, prepared or scored; the program's own ``env_error``s;
an episode the program never reported, whatever its exit status) give ``env_error`` with ``reward = None``, never
the policy's -1: the caller drops them (`Trajectory.valid` is False), and the rest of the batch is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard.data import Message, RenderedSample, Trajectory
from orchard.rollout.engine import derive_seed
from orchard.rollout.harness import keep_alive
from orchard.rollout.program import check_launch, program_env, read_results
from orchard.rollout.proxy import RecordingProxy
from orchard.rollout.serving import serve_app

__all__ = ["HarnessProgram", "ProgramEpisode", "check_tasks", "run_program_episodes"]


def _no_metadata(verdict: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class HarnessProgram:
    """A domain's part of a batch of harness-program rollouts (`run_program_episodes`)."""

    harness: str
    """The trajectories' ``metadata["harness"]`` (``"text"``, the SWE convention)."""
    run: Callable[[list[str], Mapping[str, str], float], Awaitable[tuple[int | None, str]]]
    """``await run(argv, env, timeout_s)``: the program (`orchard.rollout.program.run_program` of its module)."""
    key_env: str
    """The environment variable that hands the sandbox service's key to the child process."""
    task_id: Callable[[Any], str]
    """A task's id: the trajectories' ``task_id`` and ``group_id``, and the seed's (`derive_seed`)."""
    prompt: Callable[[Any], str]
    """A task's opening user message."""
    create: Callable[[Any, str], Awaitable[Any]]
    """``await create(task, session_id)``: a fresh sandbox for one episode."""
    prepare: Callable[[Any, Any], Awaitable[Any]]
    """``await prepare(sandbox, task)``: the task's state uploaded before the program plays."""
    prepare_timeout_s: float
    """The limit of one `prepare`."""
    score: Callable[[Any, Any], Awaitable[Any]]
    """``await score(sandbox, task)``: the verdict, with ``reward`` (+1 / -1) and ``components``."""
    score_timeout_s: float
    """The limit of one `score`."""
    argv: tuple[str, ...] = ()
    """The program's own options, after those every harness program takes."""
    counts: Mapping[str, Any] = field(default_factory=dict)
    """The program's own options that must be ints >= 1, by name (`check_launch`)."""
    seconds: Mapping[str, Any] = field(default_factory=dict)
    """The program's own options that must be finite numbers > 0, by name."""
    prepare_errors: tuple[type[BaseException], ...] = (Exception,)
    """What a failed `prepare` may raise and count as the environment's failure; anything else propagates."""
    score_errors: tuple[type[BaseException], ...] = (Exception,)
    """What a failed `score` may raise and count as the environment's failure (never the policy's -1)."""
    score_step: str = "score"
    """How a scoring failure's ``error`` begins (``"score: ..."``)."""
    tools: list[dict[str, Any]] | None = None
    """The tool schemas the program offers (`Trajectory.tools`); None: none."""
    metadata: Callable[[Any], dict[str, Any]] = _no_metadata
    """``metadata(verdict or None)``: what of a verdict the trajectory's metadata keeps beyond the runner's."""


@dataclass
class ProgramEpisode:
    """One episode's state while the batch runs (becomes a `Trajectory` at the end)."""

    task: Any
    task_id: str
    session_id: str
    group_index: int
    termination_reason: str = "env_error"
    steps: int = 0
    format_errors: int = 0
    tool_calls: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    verdict: Any = None
    error: str | None = None
    wall_s: float = 0.0

    def report(self, result: Mapping[str, Any]) -> None:
        """Take the program's result line for this episode."""
        self.termination_reason = result["termination_reason"]
        self.steps, self.format_errors = int(result["steps"]), int(result["format_errors"])
        self.tool_calls, self.messages = int(result["tool_calls"]), list(result["messages"])
        self.error, self.wall_s = result.get("error"), float(result.get("wall_s", 0.0))

    def trajectory(self, samples: list[RenderedSample], program: HarnessProgram) -> Trajectory:
        """The episode as a `Trajectory` whose ``samples`` are the proxy's, one per recorded call, in order.

        When the proxy recorded exactly one call per assistant turn, each assistant message also carries that
        call's sampled ids and log-probs, so `orchard.data.render_turns` of the trajectory equals ``samples``.
        """
        messages = [Message.from_dict(m) for m in self.messages]
        turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
        if turns and len(turns) == len(samples):
            for i, sample in zip(turns, samples, strict=True):
                action = sample.action_mask
                messages[i].token_ids = sample.input_ids[action].tolist()
                messages[i].logprobs = sample.old_logprobs[action].tolist()
        return Trajectory(
            messages=messages, tools=program.tools if program.tools is not None else [], reward=self.reward,
            reward_components=dict(self.reward_components), task_id=self.task_id, group_id=self.task_id,
            termination_reason=self.termination_reason,  # type: ignore[arg-type]
            metadata={"harness": program.harness, "session_id": self.session_id, "group_index": self.group_index,
                      "steps": self.steps, "format_errors": self.format_errors, "tool_calls": self.tool_calls,
                      **program.metadata(self.verdict), "error": self.error, "wall_s": self.wall_s,
                      "recorded_calls": len(samples)},
            samples=list(samples))


def check_tasks(tasks: Any, task_type: type, name: str = "tasks") -> None:
    """``tasks`` must be a non-empty sequence of ``task_type``; the error names the argument ``name``."""
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence) or not tasks:
        raise ValueError(f"{name} must be a non-empty sequence of {task_type.__name__}, got {tasks!r:.100}")
    for i, task in enumerate(tasks):
        if not isinstance(task, task_type):
            raise ValueError(f"{name}[{i}] must be a {task_type.__name__}, got {type(task).__name__}")


async def run_program_episodes(
    program: HarnessProgram,
    tasks: Sequence[Any],
    *,
    client: Any,
    proxy: RecordingProxy,
    proxy_url: str | None = None,
    env_url: str | None = None,
    env_key: str | None = None,
    group_size: int = 1,
    concurrency: int = 8,
    max_steps: int = 30,
    max_tokens: int = 2048,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_format_errors: int = 3,
    max_time_s: float = 600.0,
    exec_timeout_s: float = 60.0,
    program_timeout_s: float | None = None,
    run_id: str | None = None,
    keep_sessions: bool = False,
    seed: int | None = None,
) -> list[Trajectory]:
    """Play ``group_size`` episodes of every task through ``program``; score; return them.

    Episode ``i`` plays ``tasks[i // group_size]`` (group member ``i % group_size``); its proxy session is named
    ``f"{run_id}-{i}"`` and its sandbox is whichever ``program.create`` gives (the program is told its id). One
    `Trajectory` each, in that order: reward the verdict's (+1 / -1; None for ``env_error``), ``reward_components``
    the verdict's, ``tools`` ``program.tools``, ``samples`` the proxy's (one per recorded call;
    `orchard.data.merge_prefix_samples` chains them), and ``metadata`` with ``harness``, ``session_id``,
    ``group_index``, ``steps``, ``format_errors``, ``tool_calls``, ``program.metadata(verdict)``, ``error``,
    ``wall_s`` and ``recorded_calls``.

    Args:
        program: the domain's part (`HarnessProgram`).
        tasks: the domain's tasks, at least one (checked by the domain, `check_tasks`).
        client: an ``orchard.env.AsyncSandboxClient``, or anything whose ``await create()`` gives one's sandbox
            and that has its ``base_url`` and ``api_key``; sandboxes are created, prepared, scored and deleted here.
        proxy: the `RecordingProxy` in front of the policy; its samples become `Trajectory.samples`.
        proxy_url: where the program reaches the proxy; None (default) serves ``proxy.app`` on this event loop on a
            free loopback port for the duration of the call (`serve_app`).
        env_url, env_key: the sandbox service as the program reaches it; default the client's URL and key. The key
            travels to the child in an environment variable (``program.key_env``), never on its command line.
        group_size: episodes per task (GRPO's group).
        concurrency: sandboxes prepared, episodes played and verdicts run at once.
        max_steps: assistant turns per episode (``step_budget``).
        max_tokens: per model call.
        temperature, top_p: sampling of every call.
        max_format_errors: malformed turns in a row that end an episode (``format_error``).
        max_time_s: wall-clock budget of one episode in the program (``time_budget``).
        exec_timeout_s: per command in a sandbox.
        program_timeout_s: the whole program's limit; default ``max_time_s x ceil(episodes / concurrency) + 120``.
            Episodes not reported when it is killed are ``env_error``.
        run_id: prefix of session ids; default random. Must be unique among live sandboxes.
        keep_sessions: keep the sessions' calls in the proxy afterwards. Default False (they are dropped, so a
            long-running proxy does not grow).
        seed: seeds each episode's proxy session (`RecordingProxy.seed_session`) with ``derive_seed(seed, task id,
            group index)``, so an episode samples the same wherever it is played. Default None: the program's
            requests carry no seed and sampling is left to the engine.
    """
    run_id, env_url, env_key = check_launch(
        client=client, proxy=proxy, counts={"group_size": group_size, "concurrency": concurrency,
                                            "max_steps": max_steps, "max_tokens": max_tokens,
                                            "max_format_errors": max_format_errors, **program.counts},
        seconds={"max_time_s": max_time_s, "exec_timeout_s": exec_timeout_s, **program.seconds},
        program_timeout_s=program_timeout_s, temperature=temperature, top_p=top_p, run_id=run_id,
        env_url=env_url, env_key=env_key)

    episodes = [ProgramEpisode(task, program.task_id(task), f"{run_id}-{i}", i % group_size)
                for i, task in enumerate(t for t in tasks for _ in range(group_size))]
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        for e in episodes:
            proxy.seed_session(e.session_id, derive_seed(seed, e.task_id, e.group_index))
    sandboxes: dict[str, Any] = {}
    semaphore = asyncio.Semaphore(concurrency)

    async def prepare(episode: ProgramEpisode) -> None:
        async with semaphore:
            try:
                sandbox = await program.create(episode.task, episode.session_id)
                sandboxes[episode.session_id] = sandbox
                keep_alive(sandbox)  # it may wait long for the program to reach its episode, and between turns
                await asyncio.wait_for(program.prepare(sandbox, episode.task), program.prepare_timeout_s)
                episode.termination_reason = "step_budget"  # ready; the program's report replaces this
            except program.prepare_errors as exc:
                # Whatever stops the set-up leaves the episode unplayed (env_error) and keeps the batch's others.
                episode.error = f"prepare: {type(exc).__name__}: {exc}"

    async def score(episode: ProgramEpisode) -> None:
        async with semaphore:
            try:
                verdict = await asyncio.wait_for(program.score(sandboxes[episode.session_id], episode.task),
                                                 program.score_timeout_s)
            except program.score_errors as exc:
                # The episode has no verdict: never the policy's -1, and the batch's other episodes are kept.
                episode.termination_reason = "env_error"
                episode.error = f"{program.score_step}: {type(exc).__name__}: {exc}"
                return
            episode.reward, episode.reward_components, episode.verdict = verdict.reward, verdict.components, verdict

    try:
        await asyncio.gather(*(prepare(e) for e in episodes))
        ready = [e for e in episodes if e.error is None]
        if ready:
            async with contextlib.AsyncExitStack() as stack:
                if proxy_url is None:
                    proxy_url = await stack.enter_async_context(serve_app(proxy.app))
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="harness-program-")))
                episodes_path, out_path = workdir / "episodes.jsonl", workdir / "results.jsonl"
                episodes_path.write_text("".join(
                    json.dumps({"session_id": e.session_id, "sandbox_id": sandboxes[e.session_id].sandbox_id,
                                "prompt": program.prompt(e.task)}) + "\n" for e in ready))
                argv = ["--model-url", proxy_url, "--env-url", env_url, "--env-key-env", program.key_env,
                        "--episodes", str(episodes_path), "--out", str(out_path),
                        "--concurrency", str(concurrency), "--max-steps", str(max_steps),
                        "--max-tokens", str(max_tokens), "--temperature", repr(float(temperature)),
                        "--top-p", repr(float(top_p)), "--max-format-errors", str(max_format_errors),
                        "--max-time-s", repr(float(max_time_s)), "--exec-timeout-s", repr(float(exec_timeout_s)),
                        *program.argv]
                limit = program_timeout_s or max_time_s * math.ceil(len(ready) / concurrency) + 120
                status, stderr = await program.run(argv, program_env(program.key_env, env_key), limit)
                results = read_results(out_path)
            for e in ready:
                result = results.get(e.session_id)
                if result is None:
                    e.termination_reason = "env_error"
                    e.error = f"program: no report (exit {status}): {stderr.strip()[-500:]}"
                else:
                    e.report(result)
            await asyncio.gather(*(score(e) for e in ready if e.termination_reason != "env_error"))
    finally:
        samples = {e.session_id: proxy.samples(e.session_id) for e in episodes}
        if not keep_sessions:
            for e in episodes:
                proxy.pop_session(e.session_id)
        await asyncio.shield(asyncio.gather(*(s.delete() for s in sandboxes.values()), return_exceptions=True))
    return [e.trajectory(samples[e.session_id], program) for e in episodes]
