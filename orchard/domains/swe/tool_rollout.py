"""Rollouts of the SWE harness program (tool and bash conventions): the recipe's side of the separate program.

The program (`orchard.domains.swe.tool_harness`) runs as a child process that sees only an OpenAI endpoint and
its sandboxes. The training data comes from the recording proxy in front of the policy, never from the program:
per model call, the prompt ids the engine saw (context, masked) and the ids it sampled (actions, supervised, with
their sampling log-probs).

The batch is every harness program's (`orchard.rollout.program_runner.run_program_episodes`: sandboxes, the
episodes file, the proxy, ``python -m orchard.domains.swe.tool_harness --convention tool|bash``, verdicts,
env_error handling, clean-up); this module gives the SWE harness's part (`HarnessProgram`): a sandbox from
``client.create(**sandbox_options())`` (a warm pool's, when the client is the recipe's
`orchard.stages.PooledSandboxes`) with the repository at its base commit (`prepare_sandbox`), the opening user
message (`task_prompt`), and the verdict (`score_sandbox`: +1 resolved / -1 not, the decisive tests and the patch).

Preparing or scoring that raises anything (not only the sandbox client's errors: a snapshot that cannot be read, a
timeout while the patch is taken, a bug) gives ``env_error`` with ``reward = None``, never a 0 or a -1: the episode
has no verdict, and the rest of the batch is kept.
`SWEToolRollouts` and `SWEBashRollouts` wrap this as `orchard.rollout.Rollouts`, the interface the stages take.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from orchard.data import Trajectory
from orchard.domains.swe.convention import MAX_OUTPUT_CHARS, TOOL_SCHEMAS, task_prompt
from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.sandbox import prepare_sandbox, sandbox_options, score_sandbox
from orchard.rollout.program import run_program
from orchard.rollout.program_runner import HarnessProgram, check_tasks, run_program_episodes
from orchard.rollout.proxy import RecordingProxy
from orchard.rollout.rollouts import ProxyRollouts

KEY_ENV = "ORCHARD_SWE_HARNESS_ENV_KEY"
"""The environment variable that hands the sandbox service's key to the child process."""

PROGRAM = "orchard.domains.swe.tool_harness"

_run_program = partial(run_program, PROGRAM)
"""Runs the program (``orchard.rollout.program.run_program`` of this module); a test may put a spy here."""


def _verdict_metadata(verdict: Any) -> dict[str, Any]:
    """The decisive tests (name: passed) and the agent's diff of a scored episode; empty when unscored."""
    return {"tests": dict(verdict.tests) if verdict is not None else {},
            "patch": verdict.patch if verdict is not None else ""}


async def run_swe_episodes(instances: Sequence[SWEInstance], *, client: Any, proxy: RecordingProxy,
                           convention: str = "tool", exec_timeout_s: float = 60.0, test_timeout_s: float = 300.0,
                           max_output_chars: int = MAX_OUTPUT_CHARS, **options: Any) -> list[Trajectory]:
    """Play ``group_size`` episodes of every instance through the harness program; score; return them.

    `orchard.rollout.program_runner.run_program_episodes` with the SWE harness's part. Episode ``i`` plays
    ``instances[i // group_size]``; its proxy session is named ``f"{run_id}-{i}"`` and its sandbox is whichever
    ``client.create()`` gives (the program is told its id). One `Trajectory` each, in that order: reward +1
    resolved / -1 not (None for ``env_error``), ``reward_components`` the verdict's (`SWEVerdict.components`),
    ``tools`` the tool convention's schemas, ``samples`` the proxy's (one per recorded call), ``metadata`` with
    ``harness`` (the convention), ``session_id``, ``group_index``, ``steps``, ``format_errors``, ``tool_calls``,
    ``tests`` (per decisive test: passed), ``patch`` (the agent's diff), ``error``, ``wall_s`` and
    ``recorded_calls``.

    Args:
        instances: the tasks, at least one.
        client: an ``orchard.env.AsyncSandboxClient``, or anything whose ``await create()`` gives one's sandbox
            and that has its ``base_url`` and ``api_key`` (``orchard.stages.PooledSandboxes``: from a warm pool).
        proxy: the `RecordingProxy` in front of the policy; its samples become `Trajectory.samples`.
        convention: "tool" (OpenHands') or "bash" (mini-swe-agent's). Default "tool".
        exec_timeout_s: per command in a sandbox (and per set-up command). Default 60.
        test_timeout_s: the scoring test run's limit. Default 300.
        max_output_chars: observations keep their head and tail beyond this. Default 10 000.
        **options: the rest of `run_program_episodes`'s keywords (``proxy_url``, ``env_url``, ``env_key``,
            ``group_size``, ``concurrency``, ``max_steps``, ``max_tokens``, ``temperature``, ``top_p``,
            ``max_format_errors``, ``max_time_s``, ``program_timeout_s``, ``run_id``, ``keep_sessions``, ``seed``),
            with its defaults (``max_steps`` 30, ``max_tokens`` 2048). The service's key travels to the child in
            `KEY_ENV`.
    """
    check_tasks(instances, SWEInstance, "instances")
    if convention not in ("tool", "bash"):
        raise ValueError(f"convention must be 'tool' or 'bash', got {convention!r}")
    program = HarnessProgram(
        harness=convention, run=_run_program, key_env=KEY_ENV, task_id=lambda instance: instance.instance_id,
        prompt=lambda instance: task_prompt(instance.problem_statement),
        create=lambda instance, session_id: client.create(**sandbox_options()),
        prepare=lambda sandbox, instance: prepare_sandbox(sandbox, instance, timeout=exec_timeout_s),
        prepare_timeout_s=4 * exec_timeout_s,
        score=lambda sandbox, instance: score_sandbox(sandbox, instance, test_timeout_s,
                                                      setup_timeout_s=exec_timeout_s),
        score_timeout_s=test_timeout_s + 6 * exec_timeout_s,
        argv=("--convention", convention, "--max-output-chars", str(max_output_chars)),
        counts={"max_output_chars": max_output_chars}, seconds={"test_timeout_s": test_timeout_s},
        tools=TOOL_SCHEMAS if convention == "tool" else None, metadata=_verdict_metadata)
    return await run_program_episodes(program, instances, client=client, proxy=proxy,
                                      exec_timeout_s=exec_timeout_s, **options)


class SWEToolRollouts(ProxyRollouts):
    """`orchard.rollout.Rollouts` of the harness program: `run_swe_episodes` behind a fresh `RecordingProxy` per call
    (`orchard.rollout.rollouts.ProxyRollouts`), each trajectory's per-call samples chained by prefix.

    Args:
        client: the ``AsyncSandboxClient``.
        tokenizer: the policy's chat tokenizer (the proxy records token ids with it).
        convention: "tool" (OpenHands', default) or "bash" (mini-swe-agent's; `SWEBashRollouts`).
        **kwargs: the rest of `run_swe_episodes`'s keywords (``env_url`` / ``env_key``: the service as the program
            reaches it; ``concurrency``, ``max_steps``, ``max_time_s``, ...).
    """

    def __init__(self, client: Any, tokenizer: Any, *, convention: str = "tool", **kwargs: Any) -> None:
        if convention not in ("tool", "bash"):
            raise ValueError(f"convention must be 'tool' or 'bash', got {convention!r}")
        self.convention = convention
        super().__init__(partial(run_swe_episodes, client=client, convention=convention), tokenizer, **kwargs)


class SWEBashRollouts(SWEToolRollouts):
    """`SWEToolRollouts` of the bash convention (mini-swe-agent's): the same program with ``--convention bash``."""

    def __init__(self, client: Any, tokenizer: Any, **kwargs: Any) -> None:
        if "convention" in kwargs:
            raise ValueError("kwargs may not set 'convention': SWEBashRollouts plays the bash convention")
        super().__init__(client, tokenizer, convention="bash", **kwargs)
