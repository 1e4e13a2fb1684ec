"""Monte-Carlo turn values of SWE trajectories: the share of fresh policy continuations from a state that resolve
the issue (VinePPO's estimate, `orchard.rollout.turn_values`), the alternative to the hindsight values an LLM reads
off a finished transcript (`orchard.domains.swe.values`).

The SWE part is the harness and the reward: an in-process harness replays the recorded calls and plays the
continuations, ``score_sandbox`` scores them (+1 resolved / -1 not), and a continuation's success is ``reward > 0``
(`resolved_success`). The harness is the convention the trajectories were played in: `SWEEvalHarness` (the
default), or `SWEToolHarness` for the tool convention, including trajectories the harness program recorded (it
observes as the program does, so their calls replay one for one). Use::

    estimator = swe_turn_value_estimator(policy, client, tokenizer, k=4)
    values = await swe_turn_values(failed, instances, estimator=estimator, seed=0)
    samples, stats = sft_samples(trajectories, mode="credit", step_values=step_value_lookup(failed, values))

Trajectories of the bash convention cannot be valued: it has no in-process harness (its actions are text, not
tool calls), and one of another convention's tools than the estimator's harness is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchard.data import Trajectory
from orchard.domains.swe.harness import SWEEvalHarness, SWEToolHarness
from orchard.domains.swe.instances import SWEInstance
from orchard.rollout.agent_loop import AgentLoop
from orchard.rollout.engine import Engine
from orchard.rollout.turn_values import TurnValueEstimator, TurnValues

__all__ = ["resolved_success", "swe_turn_value_estimator", "swe_turn_values"]


def resolved_success(reward: float) -> float:
    """A continuation's success from its SWE reward: 1 when it resolved the issue (reward > 0), else 0."""
    return 1.0 if reward > 0 else 0.0


def swe_turn_value_estimator(engine: Engine, client: Any, tokenizer: Any, *,
                             harness: SWEEvalHarness | SWEToolHarness | None = None,
                             k: int = 4, horizon: int | None = None, confidence: float = 0.95,
                             keep_continuations: bool = False, **loop_options: Any) -> TurnValueEstimator:
    """A `TurnValueEstimator` over an in-process SWE harness, its successes `resolved_success`.

    Args:
        engine: the policy whose continuations value the states.
        client: the ``AsyncSandboxClient`` (its service must allow snapshots and forks: the local backend does).
        tokenizer: the policy's chat tokenizer.
        harness: the convention the trajectories were played in: ``SWEEvalHarness()`` (default) or
            ``SWEToolHarness()`` (the tool convention, the harness program's trajectories included).
        k: continuations per state. Default 4.
        horizon: the episode's step budget (a continuation from ``s_t`` gets ``horizon - t``). Default the
            harness's ``max_steps``.
        confidence: coverage of the Wilson intervals. Default 0.95.
        keep_continuations: keep the continuation trajectories. Default False.
        **loop_options: `AgentLoop` keywords (``sampling``, ``concurrency``, ``max_time_s``, ...); ``progress``
            defaults to False.
    """
    harness = SWEEvalHarness() if harness is None else harness
    if not isinstance(harness, SWEEvalHarness | SWEToolHarness):
        raise ValueError(f"harness must be a SWEEvalHarness or a SWEToolHarness, got {type(harness).__name__}")
    loop_options.setdefault("progress", False)
    loop = AgentLoop(engine, client, harness, tokenizer, **loop_options)
    return TurnValueEstimator(loop, k=k, success=resolved_success, horizon=horizon, confidence=confidence,
                              keep_continuations=keep_continuations)


async def swe_turn_values(trajectories: Sequence[Trajectory], instances: Sequence[SWEInstance], *,
                          estimator: TurnValueEstimator, states: Sequence[Sequence[int] | None] | None = None,
                          seed: int | None = None) -> list[TurnValues]:
    """The Monte-Carlo values of every trajectory's states, each replayed on its instance (by ``task_id``, the
    instance's ``instance_id``); in order. ``states[i]`` (default every state) are trajectory ``i``'s states.

    Raises:
        ValueError: a trajectory whose ``task_id`` names none of ``instances``, or one played with other tools.
    """
    by_id: dict[str, SWEInstance] = {}
    for i, instance in enumerate(instances):
        if not isinstance(instance, SWEInstance):
            raise ValueError(f"instances[{i}] must be a SWEInstance, got {type(instance).__name__}")
        by_id[instance.instance_id] = instance
    tasks = []
    for i, traj in enumerate(trajectories):
        if not isinstance(traj, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(traj).__name__}")
        if traj.task_id not in by_id:
            raise ValueError(f"trajectories[{i}].task_id {traj.task_id!r} names none of the instances")
        tasks.append(by_id[traj.task_id])
    return await estimator.estimate_many(trajectories, tasks, states=states, seed=seed)
