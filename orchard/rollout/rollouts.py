"""One interface for every harness path: ``await rollouts(engine, tasks, group_size=..., temperature=...)``.

A recipe's stages (``orchard.stages``) do not care how an episode was played. Whether the harness is an in-process
agent loop (`AgentLoopRollouts`) or a program we do not control whose model calls the recording proxy turns into
training data (e.g. the Claw domain's text harness), a :class:`Rollouts` returns the same thing: one `Trajectory`
per episode, task-major (``group_size`` consecutive episodes per task), each with ``task_id`` / ``group_id`` set,
its reward scored by the domain's verifier, and its training samples in ``Trajectory.samples``. Environment
failures come back as ``env_error`` trajectories (never scored 0, never trained on). A domain whose RL reward needs
a judge wraps its rollouts in a subclass of :class:`JudgedRolloutsBase`, which judges every batch before it returns.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from orchard.data import RenderedSample, Trajectory, merge_prefix_samples, render_trajectory
from orchard.rollout.agent_loop import AgentLoop
from orchard.rollout.engine import Engine, SamplingParams
from orchard.rollout.harness import Harness
from orchard.rollout.program import check_engine_or_url
from orchard.rollout.proxy import RecordingProxy

__all__ = ["AgentLoopRollouts", "JudgedRolloutsBase", "ProxyRollouts", "Rollouts"]


@runtime_checkable
class Rollouts(Protocol):
    """Plays ``group_size`` episodes of every task with ``engine``; returns them task-major as trajectories.

    ``seed`` seeds the sampling: episode ``j`` of the task with id ``t`` samples from
    ``derive_seed(seed, t, j)`` alone (its turn ``k`` from ``derive_seed(that, k)``), so a task's episodes are the
    same whichever other tasks share the call; None leaves sampling to the engine's own generators.
    """

    async def __call__(self, engine: Engine, tasks: Sequence[Any], *, group_size: int, temperature: float,
                       max_tokens: int | None = None, seed: int | None = None) -> list[Trajectory]: ...


class AgentLoopRollouts:
    """`Rollouts` of an in-process `Harness` through the `AgentLoop`; each scored trajectory rendered to its samples.

    Args:
        client: an ``orchard.env.AsyncSandboxClient``.
        harness: the domain's `Harness`.
        tokenizer: the policy's chat tokenizer (rendering uses it too).
        max_tokens: per assistant turn when a call gives none. Default 512.
        seed: seeds each call's start jitter and retry backoff (a fresh draw per call; a call's ``seed`` seeds its
            sampling). Default None.
        render: a scored trajectory's training samples; default one sample, `render_trajectory` with
            ``tokenizer`` (a harness whose context drops part of the trajectory renders per turn instead: the GUI's
            screenshots).
        **loop_kwargs: the rest of `AgentLoop`'s keywords (``max_steps``, ``max_time_s``, ``concurrency``, ...);
            ``progress`` (a bar per call) defaults to whether stderr is an interactive terminal.
    """

    def __init__(self, client: Any, harness: Harness, tokenizer: Any, *, max_tokens: int = 512,
                 seed: int | None = None, render: Callable[[Trajectory], list[RenderedSample]] | None = None,
                 **loop_kwargs: Any) -> None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if render is not None and not callable(render):
            raise ValueError(f"render must be callable (Trajectory -> samples) or None, got {render!r}")
        for name in ("engine", "client", "harness", "tokenizer", "sampling", "seed"):
            if name in loop_kwargs:
                raise ValueError(f"loop_kwargs may not set {name!r}: it is an argument of the call or of this class")
        self.client, self.harness, self.tokenizer = client, harness, tokenizer
        self.max_tokens = max_tokens
        self.render = render or (lambda traj: [render_trajectory(traj, tokenizer)])
        self.loop_kwargs = {"progress": sys.stderr.isatty(), **loop_kwargs}
        self._rng = random.Random(seed)

    async def __call__(self, engine: Engine, tasks: Sequence[Any], *, group_size: int, temperature: float,
                       max_tokens: int | None = None, seed: int | None = None) -> list[Trajectory]:
        sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens or self.max_tokens)
        loop = AgentLoop(engine, self.client, self.harness, self.tokenizer, sampling=sampling,
                         seed=self._rng.randrange(2**31), **self.loop_kwargs)
        trajectories = await loop.run_many(tasks, group_size=group_size, seed=seed)
        for traj in trajectories:
            if traj.valid and traj.has_token_ids:
                traj.samples = self.render(traj)
        return trajectories


class ProxyRollouts:
    """`Rollouts` of a harness program that reaches the model only through a `RecordingProxy`.

    Each call puts a fresh proxy in front of ``engine``, awaits ``play(tasks, proxy=proxy, group_size=...,
    temperature=..., **kwargs)`` (with ``seed=`` too when the call is seeded: the runner seeds each episode's proxy
    session, `RecordingProxy.seed_session`) (the domain's runner: it serves the proxy to the program, runs it, scores the
    sandboxes, and returns task-major trajectories whose samples are the proxy's, one per recorded call), closes
    the proxy, and chains each trajectory's per-call samples by prefix into as few sequences as the conversation
    allows (`orchard.data.merge_prefix_samples`).

    Args:
        play: the domain's episode runner (e.g. the Claw text harness's ``run_text_episodes`` with its client bound).
        tokenizer: the policy's chat tokenizer (the proxy records token ids with it).
        **kwargs: passed to every ``play`` call; a call's ``max_tokens`` overrides theirs.
    """

    def __init__(self, play: Callable[..., Awaitable[list[Trajectory]]], tokenizer: Any, **kwargs: Any) -> None:
        if not callable(play):
            raise ValueError(f"play must be an async callable, got {type(play).__name__}")
        for name in ("tasks", "proxy", "group_size", "temperature", "seed"):
            if name in kwargs:
                raise ValueError(f"kwargs may not set {name!r}: it is an argument of the call")
        self.play, self.tokenizer, self.kwargs = play, tokenizer, kwargs

    async def __call__(self, engine: Engine, tasks: Sequence[Any], *, group_size: int, temperature: float,
                       max_tokens: int | None = None, seed: int | None = None) -> list[Trajectory]:
        kwargs = dict(self.kwargs)
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        if seed is not None:
            kwargs["seed"] = seed
        proxy = RecordingProxy(engine, self.tokenizer)
        try:
            trajectories = await self.play(tasks, proxy=proxy, group_size=group_size, temperature=temperature,
                                           **kwargs)
        finally:
            await proxy.aclose()
        for traj in trajectories:
            traj.samples = merge_prefix_samples(traj.samples)
        return trajectories


class JudgedRolloutsBase:
    """A `Rollouts` that judges every batch of another: ``await judged(engine, tasks, ...)`` plays the episodes with
    ``rollouts``, then :meth:`judge_batch` sets their RL reward in place, or takes a rollout out of the loss
    (``metadata["removed"]``: remove_sample) and counts it, before the batch goes back to the stage.

    A domain subclasses it with its judge call (`orchard.domains.swe.judge.JudgedRollouts`,
    `orchard.domains.gui.judge.JudgedGUIRollouts`). The last call's stats are in :attr:`stats`; :attr:`totals` sums
    the keys named in :attr:`counted` over calls (a mean summed over calls would mean nothing).

    Args:
        rollouts: the domain's `Rollouts`.
        judge: an OpenAI-compatible http(s) URL or an in-process ``Engine`` (its chat tokenizer from
            ``kwargs["tokenizer"]`` or its own).
        **kwargs: the rest of the domain's judge keywords, passed on by :meth:`judge_batch`.
    """

    counted: tuple[str, ...] = ()
    """The keys of :meth:`judge_batch`'s stats that are counts, summed into :attr:`totals`."""

    def __init__(self, rollouts: Rollouts, judge: Engine | str, **kwargs: Any) -> None:
        if not isinstance(rollouts, Rollouts):
            raise ValueError(f"rollouts must be a Rollouts (an async callable), got {type(rollouts).__name__}")
        check_engine_or_url(judge, kwargs.get("tokenizer"))
        self.rollouts, self.judge, self.kwargs = rollouts, judge, kwargs
        self.stats: dict[str, float] = {}
        self.totals: dict[str, float] = {}

    async def judge_batch(self, trajectories: list[Trajectory], tasks: Sequence[Any]) -> dict[str, float]:
        """Judge one batch in place (``tasks``: the ones it played); returns the judge's stats."""
        raise NotImplementedError

    async def __call__(self, engine: Engine, tasks: Sequence[Any], *, group_size: int, temperature: float,
                       max_tokens: int | None = None, seed: int | None = None) -> list[Trajectory]:
        trajectories = await self.rollouts(engine, tasks, group_size=group_size, temperature=temperature,
                                           max_tokens=max_tokens, seed=seed)
        self.stats = await self.judge_batch(trajectories, tasks)
        for key in self.counted:
            self.totals[key] = self.totals.get(key, 0.0) + self.stats.get(key, 0.0)
        return trajectories
