"""Rollouts of the SWE harness program (tool and bash conventions): the recipe's side of the separate program.

The program (`orchard.domains.swe.tool_harness`) runs as a child process that sees only an OpenAI endpoint and
its sandboxes. The training data comes from the recording proxy in front of the policy, never from the program:
per model call, the prompt ids the engine saw (context, masked) and the ids it sampled (actions, supervised, with
their sampling log-probs).

One batch (`run_swe_episodes`)::

    for each instance x group member: a sandbox from client.create(**sandbox_options()) (a warm pool's, when the
        client is the recipe's `orchard.stages.PooledSandboxes`), prepare_sandbox (the repository at its base commit)
    write the episodes file (session id, sandbox id, opening user message)
    python -m orchard.domains.swe.tool_harness --convention tool|bash ...   # the proxy answers it from here
    for each episode that did not fail: score_sandbox -> +1 resolved / -1 not
    samples = proxy.samples(session id)                # then the session is dropped from the proxy
    delete every sandbox (always)

Environment failures (a sandbox that could not be created, prepared or scored; the program's own ``env_error``s;
an episode the program never reported, whatever its exit status) give ``env_error`` with ``reward = None``, never
a 0 or a -1. Preparing or scoring that raises anything (not only the sandbox client's errors: a snapshot that
cannot be read, a timeout while the patch is taken, a bug) counts so: the episode has no verdict, and the rest of
the batch is kept.
`SWEToolRollouts` and `SWEBashRollouts` wrap this as `orchard.rollout.Rollouts`, the interface the stages take.
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
from orchard.domains.swe.convention import MAX_OUTPUT_CHARS, TOOL_SCHEMAS, task_prompt
from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.sandbox import prepare_sandbox, sandbox_options, score_sandbox
from orchard.rollout.engine import derive_seed
from orchard.rollout.program import check_launch, program_env, read_results, run_program
from orchard.rollout.proxy import RecordingProxy
from orchard.rollout.rollouts import ProxyRollouts
from orchard.rollout.serving import serve_app

KEY_ENV = "ORCHARD_SWE_HARNESS_ENV_KEY"
"""The environment variable that hands the sandbox service's key to the child process."""

PROGRAM = "orchard.domains.swe.tool_harness"


@dataclass
class _Episode:
    """One episode's state while the batch runs (becomes a `Trajectory` at the end)."""

    instance: SWEInstance
    session_id: str
    group_index: int
    termination_reason: str
    steps: int = 0
    format_errors: int = 0
    tool_calls: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    tests: dict[str, bool] = field(default_factory=dict)
    patch: str = ""
    error: str | None = None
    wall_s: float = 0.0

    def trajectory(self, samples: list[RenderedSample], convention: str) -> Trajectory:
        """The episode as a `Trajectory` whose ``samples`` are the proxy's, one per recorded call, in order; with
        one call per assistant turn, each assistant message also carries its call's sampled ids and log-probs. The
        tool convention's ``tools`` are its schemas, so rendering the trajectory gives the prompts the model saw."""
        messages = [Message.from_dict(m) for m in self.messages]
        turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
        if turns and len(turns) == len(samples):
            for i, sample in zip(turns, samples, strict=True):
                action = sample.action_mask
                messages[i].token_ids = sample.input_ids[action].tolist()
                messages[i].logprobs = sample.old_logprobs[action].tolist()
        return Trajectory(
            messages=messages, tools=TOOL_SCHEMAS if convention == "tool" else [], reward=self.reward, reward_components=dict(self.reward_components),
            task_id=self.instance.instance_id, group_id=self.instance.instance_id,
            termination_reason=self.termination_reason,  # type: ignore[arg-type]
            metadata={"harness": convention, "session_id": self.session_id, "group_index": self.group_index,
                      "steps": self.steps, "format_errors": self.format_errors, "tool_calls": self.tool_calls,
                      "tests": dict(self.tests), "patch": self.patch, "error": self.error, "wall_s": self.wall_s,
                      "recorded_calls": len(samples)},
            samples=list(samples))


_run_program = partial(run_program, PROGRAM)
"""Runs the program (``orchard.rollout.program.run_program`` of this module); a test may put a spy here."""


async def run_swe_episodes(
    instances: Sequence[SWEInstance],
    *,
    client: Any,
    proxy: RecordingProxy,
    convention: str = "tool",
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
    test_timeout_s: float = 300.0,
    max_output_chars: int = MAX_OUTPUT_CHARS,
    program_timeout_s: float | None = None,
    run_id: str | None = None,
    keep_sessions: bool = False,
    seed: int | None = None,
) -> list[Trajectory]:
    """Play ``group_size`` episodes of every instance through the harness program; score; return them.

    Episode ``i`` plays ``instances[i // group_size]``; its proxy session is named ``f"{run_id}-{i}"`` and its
    sandbox is whichever ``client.create()`` gives (the program is told its id). One `Trajectory` each, in that
    order: reward +1 resolved / -1 not (None for ``env_error``), ``reward_components`` the verdict's
    (`SWEVerdict.components`), ``samples`` the proxy's (one per recorded call), ``metadata`` with ``harness`` (the
    convention), ``session_id``, ``group_index``, ``steps``, ``format_errors``, ``tool_calls``, ``tests`` (per
    decisive test: passed), ``patch`` (the agent's diff), ``error``, ``wall_s`` and ``recorded_calls``.

    Args:
        instances: the tasks, at least one.
        client: an ``orchard.env.AsyncSandboxClient``, or anything whose ``await create()`` gives one's sandbox
            and that has its ``base_url`` and ``api_key`` (``orchard.stages.PooledSandboxes``: from a warm pool);
            sandboxes are created, prepared, scored and deleted here.
        proxy: the `RecordingProxy` in front of the policy; its samples become `Trajectory.samples`.
        convention: "tool" (OpenHands') or "bash" (mini-swe-agent's). Default "tool".
        proxy_url: where the program reaches the proxy; None (default) serves ``proxy.app`` on this event loop.
        env_url, env_key: the sandbox service as the program reaches it; default the client's URL and key (the key
            travels in an environment variable, `KEY_ENV`).
        group_size: episodes per instance. Default 1.
        concurrency: sandboxes prepared, episodes played and scored at once. Default 8.
        max_steps: assistant turns per episode. Default 30.
        max_tokens: per model call. Default 2048.
        temperature, top_p: sampling of every call. Default 1.0, 1.0.
        max_format_errors: malformed turns in a row that end an episode (``format_error``). Default 3.
        max_time_s: wall-clock budget of one episode in the program. Default 600 (the paper's 10 minutes).
        exec_timeout_s: per command in a sandbox (and per set-up command). Default 60.
        test_timeout_s: the scoring test run's limit. Default 300.
        max_output_chars: observations keep their head and tail beyond this. Default 10 000.
        program_timeout_s: the whole program's limit; default ``max_time_s x ceil(episodes / concurrency) + 120``.
        run_id: prefix of session and sandbox ids; default random.
        keep_sessions: keep the sessions' calls in the proxy afterwards. Default False.
        seed: seeds each episode's proxy session (`RecordingProxy.seed_session`) with ``derive_seed(seed, task id,
            group index)``, so an episode samples the same wherever it is played. Default None: the program's
            requests carry no seed and sampling is left to the engine.
    """
    if isinstance(instances, (str, bytes)) or not isinstance(instances, Sequence) or not instances:
        raise ValueError(f"instances must be a non-empty sequence of SWEInstance, got {instances!r:.100}")
    for i, instance in enumerate(instances):
        if not isinstance(instance, SWEInstance):
            raise ValueError(f"instances[{i}] must be a SWEInstance, got {type(instance).__name__}")
    if convention not in ("tool", "bash"):
        raise ValueError(f"convention must be 'tool' or 'bash', got {convention!r}")
    run_id, env_url, env_key = check_launch(
        client=client, proxy=proxy, counts={"group_size": group_size, "concurrency": concurrency,
                                            "max_steps": max_steps, "max_tokens": max_tokens,
                                            "max_format_errors": max_format_errors,
                                            "max_output_chars": max_output_chars},
        seconds={"max_time_s": max_time_s, "exec_timeout_s": exec_timeout_s, "test_timeout_s": test_timeout_s},
        program_timeout_s=program_timeout_s, temperature=temperature, top_p=top_p, run_id=run_id,
        env_url=env_url, env_key=env_key)

    episodes = [_Episode(instance, f"{run_id}-{i}", i % group_size, "env_error")
                for i, instance in enumerate(x for x in instances for _ in range(group_size))]
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        for e in episodes:
            proxy.seed_session(e.session_id, derive_seed(seed, e.instance.instance_id, e.group_index))
    sandboxes: dict[str, Any] = {}
    semaphore = asyncio.Semaphore(concurrency)

    async def prepare(episode: _Episode) -> None:
        async with semaphore:
            try:
                sandbox = await client.create(**sandbox_options())
                sandboxes[episode.session_id] = sandbox
                await asyncio.wait_for(prepare_sandbox(sandbox, episode.instance, timeout=exec_timeout_s),
                                       4 * exec_timeout_s)
                episode.termination_reason = "step_budget"  # ready; the program's report replaces this
            except Exception as exc:
                # As in scoring: whatever stops the set-up (the sandbox, a snapshot that cannot be read, a bug) leaves
                # the episode unplayed (env_error) and keeps the batch's other episodes.
                episode.error = f"prepare: {type(exc).__name__}: {exc}"

    async def score(episode: _Episode) -> None:
        async with semaphore:
            try:
                verdict = await asyncio.wait_for(
                    score_sandbox(sandboxes[episode.session_id], episode.instance, test_timeout_s,
                                  setup_timeout_s=exec_timeout_s), test_timeout_s + 6 * exec_timeout_s)
            except Exception as exc:
                # Not only the environment's errors: whatever stops the verdict (a bug, a bad instance) leaves the
                # episode unscored, never the policy's -1, and must not lose the batch's other episodes.
                episode.termination_reason, episode.error = "env_error", f"score: {type(exc).__name__}: {exc}"
                return
            episode.reward, episode.reward_components = verdict.reward, verdict.components
            episode.tests, episode.patch = verdict.tests, verdict.patch

    try:
        await asyncio.gather(*(prepare(e) for e in episodes))
        ready = [e for e in episodes if e.error is None]
        if ready:
            async with contextlib.AsyncExitStack() as stack:
                if proxy_url is None:
                    proxy_url = await stack.enter_async_context(serve_app(proxy.app))
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="swe-harness-")))
                episodes_path, out_path = workdir / "episodes.jsonl", workdir / "results.jsonl"
                episodes_path.write_text("".join(
                    json.dumps({"session_id": e.session_id, "sandbox_id": sandboxes[e.session_id].sandbox_id,
                                "prompt": task_prompt(e.instance.problem_statement)}) + "\n" for e in ready))
                argv = ["--convention", convention, "--model-url", proxy_url, "--env-url", env_url,
                        "--env-key-env", KEY_ENV, "--episodes", str(episodes_path), "--out", str(out_path),
                        "--concurrency", str(concurrency), "--max-steps", str(max_steps),
                        "--max-tokens", str(max_tokens), "--temperature", repr(float(temperature)),
                        "--top-p", repr(float(top_p)), "--max-format-errors", str(max_format_errors),
                        "--max-time-s", repr(float(max_time_s)), "--exec-timeout-s", repr(float(exec_timeout_s)),
                        "--max-output-chars", str(max_output_chars)]
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
            await asyncio.gather(*(score(e) for e in ready if e.termination_reason != "env_error"))
    finally:
        samples = {e.session_id: proxy.samples(e.session_id) for e in episodes}
        if not keep_sessions:
            for e in episodes:
                proxy.pop_session(e.session_id)
        await asyncio.shield(asyncio.gather(*(s.delete() for s in sandboxes.values()), return_exceptions=True))
    return [e.trajectory(samples[e.session_id], convention) for e in episodes]


class SWEToolRollouts(ProxyRollouts):
    """`orchard.rollout.Rollouts` of the harness program: `run_swe_episodes` behind a fresh `RecordingProxy` per call
    (`orchard.rollout.rollouts.ProxyRollouts`), each trajectory's per-call samples chained by prefix.

    Args:
        client: the ``AsyncSandboxClient``; env_url / env_key: the service as the program reaches it.
        tokenizer: the policy's chat tokenizer (the proxy records token ids with it).
        convention: "tool" (OpenHands', default) or "bash" (mini-swe-agent's; `SWEBashRollouts`).
        **kwargs: the rest of `run_swe_episodes`'s keywords (``concurrency``, ``max_steps``, ``max_time_s``, ...).
    """

    def __init__(self, client: Any, tokenizer: Any, *, convention: str = "tool", env_url: str | None = None,
                 env_key: str | None = None, **kwargs: Any) -> None:
        if convention not in ("tool", "bash"):
            raise ValueError(f"convention must be 'tool' or 'bash', got {convention!r}")
        self.convention = convention
        super().__init__(partial(run_swe_episodes, client=client, convention=convention, env_url=env_url,
                                 env_key=env_key), tokenizer, **kwargs)


class SWEBashRollouts(SWEToolRollouts):
    """`SWEToolRollouts` of the bash convention (mini-swe-agent's): the same program with ``--convention bash``."""

    def __init__(self, client: Any, tokenizer: Any, **kwargs: Any) -> None:
        if "convention" in kwargs:
            raise ValueError("kwargs may not set 'convention': SWEBashRollouts plays the bash convention")
        super().__init__(client, tokenizer, convention="bash", **kwargs)
