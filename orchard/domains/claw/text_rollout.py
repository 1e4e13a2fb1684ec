"""Rollouts of the Claw text harness: the recipe's side of the separate program.

The text harness (`orchard.domains.claw.text_harness`) runs as a child process that sees only an OpenAI endpoint
and its sandboxes. The training data comes from the recording proxy in front of the policy, never from the
program: per model call, the prompt ids the engine saw (context, masked) and the ids it sampled (actions,
supervised, with their sampling log-probs). So the recipe trains a harness whose prompting it does not control.

One batch (`run_text_episodes`)::

    for each task x group member:  create a sandbox, upload the world and the task's state (prepare_sandbox)
    write the episodes file (session id, sandbox id, prompt)
    python -m orchard.domains.claw.text_harness ...   # child process; the proxy answers it from this process
    for each episode that did not fail: upload the checks, run the verifier (verify_sandbox) -> +1 / -1
    samples = proxy.samples(session id)                # then the session is dropped from the proxy
    delete every sandbox (always, errors and cancellation included)

Where the proxy runs: on the caller's event loop (`orchard.rollout.serving.serve_app`), not in a thread, so the
program's model calls and the caller's other rollouts reach the engine together (`HFEngine` batches them
continuously). The child process blocks nothing: it is awaited.

Environment failures (a sandbox that could not be created, prepared or verified; the program's own ``env_error``s;
an episode the program never reported, e.g. because it crashed or ran past its time) give ``env_error`` with
``reward = None``: the caller drops them, never scores them 0 (`Trajectory.valid` is False).

`ClawTextRollouts` wraps all of this as an `orchard.rollout.Rollouts`, the interface the stages take.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from orchard.data import Message, RenderedSample, Trajectory
from orchard.domains.claw.harness import prepare_sandbox, verify_sandbox
from orchard.domains.claw.tasks import ClawTask
from orchard.rollout.agent_loop import ENV_ERRORS
from orchard.rollout.engine import derive_seed
from orchard.rollout.program import check_launch, program_env, read_results, run_program
from orchard.rollout.proxy import RecordingProxy
from orchard.rollout.rollouts import ProxyRollouts
from orchard.rollout.serving import serve_app

KEY_ENV = "ORCHARD_TEXT_HARNESS_ENV_KEY"
"""The environment variable that hands the sandbox service's key to the child process."""

PROGRAM = "orchard.domains.claw.text_harness"

VERIFY_ERRORS: tuple[type[BaseException], ...] = (*ENV_ERRORS, ValueError)
"""A verifier that could not run, or printed no verdict (`parse_verdict`'s ValueError), failed the environment."""


@dataclass
class _Episode:
    """One episode's state while the batch runs (becomes a `Trajectory` at the end)."""

    task: ClawTask
    session_id: str
    group_index: int
    termination_reason: str
    steps: int = 0
    format_errors: int = 0
    tool_calls: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    wall_s: float = 0.0

    def trajectory(self, samples: list[RenderedSample]) -> Trajectory:
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
            messages=messages, reward=self.reward, reward_components=dict(self.reward_components),
            task_id=self.task.id, group_id=self.task.id, termination_reason=self.termination_reason,  # type: ignore[arg-type]
            metadata={"harness": "text", "session_id": self.session_id, "group_index": self.group_index,
                      "steps": self.steps, "format_errors": self.format_errors, "tool_calls": self.tool_calls,
                      "error": self.error, "wall_s": self.wall_s, "recorded_calls": len(samples)},
            samples=list(samples))


_run_program = partial(run_program, PROGRAM)
"""Runs the program (``orchard.rollout.program.run_program`` of this module); a test may put a spy here."""


async def run_text_episodes(
    tasks: Sequence[ClawTask],
    *,
    client: Any,
    proxy: RecordingProxy,
    proxy_url: str | None = None,
    env_url: str | None = None,
    env_key: str | None = None,
    group_size: int = 1,
    concurrency: int = 8,
    max_steps: int = 6,
    max_tokens: int = 96,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_format_errors: int = 3,
    max_time_s: float = 600.0,
    exec_timeout_s: float = 30.0,
    program_timeout_s: float | None = None,
    run_id: str | None = None,
    keep_sessions: bool = False,
    seed: int | None = None,
) -> list[Trajectory]:
    """Play ``group_size`` episodes of every task through the text-harness program; verify; return them.

    Episode ``i`` plays ``tasks[i // group_size]`` (group member ``i % group_size``); its proxy session and its
    sandbox are both named ``f"{run_id}-{i}"``. Results come in that order, one `Trajectory` each: reward +1 when
    every check passed, else -1 (the verifier's RL reward; None for ``env_error``), ``reward_components`` the
    verdict's parts (``passed`` is the evaluation's task-score rule, which `Trajectory.passed` reads), ``samples`` the proxy's
    training samples (one per recorded call; `orchard.data.merge_prefix_samples` chains them), and
    ``metadata`` with ``harness="text"``, ``session_id``, ``group_index``, ``steps``, ``format_errors``,
    ``tool_calls``, ``error``, ``wall_s`` and ``recorded_calls``.

    Args:
        tasks: the tasks (`ClawTask`), at least one.
        client: an ``orchard.env.AsyncSandboxClient``; sandboxes are created, prepared, verified and deleted here.
        proxy: the `RecordingProxy` in front of the policy; its samples become `Trajectory.samples`.
        proxy_url: where the program reaches the proxy; None (default) serves ``proxy.app`` on this event loop on a
            free loopback port for the duration of the call (`serve_app`).
        env_url, env_key: the sandbox service as the program reaches it; default the client's URL and key. The key
            travels to the child in an environment variable (`KEY_ENV`), never on its command line.
        group_size: episodes per task (GRPO's group). Default 1.
        concurrency: sandboxes prepared, episodes played and verdicts run at once. Default 8.
        max_steps: assistant turns per episode (``step_budget``). Default 6.
        max_tokens: per model call. Default 96.
        temperature, top_p: sampling of every call. Default 1.0, 1.0.
        max_format_errors: malformed turns in a row that end an episode (``format_error``). Default 3.
        max_time_s: wall-clock budget of one episode in the program (``time_budget``). Default 600 (the paper's
            10-minute rollout budget).
        exec_timeout_s: per command in a sandbox. Default 30.
        program_timeout_s: the whole program's limit; default ``max_time_s x ceil(episodes / concurrency) + 120``.
            Episodes not reported when it is killed are ``env_error``.
        run_id: prefix of session and sandbox ids; default random. Must be unique among live sandboxes.
        keep_sessions: keep the sessions' calls in the proxy afterwards. Default False (they are dropped, so a
            long-running proxy does not grow).
        seed: seeds each episode's proxy session (`RecordingProxy.seed_session`) with ``derive_seed(seed, task id,
            group index)``, so an episode samples the same wherever it is played. Default None: the program's
            requests carry no seed and sampling is left to the engine.
    """
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence) or not tasks:
        raise ValueError(f"tasks must be a non-empty sequence of ClawTask, got {tasks!r:.100}")
    for i, task in enumerate(tasks):
        if not isinstance(task, ClawTask):
            raise ValueError(f"tasks[{i}] must be a ClawTask, got {type(task).__name__}")
    run_id, env_url, env_key = check_launch(
        client=client, proxy=proxy, counts={"group_size": group_size, "concurrency": concurrency,
                                            "max_steps": max_steps, "max_tokens": max_tokens,
                                            "max_format_errors": max_format_errors},
        seconds={"max_time_s": max_time_s, "exec_timeout_s": exec_timeout_s}, program_timeout_s=program_timeout_s,
        temperature=temperature, top_p=top_p, run_id=run_id, env_url=env_url, env_key=env_key)

    episodes = [_Episode(task, f"{run_id}-{i}", i % group_size, "env_error")
                for i, task in enumerate(t for t in tasks for _ in range(group_size))]
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        for e in episodes:
            proxy.seed_session(e.session_id, derive_seed(seed, e.task.id, e.group_index))
    sandboxes: dict[str, Any] = {}
    semaphore = asyncio.Semaphore(concurrency)

    async def prepare(episode: _Episode) -> None:
        async with semaphore:
            try:
                sandbox = await client.create(sandbox_id=episode.session_id)
                sandboxes[episode.session_id] = sandbox
                await asyncio.wait_for(prepare_sandbox(sandbox, episode.task, timeout=exec_timeout_s),
                                       exec_timeout_s)
                episode.termination_reason = "step_budget"  # ready; the program's report replaces this
            except ENV_ERRORS as exc:
                episode.error = f"prepare: {type(exc).__name__}: {exc}"

    async def verify(episode: _Episode) -> None:
        async with semaphore:
            try:
                verdict = await asyncio.wait_for(
                    verify_sandbox(sandboxes[episode.session_id], episode.task, timeout=exec_timeout_s),
                    exec_timeout_s + 30)
            except VERIFY_ERRORS as exc:
                episode.termination_reason, episode.error = "env_error", f"verify: {type(exc).__name__}: {exc}"
                return
            episode.reward, episode.reward_components = verdict.reward, verdict.components

    try:
        await asyncio.gather(*(prepare(e) for e in episodes))
        ready = [e for e in episodes if e.error is None]
        if ready:
            async with contextlib.AsyncExitStack() as stack:
                if proxy_url is None:
                    proxy_url = await stack.enter_async_context(serve_app(proxy.app))
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="claw-text-")))
                episodes_path, out_path = workdir / "episodes.jsonl", workdir / "results.jsonl"
                episodes_path.write_text("".join(
                    json.dumps({"session_id": e.session_id, "sandbox_id": e.session_id, "prompt": e.task.prompt})
                    + "\n" for e in ready))
                argv = ["--model-url", proxy_url, "--env-url", env_url, "--env-key-env", KEY_ENV,
                        "--episodes", str(episodes_path), "--out", str(out_path),
                        "--concurrency", str(concurrency), "--max-steps", str(max_steps),
                        "--max-tokens", str(max_tokens), "--temperature", repr(float(temperature)),
                        "--top-p", repr(float(top_p)), "--max-format-errors", str(max_format_errors),
                        "--max-time-s", repr(float(max_time_s)), "--exec-timeout-s", repr(float(exec_timeout_s))]
                limit = program_timeout_s or max_time_s * math.ceil(len(ready) / concurrency) + 120
                status, stderr = await _run_program(argv, program_env(KEY_ENV, env_key), limit)
                results = read_results(out_path)
            for e in ready:
                result = results.get(e.session_id)
                if result is None:
                    e.termination_reason = "env_error"
                    e.error = f"program: no report (exit {status}): {stderr.strip()[-500:]}"
                    continue
                e.termination_reason = result["termination_reason"]
                e.steps, e.format_errors = int(result["steps"]), int(result["format_errors"])
                e.tool_calls, e.messages = int(result["tool_calls"]), list(result["messages"])
                e.error, e.wall_s = result.get("error"), float(result.get("wall_s", 0.0))
            await asyncio.gather(*(verify(e) for e in ready if e.termination_reason != "env_error"))
    finally:
        samples = {e.session_id: proxy.samples(e.session_id) for e in episodes}
        if not keep_sessions:
            for e in episodes:
                proxy.pop_session(e.session_id)
        await asyncio.shield(asyncio.gather(*(s.delete() for s in sandboxes.values()), return_exceptions=True))
    return [e.trajectory(samples[e.session_id]) for e in episodes]


class ClawTextRollouts(ProxyRollouts):
    """`orchard.rollout.Rollouts` of the text harness: `run_text_episodes` behind a fresh `RecordingProxy` per call
    (`orchard.rollout.rollouts.ProxyRollouts`), each trajectory's per-call samples chained by prefix.

    Args:
        client: the ``AsyncSandboxClient``; env_url / env_key: the service as the program reaches it (default the
            client's).
        tokenizer: the policy's chat tokenizer (the proxy records token ids with it).
        **kwargs: the rest of `run_text_episodes`'s keywords (``concurrency``, ``max_steps``, ``max_tokens``,
            ``max_time_s``, ...).
    """

    def __init__(self, client: Any, tokenizer: Any, *, env_url: str | None = None, env_key: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(partial(run_text_episodes, client=client, env_url=env_url, env_key=env_key), tokenizer,
                         **kwargs)


def summarize_text_episodes(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Counts and rates of a batch of `run_text_episodes` trajectories, under ``text/`` keys.

    ``episodes``, ``env_errors``, ``format_error_episodes`` (ended by ``format_error``), ``format_errors`` (malformed
    turns, all episodes), ``success_rate`` (passed / scored episodes; 0 when none was scored), ``mean_steps`` (over
    all episodes), and ``termination/<reason>`` for each reason seen. An empty batch gives zeros.
    """
    if isinstance(trajectories, (str, bytes)) or not isinstance(trajectories, Sequence):
        raise ValueError(f"trajectories must be a sequence of Trajectory, got {type(trajectories).__name__}")
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(t).__name__}")
    n = len(trajectories)
    scored = [t for t in trajectories if t.valid]
    out = {
        "text/episodes": float(n),
        "text/env_errors": float(sum(t.is_env_error for t in trajectories)),
        "text/format_error_episodes": float(sum(t.termination_reason == "format_error" for t in trajectories)),
        "text/format_errors": float(sum(t.metadata.get("format_errors", 0) for t in trajectories)),
        "text/success_rate": sum(t.passed for t in scored) / len(scored) if scored else 0.0,
        "text/mean_steps": sum(t.metadata.get("steps", t.num_steps) for t in trajectories) / n if n else 0.0,
    }
    for t in trajectories:
        key = f"text/termination/{t.termination_reason}"
        out[key] = out.get(key, 0.0) + 1.0
    return out
