"""orchard.rollout: inference engines, the OpenAI-compatible server, the recording proxy, the agent loop (layer 4).

Names load lazily (``orchard --help`` imports this package's CLI and must stay fast):

- engines: `Engine`, `SamplingParams`, `GenerateRequest`, `GenerateResult`, `Completion`, `HFEngine`,
  `VLLMEngine` (GPU extra), `OpenAIEngine`, `ScriptedEngine`, `EnginePool` (several served replicas as one engine)
- seeds: `derive_seed` (the seed of one episode or turn of a seeded run, wherever it is played)
- scoring (optional on an engine; a teacher's log-probs): `Scorer`, `ScoreRequest`
- serving: `build_app`, `serve_in_thread`, `RecordingProxy`, `CallRecord`
- serving: `serve_app` (any ASGI app on the caller's event loop)
- acting: `AgentLoop`, `PromptBuilder`, `Harness`, `Observation`, `InvalidToolCall`, `EnvironmentFailure`,
  `ShellHarness`, `parse_tool_calls`, `ParsedOutput`, `keep_alive` (an episode's sandbox kept from the reaper)
- one interface for every harness path: `Rollouts`, `AgentLoopRollouts`; `JudgedRolloutsBase` (a judge over
  every batch, for a domain to subclass)
- harness programs (an outside program that reaches the model only through the proxy), one runner for every
  domain: `run_program_episodes` and a domain's `HarnessProgram` (`program_runner`); the program's episode loop
  `play_episode` (`program`)
- Monte-Carlo turn values (VinePPO's): `TurnValueEstimator` replays a finished trajectory, forks its workspace at
  the asked states and scores ``K`` continuations of the policy from each (`AgentLoop.continue_from`);
  `TurnValues`, `step_value_lookup` (for credit-assigned SFT)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine",
    "SamplingParams": "engine",
    "derive_seed": "engine",
    "GenerateRequest": "engine",
    "GenerateResult": "engine",
    "Completion": "engine",
    "ScoreRequest": "engine",
    "Scorer": "engine",
    "HFEngine": "hf_engine",
    "VLLMEngine": "vllm_engine",
    "OpenAIEngine": "openai_engine",
    "ScriptedEngine": "scripted",
    "EnginePool": "engine_pool",
    "build_app": "server",
    "serve_in_thread": "server",
    "RecordingProxy": "proxy",
    "CallRecord": "proxy",
    "fetch_trajectory": "proxy",
    "serve_app": "serving",
    "Rollouts": "rollouts",
    "AgentLoopRollouts": "rollouts",
    "JudgedRolloutsBase": "rollouts",
    "run_program_episodes": "program_runner",
    "HarnessProgram": "program_runner",
    "play_episode": "program",
    "AgentLoop": "agent_loop",
    "PromptBuilder": "agent_loop",
    "Harness": "harness",
    "Observation": "harness",
    "InvalidToolCall": "harness",
    "EnvironmentFailure": "harness",
    "ShellHarness": "harness",
    "keep_alive": "harness",
    "parse_tool_calls": "tool_calls",
    "ParsedOutput": "tool_calls",
    "TurnValueEstimator": "turn_values",
    "TurnValues": "turn_values",
    "step_value_lookup": "turn_values",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'orchard.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"orchard.rollout.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
