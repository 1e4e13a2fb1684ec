"""Rollouts of the Claw text harness: the recipe's side of the separate program.

The text harness (`orchard.domains.claw.text_harness`) runs as a child process that sees only an OpenAI endpoint
and its sandboxes. The training data comes from the recording proxy in front of the policy, never from the
program: per model call, the prompt ids the engine saw (context, masked) and the ids it sampled (actions,
supervised, with their sampling log-probs). So the recipe trains a harness whose prompting it does not control.

The batch is every harness program's (`orchard.rollout.program_runner.run_program_episodes`: sandboxes, the
episodes file, the proxy served on the caller's event loop, the program, verdicts, env_error handling, clean-up);
this module gives the text harness's part (`HarnessProgram`): a sandbox named by the episode's session with the
world and the task's state uploaded (`prepare_sandbox`), the task's prompt, and the verifier's verdict
(`verify_sandbox`: +1 when every check passed, else -1). A sandbox that could not be created, prepared or verified
gives ``env_error`` with ``reward = None``.

`ClawTextRollouts` wraps all of this as an `orchard.rollout.Rollouts`, the interface the stages take.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from orchard.data import Trajectory
from orchard.domains.claw.harness import prepare_sandbox, verify_sandbox
from orchard.domains.claw.tasks import ClawTask
from orchard.rollout.agent_loop import ENV_ERRORS
from orchard.rollout.program import run_program
from orchard.rollout.program_runner import HarnessProgram, check_tasks, run_program_episodes
from orchard.rollout.proxy import RecordingProxy
from orchard.rollout.rollouts import ProxyRollouts

KEY_ENV = "ORCHARD_TEXT_HARNESS_ENV_KEY"
"""The environment variable that hands the sandbox service's key to the child process."""

PROGRAM = "orchard.domains.claw.text_harness"

VERIFY_ERRORS: tuple[type[BaseException], ...] = (*ENV_ERRORS, ValueError)
"""A verifier that could not run, or printed no verdict (`parse_verdict`'s ValueError), failed the environment."""

_run_program = partial(run_program, PROGRAM)
"""Runs the program (``orchard.rollout.program.run_program`` of this module); a test may put a spy here."""


async def run_text_episodes(tasks: Sequence[ClawTask], *, client: Any, proxy: RecordingProxy, max_steps: int = 6,
                            max_tokens: int = 96, exec_timeout_s: float = 30.0, **options: Any) -> list[Trajectory]:
    """Play ``group_size`` episodes of every task through the text-harness program; verify; return them.

    `orchard.rollout.program_runner.run_program_episodes` with the text harness's part. Episode ``i`` plays
    ``tasks[i // group_size]``; its proxy session and its sandbox are both named ``f"{run_id}-{i}"``. Results come
    in that order, one `Trajectory` each: reward +1 when every check passed, else -1 (the verifier's RL reward; None
    for ``env_error``), ``reward_components`` the verdict's parts (``passed`` is the evaluation's task-score rule,
    which `Trajectory.passed` reads), ``samples`` the proxy's training samples (one per recorded call), and
    ``metadata`` with ``harness="text"``, ``session_id``, ``group_index``, ``steps``, ``format_errors``,
    ``tool_calls``, ``error``, ``wall_s`` and ``recorded_calls``.

    Args:
        tasks: the tasks (`ClawTask`), at least one.
        client: an ``orchard.env.AsyncSandboxClient``; sandboxes are created, prepared, verified and deleted here.
        proxy: the `RecordingProxy` in front of the policy; its samples become `Trajectory.samples`.
        max_steps: assistant turns per episode (``step_budget``). Default 6.
        max_tokens: per model call. Default 96.
        exec_timeout_s: per command in a sandbox, and the limit of preparing one. Default 30.
        **options: the rest of `run_program_episodes`'s keywords (``proxy_url``, ``env_url``, ``env_key``,
            ``group_size``, ``concurrency``, ``temperature``, ``top_p``, ``max_format_errors``, ``max_time_s``,
            ``program_timeout_s``, ``run_id``, ``keep_sessions``, ``seed``), with its defaults. The service's key
            travels to the child in `KEY_ENV`.
    """
    check_tasks(tasks, ClawTask)
    program = HarnessProgram(
        harness="text", run=_run_program, key_env=KEY_ENV, task_id=lambda task: task.id,
        prompt=lambda task: task.prompt,
        create=lambda task, session_id: client.create(sandbox_id=session_id),
        prepare=lambda sandbox, task: prepare_sandbox(sandbox, task, timeout=exec_timeout_s),
        prepare_timeout_s=exec_timeout_s, prepare_errors=ENV_ERRORS,
        score=lambda sandbox, task: verify_sandbox(sandbox, task, timeout=exec_timeout_s),
        score_timeout_s=exec_timeout_s + 30, score_errors=VERIFY_ERRORS, score_step="verify")
    return await run_program_episodes(program, tasks, client=client, proxy=proxy, max_steps=max_steps,
                                      max_tokens=max_tokens, exec_timeout_s=exec_timeout_s, **options)


class ClawTextRollouts(ProxyRollouts):
    """`orchard.rollout.Rollouts` of the text harness: `run_text_episodes` behind a fresh `RecordingProxy` per call
    (`orchard.rollout.rollouts.ProxyRollouts`), each trajectory's per-call samples chained by prefix.

    Args:
        client: the ``AsyncSandboxClient``.
        tokenizer: the policy's chat tokenizer (the proxy records token ids with it).
        **kwargs: the rest of `run_text_episodes`'s keywords (``env_url`` / ``env_key``: the service as the program
            reaches it, default the client's; ``concurrency``, ``max_steps``, ``max_tokens``, ``max_time_s``, ...).
    """

    def __init__(self, client: Any, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(partial(run_text_episodes, client=client), tokenizer, **kwargs)


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
