"""The in-process SWE harnesses: the evaluation-only convention, and the tool convention, as `orchard.rollout.Harness`es
for the `AgentLoop`.

`SWEEvalHarness` plays the ``eval`` convention of `orchard.domains.swe.convention` (``run_command``,
``read_file``, ``write_file``, ``replace_in_file``, ``done``): tool names and schemas no training harness uses, to
measure how a policy trained in the bash and tool conventions transfers to an unseen harness (the paper's
Kimi-CLI column). ``AgentLoopRollouts(client, SWEEvalHarness(), tokenizer)`` gives it the `Rollouts` interface.

The bash and tool conventions train through a separate program (`orchard.domains.swe.tool_harness`), which reaches
the model only through the recording proxy. `SWEToolHarness` plays the tool convention in process as well, with
the program's tools, observations (one `tool_convention_call` for both) and answer to a reply without a tool call
(`no_call_reply`: a format error, the episode goes on): a trajectory the program recorded replays here call for
call, and a state of it can be continued in process (Monte-Carlo turn values,
`orchard.domains.swe.turn_values`). Where the two still differ: after ``finish`` the program runs no later call of
the same reply, the agent loop runs them (the episode ends after the turn either way). The bash convention's
actions are text the harness parses itself, which the `Harness` protocol cannot express (the agent loop parses
native tool calls): it has the program only.

Tasks are `SWEInstance`s. Set-up is `prepare_sandbox`, the reward `score_sandbox` after the episode: +1 resolved /
-1 not, the verdict's components in ``reward_components`` and the per-test results in ``metadata["tests"]``. Either
raising anything is an `EnvironmentFailure` (the episode ``env_error``, the batch kept).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from orchard.data import Message, ToolCall, Trajectory
from orchard.domains.swe.convention import (
    EVAL_SCHEMAS,
    EVAL_SYSTEM,
    MAX_OUTPUT_CHARS,
    NO_TOOL_CALL,
    TOOL_SCHEMAS,
    TOOL_SYSTEM,
    BadArguments,
    FileTools,
    ToolError,
    command_observation,
    run_command,
    task_prompt,
    tool_convention_call,
    truncate_output,
)
from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.sandbox import prepare_sandbox, sandbox_options, score_sandbox
from orchard.rollout.agent_loop import ENV_ERRORS
from orchard.rollout.harness import EnvironmentFailure, InvalidToolCall, Observation


@contextlib.asynccontextmanager
async def _environment(step: str) -> AsyncIterator[None]:
    """Whatever stops set-up or scoring (the sandbox, a snapshot that cannot be read, a bug) is the environment's
    failure: the agent loop marks the episode ``env_error`` and keeps its batch, instead of losing every episode."""
    try:
        yield
    except ENV_ERRORS:
        raise
    except Exception as exc:
        raise EnvironmentFailure(f"{step}: {type(exc).__name__}: {exc}") from exc


def _instance(task: Any) -> SWEInstance:
    if not isinstance(task, SWEInstance):
        raise ValueError(f"task must be a SWEInstance, got {type(task).__name__}")
    return task


class _SWEHarness:
    """What the in-process SWE harnesses share: arguments, sandbox, set-up (the repository at its base commit, the
    task message) and the reward (+1 resolved / -1 not, by the hidden tests)."""

    def __init__(self, *, max_steps: int = 30, exec_timeout_s: float = 60.0,
                 max_output_chars: int = MAX_OUTPUT_CHARS, test_timeout_s: float = 300.0) -> None:
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        for name, value in (("exec_timeout_s", exec_timeout_s), ("test_timeout_s", test_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int) or max_output_chars < 2:
            raise ValueError(f"max_output_chars must be an int >= 2, got {max_output_chars!r}")
        self.max_steps = max_steps
        self.exec_timeout_s = float(exec_timeout_s)
        self.max_output_chars = max_output_chars
        self.test_timeout_s = float(test_timeout_s)

    def sandbox_spec(self, task: Any) -> dict[str, Any]:
        return sandbox_options()

    async def setup(self, sandbox: Any, task: Any) -> list[Message]:
        instance = _instance(task)
        async with _environment("prepare"):
            await prepare_sandbox(sandbox, instance, timeout=self.exec_timeout_s)
        return [Message("user", task_prompt(instance.problem_statement))]

    absolute_paths = False
    """The file tools take absolute paths only (`FileTools` ``require_absolute``)."""

    def _invalid(self, name: str, exc: BadArguments) -> str:
        """The error observation's text for a call to ``name`` with unusable arguments."""
        return f"{name}: {exc}"

    async def _act(self, tools: FileTools, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """One well-formed call of the convention: its observation and whether the episode ends."""
        raise NotImplementedError

    async def act(self, sandbox: Any, call: ToolCall, task: Any) -> Observation:
        arguments, error = call.parse_arguments()
        if arguments is None:
            raise InvalidToolCall(f"arguments of {call.name} are not a JSON object: {error}")
        tools = FileTools(sandbox, timeout=self.exec_timeout_s, require_absolute=self.absolute_paths)
        try:
            return Observation(*await self._act(tools, call.name, arguments))
        except BadArguments as exc:
            raise InvalidToolCall(self._invalid(call.name, exc)) from None
        except ToolError as exc:
            return Observation(f"Error: {exc}")

    async def evaluate(self, sandbox: Any, task: Any, trajectory: Trajectory) -> tuple[float, dict[str, float]]:
        instance = _instance(task)
        async with _environment("score"):
            verdict = await score_sandbox(sandbox, instance, self.test_timeout_s, setup_timeout_s=self.exec_timeout_s)
        trajectory.metadata["tests"] = verdict.tests
        trajectory.metadata["patch"] = verdict.patch
        return verdict.reward, verdict.components


class SWEToolHarness(_SWEHarness):
    """The SWE tool convention (OpenHands': ``execute_bash``, ``str_replace_editor``, ``finish``) in process, as the
    harness program plays it (module docstring); an `orchard.rollout.Harness`, tasks are `SWEInstance`s.

    Args:
        max_steps: assistant turns per episode. Default 30 (the program's).
        exec_timeout_s: each command's limit in the sandbox. Default 60.
        max_output_chars: observations keep their head and tail beyond this. Default 10 000.
        test_timeout_s: the scoring test run's limit. Default 300.
    """

    no_call_reply = NO_TOOL_CALL
    """The answer to a reply without a tool call (the agent loop counts it a format error; the episode goes on)."""

    def system_prompt(self, task: Any) -> str:
        return TOOL_SYSTEM

    def tools(self, task: Any) -> list[dict[str, Any]]:
        return TOOL_SCHEMAS

    absolute_paths = True

    def _invalid(self, name: str, exc: BadArguments) -> str:
        return str(exc)  # the program's words

    async def _act(self, tools: FileTools, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        return await tool_convention_call(tools.sandbox, tools, name, arguments, exec_timeout_s=self.exec_timeout_s,
                                          max_output_chars=self.max_output_chars)


class SWEEvalHarness(_SWEHarness):
    """The evaluation-only SWE convention (an `orchard.rollout.Harness`; tasks are `SWEInstance`s).

    Args:
        max_steps: assistant turns per episode. Default 30.
        exec_timeout_s: each command's limit in the sandbox. Default 60.
        max_output_chars: observations keep their head and tail beyond this. Default 10 000.
        test_timeout_s: the scoring test run's limit. Default 300.
    """

    def system_prompt(self, task: Any) -> str:
        return EVAL_SYSTEM

    def tools(self, task: Any) -> list[dict[str, Any]]:
        return EVAL_SCHEMAS

    async def _act(self, tools: FileTools, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        def text(key: str) -> str:
            value = arguments.get(key)
            if not isinstance(value, str):
                raise BadArguments(f"argument {key!r} must be a string, got {value!r:.80}")
            return value

        if name == "done":
            return "Stopped.", True
        if name == "run_command":
            if not text("command").strip():
                raise BadArguments("argument 'command' is empty")
            code, output, timed_out = await run_command(tools.sandbox, text("command"), timeout=self.exec_timeout_s)
            return command_observation(code, output, timed_out=timed_out, max_chars=self.max_output_chars), False
        path = tools.path(arguments.get("path"))
        if name == "read_file":
            bounds = [arguments.get("start", 1), arguments.get("end", -1)]
            bounds = [-1 if b is None else b for b in bounds]
            if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
                raise BadArguments(f"start and end must be integers, got {bounds!r:.80}")
            return truncate_output(await tools.view(path, max(bounds[0], 1), bounds[1]), self.max_output_chars), False
        if name == "write_file":
            await tools.write(path, text("content"))
            return f"Wrote {len(text('content'))} characters to {path}.", False
        if name == "replace_in_file":
            return await tools.replace(path, text("old"), text("new")), False
        raise BadArguments(f"unknown tool {name!r}")
