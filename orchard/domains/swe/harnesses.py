"""The SWE domain's three harness conventions behind one interface, by name: what a recipe evaluates and trains.

- ``bash``: mini-swe-agent's convention, actions as text (`SWEBashRollouts`, the harness program via the proxy);
- ``tool``: native tool calls (`SWEToolRollouts`, the same program);
- ``eval``: a convention no training harness uses, in process (`SWEEvalHarness` in the agent loop): held out of
  training, a transfer test.
"""

from __future__ import annotations

from typing import Any

from orchard.domains.swe.harness import SWEEvalHarness
from orchard.domains.swe.tool_rollout import SWEBashRollouts, SWEToolRollouts
from orchard.rollout.rollouts import AgentLoopRollouts, Rollouts

__all__ = ["HARNESSES", "TRAINABLE", "swe_harnesses"]

HARNESSES = ("bash", "tool", "eval")
"""Every convention `swe_harnesses` builds."""
TRAINABLE = ("bash", "tool")
"""The conventions a policy trains through (the eval one is only ever evaluated on)."""


def swe_harnesses(client: Any, tokenizer: Any, *, max_steps: int, max_tokens: int, max_time_s: float,
                  concurrency: int, seed: int | None = None) -> dict[str, Rollouts]:
    """``{"bash", "tool", "eval"}`` -> its `Rollouts`, every one with the same episode budget.

    Args:
        client: what the episodes create their sandboxes from: an ``AsyncSandboxClient``, or a run's
            ``orchard.stages.PooledSandboxes`` (a warm pool per stage).
        tokenizer: the policy's chat tokenizer.
        max_steps, max_tokens, max_time_s: each episode's turns, tokens per turn and wall-clock limit.
        concurrency: episodes in flight at once per call.
        seed: the eval harness's agent-loop seed (the program harnesses take theirs per call).
    """
    program = {"concurrency": concurrency, "max_steps": max_steps, "max_tokens": max_tokens,
               "max_time_s": max_time_s}
    return {
        "bash": SWEBashRollouts(client, tokenizer, **program),
        "tool": SWEToolRollouts(client, tokenizer, **program),
        "eval": AgentLoopRollouts(client, SWEEvalHarness(max_steps=max_steps), tokenizer, max_tokens=max_tokens,
                                  seed=seed, max_time_s=max_time_s, concurrency=concurrency),
    }
