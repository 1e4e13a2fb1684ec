"""The harness protocol: how a domain plugs its tools into the agent loop, and `ShellHarness`, the simplest one.

A harness says what the policy is told (system prompt, tool schemas), how a sandbox for a task is made and
prepared, how one tool call becomes an action in the sandbox (e.g. a command to exec) and how the result becomes
an observation message, and how the finished episode is scored. The agent loop owns everything else: prompting,
sampling, parsing, budgets, timeouts, retries, concurrency and the trajectory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from orchard.data import Message, ToolCall, Trajectory


class EnvironmentFailure(RuntimeError):
    """Raised by a harness when the environment, not the policy, failed (e.g. a set-up command that should
    succeed did not). The loop marks the trajectory ``env_error``, as for the sandbox client's own errors."""


class InvalidToolCall(ValueError):
    """Raised by `Harness.act` when a call names a known tool but its arguments are unusable (missing or of the
    wrong type). The loop turns it into an error observation and counts a format error, as for unparseable calls."""


@dataclass
class Observation:
    """What one tool call produced.

    Fields:
        content: the text the policy sees as the ``tool`` message.
        done: the episode ends after this step (e.g. a ``submit`` tool); the loop then terminates with ``done``.
    """

    content: str
    done: bool = False


Reward = float | tuple[float, dict[str, float]] | None
"""What `Harness.evaluate` returns: a reward, a reward with named components, or None (not scored here)."""


@runtime_checkable
class Harness(Protocol):
    """A domain's tools and conventions for the agent loop.

    ``max_steps`` is the step budget (assistant turns) the loop uses unless it is given another.
    ``task`` is whatever the domain uses to describe a task; the loop only reads its id (see `task_id`).
    """

    max_steps: int

    def system_prompt(self, task: Any) -> str | None:
        """The system message (None: no system message)."""
        ...

    def tools(self, task: Any) -> list[dict[str, Any]]:
        """OpenAI tool schemas (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""
        ...

    def sandbox_spec(self, task: Any) -> dict[str, Any]:
        """Keyword arguments of ``AsyncSandboxClient.create`` (image, network, limits...)."""
        ...

    async def setup(self, sandbox: Any, task: Any) -> list[Message]:
        """Prepare the sandbox (upload files, run set-up commands) and return the opening message(s)."""
        ...

    async def act(self, sandbox: Any, call: ToolCall, task: Any) -> Observation:
        """Carry out one well-formed call to a known tool; raise `InvalidToolCall` for unusable arguments.
        Environment failures propagate as the client's errors (the loop retries nothing here: execs are not
        idempotent; the client already retries transport failures with idempotency keys)."""
        ...

    async def evaluate(self, sandbox: Any, task: Any, trajectory: Trajectory) -> Reward:
        """Score the finished episode while its sandbox still exists (e.g. run the task's tests)."""
        ...


def keep_alive(sandbox: Any) -> None:
    """Keep a sandbox an episode holds from the service's heartbeat reaper while the episode runs (its model calls
    touch no sandbox, and a slow policy on a CPU can spend longer than the heartbeat timeout on one turn):
    ``sandbox.keep_alive()`` where the sandbox has it (`orchard.env.AsyncSandbox`; deleting it stops the beat).
    A sandbox object without it (a test's fake) is left as it is."""
    keep = getattr(sandbox, "keep_alive", None)
    if callable(keep):
        keep()


def task_id(task: Any, default: str) -> str:
    """A task's id: ``id``, else ``task_id``, else ``instance_id`` (SWE-bench's), as a mapping's key or an object's
    attribute; else ``default``."""
    for key in ("id", "task_id", "instance_id"):
        value = task.get(key) if isinstance(task, Mapping) else getattr(task, key, None)
        if value is not None:
            break
    return str(value) if value is not None else default


EXEC_TOOL = {
    "type": "function",
    "function": {
        "name": "exec",
        "description": "Run a bash command in the workspace and return its exit code, stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to run."}},
            "required": ["command"],
        },
    },
}


class ShellHarness:
    """One tool, ``exec(command)``: a bash command in the sandbox's workspace.

    Tasks are mappings: ``prompt`` (the user message, required), ``id``, ``files`` (``{path: text}`` written into
    the workspace at set-up), ``setup`` (a command run at set-up; a non-zero exit is an environment error),
    ``check`` (a command run at the end: reward 1.0 when it exits 0, else 0.0; without it the episode is not
    scored), ``image`` (the sandbox image, default ``host``).

    Args:
        max_steps: step budget. Default 8.
        exec_timeout_s: each command's timeout inside the sandbox (exit code 124 when hit). Default 30.
        max_observation_chars: stdout and stderr are each cut to this many characters. Default 4000.
        system: the system prompt.
    """

    def __init__(
        self,
        *,
        max_steps: int = 8,
        exec_timeout_s: float = 30.0,
        max_observation_chars: int = 4000,
        system: str = "You are an agent in a Linux sandbox. Use the exec tool to act; answer without a tool call "
        "when the task is done.",
    ) -> None:
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        if not exec_timeout_s > 0:
            raise ValueError(f"exec_timeout_s must be > 0, got {exec_timeout_s!r}")
        if not isinstance(max_observation_chars, int) or max_observation_chars < 1:
            raise ValueError(f"max_observation_chars must be an int >= 1, got {max_observation_chars!r}")
        self.max_steps = max_steps
        self.exec_timeout_s = float(exec_timeout_s)
        self.max_observation_chars = max_observation_chars
        self.system = system

    @staticmethod
    def _task(task: Any) -> Mapping[str, Any]:
        if not isinstance(task, Mapping) or not isinstance(task.get("prompt"), str):
            raise ValueError(
                f"a ShellHarness task must be a mapping with a 'prompt' string, got {task!r:.200}"
            )
        return task

    def system_prompt(self, task: Any) -> str | None:
        return self.system

    def tools(self, task: Any) -> list[dict[str, Any]]:
        return [EXEC_TOOL]

    def sandbox_spec(self, task: Any) -> dict[str, Any]:
        return {"image": self._task(task).get("image", "host")}

    async def setup(self, sandbox: Any, task: Any) -> list[Message]:
        task = self._task(task)
        for path, text in (task.get("files") or {}).items():
            await sandbox.upload(path, text)
        if task.get("setup"):
            result = await sandbox.exec(task["setup"], timeout=self.exec_timeout_s)
            if result.exit_code != 0:
                raise EnvironmentFailure(
                    f"set-up command failed with exit code {result.exit_code}: {result.stderr[-500:]}"
                )
        return [Message("user", task["prompt"])]

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_observation_chars:
            return text
        return (
            text[: self.max_observation_chars] + f"\n[... {len(text) - self.max_observation_chars} chars cut]"
        )

    async def act(self, sandbox: Any, call: ToolCall, task: Any) -> Observation:
        command = call.arguments_dict().get("command")
        if not isinstance(command, str) or not command.strip():
            raise InvalidToolCall(f"exec needs a non-empty string 'command', got {command!r:.100}")
        result = await sandbox.exec(command, timeout=self.exec_timeout_s)
        parts = [f"exit code: {result.exit_code}" + (" (timed out)" if result.timed_out else "")]
        if result.stdout:
            parts.append("stdout:\n" + self._cut(result.stdout))
        if result.stderr:
            parts.append("stderr:\n" + self._cut(result.stderr))
        return Observation("\n".join(parts))

    async def evaluate(self, sandbox: Any, task: Any, trajectory: Trajectory) -> Reward:
        check = self._task(task).get("check")
        if not check:
            return None
        result = await sandbox.exec(check, timeout=self.exec_timeout_s)
        passed = float(result.exit_code == 0)
        return passed, {"check": passed}
