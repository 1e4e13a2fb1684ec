"""Monte-Carlo turn values: the success rate of fresh policy continuations from a finished trajectory's states.

VinePPO's estimate (Kazemnejad et al. 2024, arXiv 2410.01679): the value of state ``s_t`` (before step ``t``, after
``t`` assistant turns and their observations) is the mean reward of ``K`` continuations the policy samples from
it. For one trajectory of an `AgentLoop` harness and a set of its states::

    sandbox = client.create(spec); harness.setup(sandbox, task)         # one replay sandbox per trajectory
    for t = 0 .. S:
        if t is asked for: snapshot_t = sandbox.snapshot()             # the workspace at s_t
            K x  loop.continue_from(task, snapshot_t.fork, messages before step t, max_steps = horizon - t)
        replay step t's tool calls through harness.act                 # the recorded calls, in order
    r[t, j] = success(reward of continuation j)  ∈ [0, 1]; env_error -> dropped (valid = False)
    V̂(s_t) = mean of the valid r[t, :]; Wilson interval              (orchard.value.monte_carlo_values)

Why replay and not snapshots taken during the original episode: replay works on any finished trajectory (the
policy's, a teacher's, one read from disk) and leaves the rollout path alone, where a snapshot after every turn of
every episode would cost a workspace copy per turn of every rollout, most of which are never valued. The price is
that the tools run a second time, and replay is faithful only when a tool's effect on the workspace is a function of
the workspace and the call (file edits and test runs are; a command that reads the clock or the network is not).
``cost["mc/replay_mismatches"]`` counts replayed observations whose text differs from the recorded one, a
diagnostic only: a timing in a test runner's summary differs too. Processes are not carried into snapshots or forks
(the sandbox service copies workspaces); a harness that keeps state in a process cannot be valued this way.

Continuations start from the recorded messages up to ``s_t`` (the prompt is tokenized anew; the policy's sampled
ids of those turns stay in the trajectory) and run under the loop's budgets with ``horizon - t`` steps left
(``horizon`` defaults to the loop's ``max_steps``, the original episode's budget). A state from which no step is
left, or the last state of an episode that ended itself (``done``), is scored as it is: one fork, no sampling, and
that score fills its ``K`` columns (the verifier is deterministic; ``terminal`` marks these rows).

Environment failures are not policy failures: a continuation that ends ``env_error`` (its fork, a tool call or its
scoring failed) is dropped, never scored 0; a replay that fails leaves the states after it without a continuation
(``valued`` False), and ``TurnValues.step_values`` leaves them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from orchard.data import Message, Trajectory
from orchard.rollout.agent_loop import ENV_ERRORS, AgentLoop
from orchard.rollout.engine import derive_seed
from orchard.rollout.harness import InvalidToolCall, keep_alive, task_id
from orchard.value.monte_carlo import MonteCarloValues, monte_carlo_step_values, monte_carlo_values

__all__ = ["COST_KEYS", "TurnValueEstimator", "TurnValues", "step_value_lookup"]

COST_KEYS = ("mc/states", "mc/snapshots", "mc/forks", "mc/continuations", "mc/env_errors", "mc/replayed_calls",
             "mc/replay_mismatches", "mc/model_calls", "mc/prompt_tokens", "mc/sampled_tokens", "mc/wall_s")
"""What an estimate cost: states valued, workspace snapshots and forks taken, continuations played and those lost to
the environment, tool calls replayed (and observations that came back different), model calls, prompt tokens
(prefill) and sampled tokens, and wall-clock seconds."""


@dataclass
class TurnValues:
    """The Monte-Carlo values of one trajectory's states.

    Fields:
        states: the valued state indices, ascending. Shape: ``[S]``.
        rewards: success reward of continuation ``j`` from ``states[i]``; NaN where it was lost. Shape: ``[S, K]``.
        valid: True where the continuation finished. Shape: ``[S, K]``.
        estimate: means and Wilson intervals (`orchard.value.MonteCarloValues`), ``[S]`` fields.
        terminal: True where the state was scored as it is (no step left, or the episode's end). Shape: ``[S]``.
        cost: `COST_KEYS`, as floats.
        error: why the replay stopped early (the states after it have no continuation), else None.
        continuations: the continuation trajectories ``[S][K]`` (prefix included) when the estimator keeps them,
            else None.
    """

    states: list[int]
    rewards: Tensor
    valid: Tensor
    estimate: MonteCarloValues
    terminal: list[bool]
    cost: dict[str, float]
    error: str | None = None
    continuations: list[list[Trajectory | None]] | None = None

    def step_values(self) -> dict[int, float]:
        """``{state index: V̂}`` of the states with a valid continuation, for
        ``orchard.stages.sft_samples(..., mode="credit", step_values=...)`` (see `step_value_lookup`)."""
        return monte_carlo_step_values(self.states, self.estimate)


def step_value_lookup(trajectories: Sequence[Trajectory], values: Sequence[TurnValues | None],
                      ) -> Callable[[Trajectory], dict[int, float] | None]:
    """The ``step_values`` callable of ``orchard.stages.sft_samples``: each of ``trajectories`` (by identity) to its
    ``values[i].step_values()``; None (no credit, counted as unvalued) for a trajectory without values, with none
    valued, or not in ``trajectories``."""
    if len(trajectories) != len(values):
        raise ValueError(f"values must have one entry per trajectory ({len(trajectories)}), got {len(values)}")
    table = {id(traj): (v.step_values() or None) if v is not None else None
             for traj, v in zip(trajectories, values, strict=True)}
    keep = list(trajectories)  # holds the trajectories, so no other object takes one's id while the lookup lives

    def lookup(trajectory: Trajectory) -> dict[int, float] | None:
        return table.get(id(trajectory)) if keep else None

    return lookup


def _prefixes(messages: Sequence[Message]) -> list[int]:
    """End (exclusive) of the message prefix of every state ``0 .. S``: before each assistant turn, then the end."""
    ends = [i for i, m in enumerate(messages) if m.role == "assistant"]
    return [*ends, len(messages)]


class TurnValueEstimator:
    """Monte-Carlo values of finished trajectories' states, sampled with ``loop``'s engine in forks of their
    replayed workspaces (module docstring).

    Args:
        loop: the `AgentLoop` whose engine is the policy and whose harness played the trajectories (its tools
            replay the recorded calls, its ``evaluate`` is the domain's reward); its ``concurrency`` bounds the
            sandboxes in use at once (replays and continuations), its budgets and retries apply to every
            continuation.
        k: continuations per state. Default 4.
        success: maps a continuation's reward to a success in ``[0, 1]`` (SWE: ``reward > 0``). Default: the reward
            itself, which must then lie in ``[0, 1]``.
        horizon: the episode's step budget; a continuation from ``s_t`` gets ``horizon - t`` steps. Default the
            loop's ``max_steps``.
        confidence: coverage of the Wilson intervals. Default 0.95.
        keep_continuations: keep every continuation trajectory in `TurnValues.continuations`. Default False.
    """

    def __init__(self, loop: AgentLoop, *, k: int = 4, success: Callable[[float], float] | None = None,
                 horizon: int | None = None, confidence: float = 0.95, keep_continuations: bool = False) -> None:
        if not isinstance(loop, AgentLoop):
            raise ValueError(f"loop must be an AgentLoop, got {type(loop).__name__}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if success is not None and not callable(success):
            raise ValueError(f"success must be a callable from a reward to [0, 1], got {success!r}")
        horizon = loop.max_steps if horizon is None else horizon
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"horizon must be an int >= 1, got {horizon!r}")
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
            raise ValueError(f"confidence must be a number in (0, 1), got {confidence!r}")
        self.loop = loop
        self.k = k
        self.success = success
        self.horizon = horizon
        self.confidence = float(confidence)
        self.keep_continuations = bool(keep_continuations)
        self._slots: asyncio.Semaphore | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.loop.concurrency)
        return self._slots

    def _score(self, trajectory: Trajectory) -> float | None:
        """The continuation's success in [0, 1], or None when the environment lost it."""
        if trajectory.termination_reason == "env_error" or trajectory.reward is None:
            return None
        value = float(self.success(trajectory.reward)) if self.success is not None else float(trajectory.reward)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"success must map rewards into [0, 1], got {value!r} for reward {trajectory.reward!r}"
                             + ("" if self.success is not None else " (pass success= for this domain's rewards)"))
        return value

    def _states(self, trajectory: Trajectory, states: Sequence[int] | None) -> list[int]:
        last = trajectory.num_steps
        if states is None:
            return list(range(last + 1))
        if isinstance(states, (str, bytes)) or not isinstance(states, Sequence):
            raise ValueError(f"states must be a sequence of state indices, got {type(states).__name__}")
        for s in states:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= last:
                raise ValueError(f"states must be state indices in [0, {last}] (the trajectory's steps), got {s!r}")
        return sorted(set(states))

    async def estimate(self, trajectory: Trajectory, task: Any, *, states: Sequence[int] | None = None,
                       seed: int | None = None) -> TurnValues:
        """The values of ``states`` (default every state ``0 .. S``) of ``trajectory``, an episode of ``task``.

        ``seed`` (default the loop's ``sampling.seed``) seeds continuation ``j`` from state ``t`` with
        ``derive_seed(seed, "mc", task id, t, j)``, so the ``K`` continuations differ; None leaves sampling to the
        engine. Never raises for environment or model failures (those continuations are dropped); raises ValueError
        for bad arguments or a reward ``success`` does not map into ``[0, 1]``.
        """
        if not isinstance(trajectory, Trajectory):
            raise ValueError(f"trajectory must be a Trajectory, got {type(trajectory).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        wanted = self._states(trajectory, states)
        seed = self.loop.sampling.seed if seed is None else seed
        offered = sorted(t.get("function", t).get("name") for t in self.loop.harness.tools(task))
        recorded = sorted(t.get("function", t).get("name") for t in trajectory.tools)
        if trajectory.tools and recorded != offered:
            raise ValueError(f"trajectory was played with the tools {recorded}, but the loop's harness offers "
                             f"{offered}: its calls cannot be replayed there")
        t0 = time.monotonic()
        tid = task_id(task, default=trajectory.task_id or "task")
        rows = {state: row for row, state in enumerate(wanted)}
        ends = _prefixes(trajectory.messages)
        last = trajectory.num_steps
        terminal = [s >= self.horizon or (s == last and trajectory.termination_reason == "done") for s in wanted]
        scores: list[list[float | None]] = [[None] * self.k for _ in wanted]
        kept: list[list[Trajectory | None]] = [[None] * self.k for _ in wanted]
        cost = dict.fromkeys(COST_KEYS, 0.0)
        cost["mc/states"] = float(len(wanted))
        running: list[asyncio.Task[None]] = []

        async def continuations(state: int, snapshot: Any) -> None:
            row = rows[state]
            plays = 1 if terminal[row] else self.k
            budget = 0 if terminal[row] else self.horizon - state
            prefix = trajectory.messages[: ends[state]]

            async def play(j: int) -> None:
                async with self._semaphore():
                    run_seed = None if seed is None else derive_seed(seed, "mc", tid, state, j)
                    traj = await self.loop.continue_from(task, snapshot.fork, prefix, max_steps=budget,
                                                         group_id=tid, seed=run_seed)
                meta = traj.metadata
                cost["mc/forks"] += meta.get("sandbox_id") is not None
                cost["mc/continuations"] += 1
                cost["mc/env_errors"] += traj.termination_reason == "env_error"
                for key in ("model_calls", "prompt_tokens", "sampled_tokens"):
                    cost[f"mc/{key}"] += meta.get(key, 0)
                scores[row][j] = self._score(traj)
                kept[row][j] = traj if self.keep_continuations else None

            try:
                # every sibling finishes (and deletes its fork) before a bug in one of them surfaces
                failures = [r for r in await asyncio.gather(*(play(j) for j in range(plays)), return_exceptions=True)
                            if isinstance(r, BaseException)]
                if failures:
                    raise failures[0]
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(snapshot.delete()), self.loop.env_timeout_s)
            if terminal[row]:
                scores[row] = [scores[row][0]] * self.k

        def snapshotted(state: int, snapshot: Any) -> None:
            cost["mc/snapshots"] += 1
            running.append(asyncio.ensure_future(continuations(state, snapshot)))

        try:
            error = await self._replay(trajectory, task, set(wanted), snapshotted, cost) if wanted else None
            await asyncio.gather(*running)
        finally:
            for pending in running:
                pending.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        rewards = torch.tensor([[float("nan") if x is None else x for x in row] for row in scores],
                               dtype=torch.float64).reshape(len(wanted), self.k)  # [S, K]
        valid = ~torch.isnan(rewards)  # [S, K]
        cost["mc/wall_s"] = time.monotonic() - t0
        return TurnValues(states=wanted, rewards=rewards, valid=valid,
                          estimate=monte_carlo_values(rewards, valid, confidence=self.confidence), terminal=terminal,
                          cost=cost, error=error, continuations=kept if self.keep_continuations else None)

    async def _replay(self, trajectory: Trajectory, task: Any, wanted: set[int],
                      snapshotted: Callable[[int, Any], None], cost: dict[str, float]) -> str | None:
        """Replay ``trajectory``'s tool calls in a fresh sandbox and snapshot it at each wanted state; returns why it
        stopped early, or None."""
        loop, harness = self.loop, self.loop.harness
        names = {t.get("function", t).get("name") for t in harness.tools(task)}
        recorded: Mapping[str | None, str] = {m.tool_call_id: m.text for m in trajectory.messages
                                             if m.role == "tool" and m.tool_call_id is not None}
        turns = [m for m in trajectory.messages if m.role == "assistant"]

        async def call(what: str, make: Callable[[], Any]) -> Any:
            try:
                return await asyncio.wait_for(make(), loop.env_timeout_s)
            except ENV_ERRORS as exc:
                raise _ReplayFailed(f"{what}: {type(exc).__name__}: {exc}") from exc

        sandbox = None
        async with self._semaphore():
            try:
                sandbox = await call("create", lambda: loop.client.create(**harness.sandbox_spec(task)))
                keep_alive(sandbox)
                await call("setup", lambda: harness.setup(sandbox, task))
                for state in range(len(turns) + 1):
                    if state in wanted:
                        snapshotted(state, await call("snapshot", sandbox.snapshot))
                    if state == len(turns) or state >= max(wanted):
                        break
                    for tool_call in turns[state].tool_calls:
                        if tool_call.name not in names:
                            continue  # the loop did not run it either
                        try:
                            observation = (await call(f"tool {tool_call.name}",
                                                      lambda c=tool_call: harness.act(sandbox, c, task))).content
                        except InvalidToolCall as exc:
                            observation = f"Error: {exc}"
                        cost["mc/replayed_calls"] += 1
                        cost["mc/replay_mismatches"] += recorded.get(tool_call.id) != observation
            except _ReplayFailed as exc:
                return str(exc)
            finally:
                if sandbox is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.shield(sandbox.delete()), loop.env_timeout_s)
        return None

    async def estimate_many(self, trajectories: Sequence[Trajectory], tasks: Sequence[Any], *,
                            states: Sequence[Sequence[int] | None] | None = None,
                            seed: int | None = None) -> list[TurnValues]:
        """`estimate` of every trajectory (``tasks[i]`` its task; ``states[i]`` its states, default all), sharing the
        loop's ``concurrency``; results in order. Trajectory ``i`` is seeded with ``derive_seed(seed, "trajectory",
        i)`` (``seed`` defaults to the loop's ``sampling.seed``; None leaves sampling to the engine)."""
        if len(tasks) != len(trajectories):
            raise ValueError(f"tasks must have one task per trajectory ({len(trajectories)}), got {len(tasks)}")
        if states is not None and len(states) != len(trajectories):
            raise ValueError(f"states must have one entry per trajectory ({len(trajectories)}), got {len(states)}")
        seed = self.loop.sampling.seed if seed is None else seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        return list(await asyncio.gather(*(
            self.estimate(traj, task, states=None if states is None else states[i],
                          seed=None if seed is None else derive_seed(seed, "trajectory", i))
            for i, (traj, task) in enumerate(zip(trajectories, tasks, strict=True)))))


class _ReplayFailed(Exception):
    pass
