"""The three SWE harness conventions without heavy imports: prompts, tool schemas, the bash-action parser, output
truncation and the file tools that run in a sandbox.

The separate harness program (`orchard.domains.swe.tool_harness`) imports only this module, the sandbox client
and httpx, so it starts without torch. Three conventions, as in the paper (one trained on, one for transfer):

- **bash** (mini-swe-agent's): no tool schema; each reply holds a THOUGHT and exactly one ```` ```bash ```` block,
  run in a fresh shell in the repository root; the output comes back as a user message
  ``<returncode>N</returncode><output>...</output>``, its middle cut when long. The episode ends when a
  command's output starts with the line ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (`SUBMIT_MARKER`; the agent
  runs ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``), as in mini-swe-agent.
- **tool** (OpenHands'): native tool calls of ``execute_bash(command)``, the file editor
  ``str_replace_editor(command, path, ...)`` with ``view`` / ``create`` / ``str_replace`` / ``insert`` /
  ``undo_edit``, and ``finish(message)``.
- **eval** (a convention no training run uses, to measure transfer to an unseen harness, as the paper's Kimi-CLI
  column does): ``run_command(command)``, ``read_file(path, start, end)``, ``write_file(path, content)``,
  ``replace_in_file(path, old, new)`` and ``done(summary)``.

Every convention opens with the same user message (`task_prompt`): the issue, and where the repository is.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

WORKSPACE = "/workspace"
"""The repository root inside a sandbox (the sandbox's working directory)."""

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""The bash convention's submission: a command whose output's first line is this word ends the episode."""

SUBMIT_COMMAND = f"echo {SUBMIT_MARKER}"

MAX_OUTPUT_CHARS = 10_000
"""Observations longer than this keep their head and tail (mini-swe-agent cuts at 10 000 characters too)."""

CONVENTIONS = ("bash", "tool", "eval")

BASH_SYSTEM = (
    "You are a software engineer fixing an issue in a Python repository. You act only through bash commands.\n"
    "Each reply has two parts: a THOUGHT that explains your reasoning, then exactly ONE command in a block\n"
    "```bash\n<command>\n```\n"
    "Each command runs in a new shell in the repository root (cd and environment variables do not persist). "
    "Work step by step: explore, reproduce the issue, locate the cause, edit the source files, run the tests. "
    f"When you are done, submit with the command `{SUBMIT_COMMAND}` alone in its block; after it you cannot "
    "act any more."
)

TOOL_SYSTEM = (
    "You are a software engineer fixing an issue in a Python repository at /workspace. Use the tools: "
    "execute_bash runs a command, str_replace_editor views and edits files (absolute paths), finish ends the "
    "task. Explore, reproduce the issue, locate the cause, edit the source files, run the tests, then call "
    "finish."
)

EVAL_SYSTEM = (
    "You are a coding assistant working in a repository (your working directory). Resolve the user's issue "
    "with the tools run_command, read_file, write_file and replace_in_file; call done when the fix is complete "
    "and tested."
)


def task_prompt(problem_statement: str) -> str:
    """The opening user message of every convention: the issue and the ground rules."""
    if not isinstance(problem_statement, str) or not problem_statement.strip():
        raise ValueError(f"problem_statement must be a non-empty str, got {problem_statement!r:.80}")
    return (f"The repository is at {WORKSPACE} (your working directory). Resolve this issue by changing its "
            f"source files (not the tests):\n\n<issue>\n{problem_statement.strip()}\n</issue>")


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOL_SCHEMAS: list[dict[str, Any]] = [
    _function("execute_bash", "Run a bash command in the repository root; returns its output and exit code.",
              {"command": {"type": "string", "description": "The bash command."}}, ["command"]),
    _function("str_replace_editor", "View, create and edit files. view: a file with line numbers (view_range "
              "[start, end], end -1 for the end) or a directory two levels deep; create: a new file; str_replace: "
              "replace old_str, which must occur exactly once, by new_str; insert: new_str after line insert_line "
              "(0: at the top); undo_edit: revert the last edit of the file.",
              {"command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
               "path": {"type": "string", "description": "Absolute path, e.g. /workspace/pkg/mod.py."},
               "file_text": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"},
               "insert_line": {"type": "integer"},
               "view_range": {"type": "array", "items": {"type": "integer"}}},
              ["command", "path"]),
    _function("finish", "Finish the task (the repository's current state is the answer).",
              {"message": {"type": "string", "description": "A summary of the change."}}, []),
]
"""The tool convention's OpenAI tool schemas (OpenHands' names and arguments)."""

EVAL_SCHEMAS: list[dict[str, Any]] = [
    _function("run_command", "Run a shell command in the repository; returns exit code and output.",
              {"command": {"type": "string"}}, ["command"]),
    _function("read_file", "Read lines start..end (1-based, inclusive) of a file; the whole file by default.",
              {"path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}}, ["path"]),
    _function("write_file", "Write a whole file (created or overwritten).",
              {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    _function("replace_in_file", "Replace the text old, which must occur exactly once in the file, by new.",
              {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
              ["path", "old", "new"]),
    _function("done", "Stop: the fix is complete.", {"summary": {"type": "string"}}, []),
]
"""The evaluation convention's tool schemas (names and arguments no training harness uses)."""


def truncate_output(text: str, max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """``text`` itself when it fits, else its first and last ``max_chars // 2`` characters around a line that
    says how many were cut (errors and results sit at an output's ends)."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 2:
        raise ValueError(f"max_chars must be an int >= 2, got {max_chars!r}")
    if len(text) <= max_chars:
        return text
    head, tail = max_chars // 2, max_chars - max_chars // 2
    return f"{text[:head]}\n[... {len(text) - head - tail} characters cut ...]\n{text[len(text) - tail:]}"


_BASH_BLOCK = re.compile(r"```bash[ \t]*\n(.*?)```", re.S)


@dataclass(frozen=True)
class BashAction:
    """One parsed reply of the bash convention: a command, or a format error with the reason."""

    command: str | None
    error: str | None = None


def parse_bash_action(text: str) -> BashAction:
    """The one ```` ```bash ```` block of a reply; zero or several blocks, or an empty one, is a format error
    (never an exception)."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    blocks = _BASH_BLOCK.findall(text)
    if len(blocks) != 1:
        return BashAction(None, f"found {len(blocks)} bash blocks; reply with a THOUGHT and exactly ONE command "
                                "in a ```bash ... ``` block")
    command = blocks[0].strip()
    if not command:
        return BashAction(None, "the bash block is empty; put one command in it")
    return BashAction(command)


def unparseable_actions(trajectory: Any) -> list[int]:
    """Indices (in ``trajectory.messages``) of the assistant replies from which the trajectory's convention reads
    no action, the format errors its harness answers with an error observation: in the bash convention a reply
    without exactly one non-empty ```` ```bash ```` block (`parse_bash_action`), in the tool convention a reply
    without a tool call (its calls themselves are checked against `TOOL_SCHEMAS` by
    `orchard.data.check_tool_calls`). The convention is ``metadata["harness"]``; the eval convention (never
    trained on) and an unknown one give []. Our reading of the paper's "unparseable tool calls" for a convention
    whose action is a text block: a reply whose block does not parse is an unparseable call.

    Args:
        trajectory: an `orchard.data.Trajectory` of the bash or tool harness (read duck-typed: ``messages`` with
            ``role``, ``text`` and ``tool_calls``; ``metadata``).
    """
    messages, metadata = getattr(trajectory, "messages", None), getattr(trajectory, "metadata", None)
    if not isinstance(messages, list) or not isinstance(metadata, dict):
        raise ValueError(f"trajectory must be a Trajectory, got {type(trajectory).__name__}")
    convention = metadata.get("harness")
    assistant = [(i, m) for i, m in enumerate(messages) if m.role == "assistant"]
    if convention == "bash":
        return [i for i, m in assistant if parse_bash_action(m.text).command is None]
    if convention == "tool":
        return [i for i, m in assistant if not m.tool_calls]
    return []


def is_submission(output: str) -> bool:
    """A command's output that submits: its first non-blank line is `SUBMIT_MARKER`."""
    lines = output.lstrip().splitlines()
    return bool(lines) and lines[0].strip() == SUBMIT_MARKER


def bash_observation(exit_code: int | None, output: str, *, timed_out: bool = False,
                     max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """The bash convention's observation (mini-swe-agent's shape)."""
    note = "\n(the command timed out)" if timed_out else ""
    return f"<returncode>{exit_code}</returncode>\n<output>\n{truncate_output(output, max_chars)}</output>{note}"


def command_observation(exit_code: int | None, output: str, *, timed_out: bool = False,
                        max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """The tool conventions' observation of a command: its output, then its exit code (OpenHands' shape)."""
    status = "timed out" if timed_out else f"completed with exit code {exit_code}"
    return f"{truncate_output(output, max_chars)}\n[The command {status}.]"


async def run_command(sandbox: Any, command: str, *, timeout: float) -> tuple[int | None, str, bool]:
    """Run ``command`` with bash in the repository root; returns (exit code, stdout then stderr, timed out)."""
    result = await sandbox.exec(["bash", "-c", command], timeout=timeout)
    output = result.stdout + (result.stderr if not result.stdout or result.stdout.endswith("\n")
                              else "\n" + result.stderr)
    return result.exit_code, output, bool(result.timed_out)


class BadArguments(ValueError):
    """A tool call whose arguments are unusable (missing, of the wrong type, an unknown command): a format error."""


class ToolError(Exception):
    """A well-formed call that failed (a missing file, text not found): an observation, not a format error."""


@dataclass
class FileTools:
    """The file tools of the tool and eval conventions, acting on one sandbox through commands (so the sandbox
    user's permissions hold), with an undo history per file for ``undo_edit``.

    Relative paths are taken from the repository root; ``require_absolute`` refuses them (OpenHands' editor).
    """

    sandbox: Any
    timeout: float = 30.0
    require_absolute: bool = False
    history: dict[str, list[str | None]] = field(default_factory=dict)

    def path(self, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise BadArguments(f"path must be a non-empty string, got {value!r:.100}")
        if self.require_absolute and not value.startswith("/"):
            raise BadArguments(f"path must be absolute (e.g. {WORKSPACE}/{value}), got {value!r:.100}")
        return value

    async def read(self, path: str) -> str | None:
        """The file's text, or None when it does not exist (a directory is a `ToolError`)."""
        result = await self.sandbox.exec(["bash", "-c", 'if [ -d "$1" ]; then exit 3; fi; '
                                          '[ -e "$1" ] || exit 4; cat -- "$1"', "bash", path], timeout=self.timeout)
        if result.exit_code == 4:
            return None
        if result.exit_code == 3:
            raise ToolError(f"{path} is a directory")
        if result.exit_code != 0:
            raise ToolError(f"cannot read {path}: {result.stderr.strip()[-300:]}")
        return result.stdout

    async def write(self, path: str, text: str, *, remember: bool = True) -> None:
        before = await self.read(path) if remember else None
        result = await self.sandbox.exec(["bash", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "bash",
                                          path], timeout=self.timeout, stdin=text)
        if result.exit_code != 0:
            raise ToolError(f"cannot write {path}: {result.stderr.strip()[-300:]}")
        if remember:
            self.history.setdefault(path, []).append(before)

    async def listing(self, path: str) -> str:
        result = await self.sandbox.exec(["find", path, "-maxdepth", "2", "-not", "-path", "*/.*"],
                                         timeout=self.timeout)
        if result.exit_code != 0:
            raise ToolError(f"cannot list {path}: {result.stderr.strip()[-300:]}")
        return "\n".join(sorted(result.stdout.splitlines()))

    async def existing(self, path: str) -> str:
        text = await self.read(path)
        if text is None:
            raise ToolError(f"{path} does not exist")
        return text

    async def view(self, path: str, start: int = 1, end: int = -1) -> str:
        """Lines ``start..end`` (1-based, inclusive; ``end`` -1: to the end) numbered as ``cat -n``, or a
        directory's listing."""
        is_dir = await self.sandbox.exec(["test", "-d", path], timeout=self.timeout)
        if is_dir.exit_code == 0:
            return f"Files and directories up to 2 levels deep in {path}:\n" + await self.listing(path)
        lines = (await self.existing(path)).splitlines()
        end = len(lines) if end == -1 else end
        if not 1 <= start <= max(end, 1) or end > len(lines):
            raise ToolError(f"range [{start}, {end}] is outside the file's {len(lines)} lines")
        return "\n".join(f"{n:6d}\t{line}" for n, line in enumerate(lines[start - 1:end], start))

    async def replace(self, path: str, old: str, new: str) -> str:
        text = await self.existing(path)
        count = text.count(old) if old else 0
        if count != 1:
            where = "did not appear" if count == 0 else f"appears {count} times"
            raise ToolError(f"no replacement was made: the old text {where} in {path}; it must occur exactly once")
        await self.write(path, text.replace(old, new, 1))
        line = text[: text.index(old)].count("\n") + 1
        return f"The file {path} has been edited (around line {line})."

    async def insert(self, path: str, line: int, new: str) -> str:
        lines = (await self.existing(path)).splitlines(keepends=True)
        if not 0 <= line <= len(lines):
            raise ToolError(f"insert_line must be in [0, {len(lines)}] for {path}, got {line}")
        if lines and not lines[-1].endswith("\n") and line == len(lines):
            lines[-1] += "\n"
        lines.insert(line, new if new.endswith("\n") else new + "\n")
        await self.write(path, "".join(lines))
        return f"The file {path} has been edited (inserted after line {line})."

    async def undo(self, path: str) -> str:
        if not self.history.get(path):
            raise ToolError(f"no edit of {path} to undo")
        before = self.history[path].pop()
        if before is None:
            await self.sandbox.exec(["rm", "-f", "--", path], timeout=self.timeout)
            return f"Undid the creation of {path}."
        await self.write(path, before, remember=False)
        return f"Undid the last edit of {path}."


def _arg(arguments: dict[str, Any], name: str, kind: type | tuple[type, ...], *, required: bool = True,
         default: Any = None) -> Any:
    value = arguments.get(name, default)
    if value is None and not required:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadArguments(f"argument {name!r} must be a {getattr(kind, '__name__', kind)}, got {value!r:.80}")
    return value


async def editor_call(tools: FileTools, arguments: dict[str, Any]) -> str:
    """One ``str_replace_editor`` call (OpenHands' commands); `BadArguments` for a malformed call, `ToolError`
    for one that failed."""
    command = arguments.get("command")
    path = tools.path(arguments.get("path"))
    if command == "view":
        view_range = arguments.get("view_range")
        if view_range is None:
            return await tools.view(path)
        if (not isinstance(view_range, list) or len(view_range) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in view_range)):
            raise BadArguments(f"view_range must be two integers [start, end], got {view_range!r:.80}")
        return await tools.view(path, view_range[0], view_range[1])
    if command == "create":
        text = _arg(arguments, "file_text", str)
        if await tools.read(path) is not None:
            raise ToolError(f"{path} already exists; edit it with str_replace")
        await tools.write(path, text)
        return f"File created successfully at: {path}"
    if command == "str_replace":
        return await tools.replace(path, _arg(arguments, "old_str", str),
                                   _arg(arguments, "new_str", str, required=False, default=""))
    if command == "insert":
        return await tools.insert(path, _arg(arguments, "insert_line", int), _arg(arguments, "new_str", str))
    if command == "undo_edit":
        return await tools.undo(path)
    raise BadArguments(f"command must be one of view, create, str_replace, insert, undo_edit; got {command!r:.40}")


TOOL_NAMES = ("execute_bash", "str_replace_editor", "finish")
"""The tool convention's tools (`TOOL_SCHEMAS`' names)."""

NO_TOOL_CALL = "Error: no tool was called. Call one of the tools; when the task is done, call finish."
"""The tool convention's answer to a reply without a tool call (a format error; the episode goes on)."""


def unknown_tool(name: Any, tools: Sequence[str]) -> str:
    """The error observation of a call to a tool the convention lacks (the agent loop's wording, so the program
    and the in-process harness answer alike)."""
    return f"Error: unknown tool {name!r}; available: {sorted(tools)}"


async def tool_convention_call(sandbox: Any, tools: FileTools, name: str, arguments: dict[str, Any], *,
                               exec_timeout_s: float, max_output_chars: int = MAX_OUTPUT_CHARS,
                               bound: Callable[[Awaitable[Any]], Awaitable[Any]] | None = None) -> tuple[str, bool]:
    """One well-formed call of the tool convention (``execute_bash``, ``str_replace_editor``, ``finish``): its
    observation and whether it ends the episode. The harness program and the in-process `SWEToolHarness` both run
    calls through here, so an episode observes the same text in either. ``bound`` wraps each sandbox call (the
    program's episode deadline). Raises `BadArguments` for unusable arguments, `ToolError` for a call that failed,
    ValueError for a tool the convention lacks."""
    def run(call: Awaitable[Any]) -> Awaitable[Any]:
        return call if bound is None else bound(call)

    if name == "finish":
        return "Finished.", True
    if name == "execute_bash":
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            raise BadArguments(f"argument 'command' must be a non-empty string, got {command!r:.80}")
        code, output, timed_out = await run(run_command(sandbox, command, timeout=exec_timeout_s))
        return command_observation(code, output, timed_out=timed_out, max_chars=max_output_chars), False
    if name == "str_replace_editor":
        return truncate_output(await run(editor_call(tools, arguments)), max_output_chars), False
    raise ValueError(f"name must be one of {list(TOOL_NAMES)}, got {name!r}")
