"""The exec agent: everything that happens inside one sandbox (commands, files, patches, terminals).

`SandboxAgent` is used in-process by the local backend (one object per sandbox, no extra process) and served
over HTTP by `orchard.env.agent.server` when the sandbox is a pod of its own.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import replace

from orchard.env.agent.archive import ArchiveSummary, extract_archive
from orchard.env.agent.box_client import Box, BoxUnavailableError, compiled_box_failed
from orchard.env.agent.files import Workspace
from orchard.env.agent.isolation import BUBBLEWRAP, Isolation
from orchard.env.agent.process import ProcessTree, run_captured
from orchard.env.agent.pty import LocalPty
from orchard.env.backends.base import BackendError, ExecRequest, ExecResult, FileInfo, Resources

logger = logging.getLogger(__name__)

_USER_PATH = "ORCHARD_USER_PATH"
_GIT_APPLY = ["git", "apply", "--verbose", "--whitespace=nowarn", "-"]


def validate_request(request: ExecRequest) -> None:
    """Raise ValueError naming the field of `request` that is malformed."""
    cmd = request.command
    if isinstance(cmd, str):
        if not cmd.strip():
            raise ValueError("command must be a non-empty string or argv list, got an empty string")
    elif isinstance(cmd, list | tuple):
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise ValueError(f"command as argv must be a non-empty list of strings, got {cmd!r}")
    else:
        raise ValueError(f"command must be a string or a list of strings, got {type(cmd).__name__}")
    if any("\x00" in a for a in ([cmd] if isinstance(cmd, str) else cmd)):
        raise ValueError("command must not contain NUL bytes")
    t = request.timeout_s
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"timeout_s must be a finite number > 0, got {t!r}")
    m = request.max_output_bytes
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"max_output_bytes must be an int >= 0, got {m!r}")
    if request.stdin is not None and not isinstance(request.stdin, bytes | bytearray):
        raise ValueError(f"stdin must be bytes or None, got {type(request.stdin).__name__}")
    validate_env(request.env, "env")


def validate_env(env: dict[str, str], name: str) -> None:
    """Raise ValueError unless `env` maps valid variable names to strings without NUL bytes."""
    if not isinstance(env, dict):
        raise ValueError(f"{name} must be a dict of str to str, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not k or "=" in k or "\x00" in k:
            raise ValueError(f"{name} has an invalid variable name {k!r}")
        if not isinstance(v, str) or "\x00" in v:
            raise ValueError(f"{name}[{k!r}] must be a string without NUL bytes, got {v!r}")


class SandboxAgent:
    """Runs commands and file operations in one sandbox.

    Args:
        isolation: how the sandbox's processes are started (bubblewrap or the process-group fallback); it
            also holds the workspace and the limits.
        env: variables every command starts with (on top of PATH, HOME, LANG; a request's `env` goes on top).
        host_isolation: the isolation used for `apply_patch` (`git` from the host's file system, with the
            same workspace and uid), so an image without git can still take patches. Defaults to `isolation`.
        box: under bubblewrap, run commands through one long-lived isolated process per sandbox (the box,
            `orchard.env.agent.box`, started on the first command) instead of a fresh bubblewrap per command.
            Same isolation and exec rules, a fraction of the cost. The box is the compiled one when
            `isolation.box_binary` is set, else (or when that one cannot start) the Python one; without
            python3 in the image, or when no box can start, each command gets a bubblewrap of its own.
            Terminals always get their own bubblewrap.
    """

    def __init__(
        self,
        isolation: Isolation,
        *,
        env: dict[str, str] | None = None,
        host_isolation: Isolation | None = None,
        box: bool = False,
    ) -> None:
        validate_env(env or {}, "env")
        if not isinstance(box, bool):
            raise ValueError(f"box must be a bool, got {box!r}")
        self.isolation = isolation
        self.workspace: Workspace = isolation.workspace
        self.env = dict(env or {})
        self._patch_isolation = host_isolation or isolation
        self._live: set[ProcessTree] = set()
        self._ptys: set[LocalPty] = set()
        self._box: Box | None = None
        self._closed = False
        """Set first thing by `kill_all`: from then on nothing of the sandbox starts."""
        if box and isolation.mode == BUBBLEWRAP:
            try:
                self._box = Box(isolation)
            except BoxUnavailableError as e:
                logger.warning("%s; each command gets a bubblewrap of its own", e)

    # -- commands -----------------------------------------------------------------------------------------

    async def exec(self, request: ExecRequest) -> ExecResult:
        """Run a command to completion or timeout (rules in `orchard.env.agent.process`).

        A string command runs as `bash -lc <command>`; a list runs as that argv. Relative `cwd` is taken from
        the workspace; the default is the workspace itself. A login shell reads /etc/profile, which on
        Debian-like images resets PATH for non-root users; a PATH set in the sandbox's or the request's env is
        therefore put back in front of the profile's after it ran.
        """
        validate_request(request)
        if isinstance(request.command, list | tuple):
            return await self._run(self.isolation, list(request.command), request)
        command = request.command
        if "PATH" in request.env or "PATH" in self.env:
            command = f'PATH="${_USER_PATH}${{PATH:+:$PATH}}"; unset {_USER_PATH}; {command}'
            path = request.env.get("PATH", self.env.get("PATH", ""))
            # bash itself is found on the default PATH; the caller's PATH applies once the profile ran
            env = {**request.env, "PATH": self.isolation.base_env()["PATH"], _USER_PATH: path}
            request = replace(request, env=env)
        return await self._run(self.isolation, ["bash", "-lc", command], request)

    @property
    def box(self) -> Box | None:
        """The sandbox's box, when commands run through one (None: a bubblewrap or process group each)."""
        return self._box

    def _fallback_box(self, failed: Box, error: BoxUnavailableError) -> Box | None:
        """What runs the commands after `failed` could not start: the Python box after a compiled one (when
        the image has python3), else a bubblewrap per command (None)."""
        python = self.isolation.box_python() if failed.compiled else None
        binary = self.isolation.box_binary
        if failed.compiled and binary is not None:
            if compiled_box_failed(binary):
                logger.warning("%s; sandboxes run the Python box from now on (logged once)", error)
            else:
                logger.warning("%s; this sandbox runs the Python box", error)
        if python is not None:
            return Box(self.isolation, python=python)
        logger.warning("%s; each command gets a bubblewrap of its own from now on", error)
        return None

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise BackendError("the sandbox is being deleted")

    def _started(self, tree: ProcessTree) -> None:
        """`run_captured`'s on_start: the tree joins the live ones that `kill_all` ends, or dies at once if
        `kill_all` came first (`_run` checks before it launches; this holds wherever a launch may yield)."""
        self._live.add(tree)
        if self._closed:
            tree.kill()

    async def _run(self, isolation: Isolation, argv: list[str], request: ExecRequest) -> ExecResult:
        self._refuse_if_closed()
        cwd = isolation.resolve_cwd(request.cwd)
        env = {**isolation.base_env(), **self.env, **request.env}
        box = self._box
        if box is not None and isolation is self.isolation:
            try:
                return await box.run(
                    argv, cwd=cwd, env=env, stdin=bytes(request.stdin) if request.stdin is not None else None,
                    timeout_s=request.timeout_s, max_output_bytes=request.max_output_bytes,
                )  # fmt: skip
            except BoxUnavailableError as e:
                if self._box is box:
                    self._box = self._fallback_box(box, e)
                    if self._box is not None:
                        return await self._run(isolation, argv, request)
        launch = isolation.launch(argv, cwd=cwd, env=env, timeout_s=request.timeout_s)
        try:
            return await run_captured(
                launch.argv,
                tree_factory=launch.tree_factory,
                stdin=bytes(request.stdin) if request.stdin is not None else None,
                timeout_s=request.timeout_s,
                max_output_bytes=request.max_output_bytes,
                on_start=self._started,
                on_end=self._live.discard,
                **launch.popen,
            )
        finally:
            launch.close()

    async def apply_patch(self, patch: str, *, timeout_s: float = 60.0) -> ExecResult:
        """Apply a unified diff with `git apply` in the workspace root; the patch goes to git's stdin.

        git itself refuses paths that leave the work tree or go through a symlink; it runs sandboxed like any
        command, so even a git bug could not write outside the workspace.
        """
        if not isinstance(patch, str):
            raise ValueError(f"patch must be a string, got {type(patch).__name__}")
        if not patch.strip():
            raise ValueError("patch must be a non-empty unified diff, got an empty string")
        request = ExecRequest(command=_GIT_APPLY, stdin=patch.encode(), timeout_s=timeout_s)
        return await self._run(self._patch_isolation, list(_GIT_APPLY), request)

    async def open_pty(self, command: str | None = None, cols: int = 80, rows: int = 24) -> LocalPty:
        """An interactive terminal running `command` under `bash -lc` (default: an interactive bash)."""
        if command is not None and (not isinstance(command, str) or not command.strip() or "\x00" in command):
            raise ValueError(f"command must be a non-empty string or None, got {command!r}")
        self._refuse_if_closed()
        argv = ["bash", "-i"] if command is None else ["bash", "-lc", command]
        env = {**self.isolation.base_env(), "TERM": "xterm-256color", **self.env}
        launch = self.isolation.launch(
            argv, cwd=self.isolation.resolve_cwd(None), env=env, timeout_s=None, tty=True
        )
        try:
            pty = await LocalPty.start(launch, cols=cols, rows=rows, on_close=self._ptys.discard)
        finally:
            launch.close()
        self._ptys.add(pty)
        return pty

    async def kill_all(self) -> None:
        """End every running command and terminal of the sandbox (used before it is deleted); a box is
        killed and not restarted.

        A command still being launched ends too (its box killed while it starts, or its process the moment
        it is registered), reported as killed: exit code 137 from a box, -9 from a bubblewrap per command.
        Every later `exec`, `apply_patch` and `open_pty` raises BackendError.
        """
        self._closed = True
        for tree in list(self._live):
            tree.kill()
        if self._box is not None:
            await self._box.close()
        await asyncio.gather(*(p.close() for p in list(self._ptys)), return_exceptions=True)
        self._ptys.clear()

    # -- files --------------------------------------------------------------------------------------------

    async def write_file(self, path: str, data: bytes, mode: int | None = None) -> None:
        await asyncio.to_thread(self.workspace.write_file, path, data, mode)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return await asyncio.to_thread(self.workspace.read_file, path, max_bytes)

    async def extract_archive(self, path: str, data: bytes) -> ArchiveSummary:
        """Unpack a tar (gzipped or not) into the directory `path` (`orchard.env.agent.archive`)."""
        return await asyncio.to_thread(extract_archive, self.workspace, path, data)

    async def list_files(self, path: str = ".", recursive: bool = False) -> list[FileInfo]:
        return await asyncio.to_thread(self.workspace.list_files, path, recursive)

    async def resources(self) -> Resources:
        limits = self.isolation.limits
        disk = await asyncio.to_thread(self.workspace.disk_usage)
        return Resources(cpu=limits.cpu, memory_mb=limits.memory_mb, pids=limits.pids, disk_bytes=disk)

    @property
    def isolated(self) -> bool:
        """True when commands run under bubblewrap (False: the process-group fallback)."""
        return self.isolation.mode == BUBBLEWRAP
