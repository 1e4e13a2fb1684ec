"""The contract between the orchestrator and a sandbox backend.

The orchestrator owns ids, state, auth, queues and the REST API; a backend owns the sandbox itself: its file
system, its isolation, and running commands in it (through the exec agent). The embedded default is
`orchard.env.backends.local.LocalBackend`; the Kubernetes backend implements the same protocol.

All paths given to a backend are relative to the sandbox's workspace root (`/workspace` inside the sandbox, or
any path under it); the backend refuses anything that resolves outside it with `PathEscapeError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

SHARED_MOUNT = "/.orchard-shared"
"""Where a backend's service-level shared folders appear in its sandboxes, read-only: ``SHARED_MOUNT/<name>``
(the local backend's `shared`; on Kubernetes an image layer or a read-only volume mounted there)."""


class BackendError(Exception):
    """A sandbox could not be created, reached or used (an environment failure, never a policy failure)."""


class SandboxNotFoundError(BackendError):
    """The backend holds no sandbox with this id."""


class PathEscapeError(BackendError, ValueError):
    """A file path resolves outside the sandbox (`..`, an absolute path elsewhere, a symlink pointing out)."""


class ImageNotFoundError(BackendError, ValueError):
    """The sandbox spec names an image the backend does not know (the API answers 400)."""


class IsolationUnavailableError(BackendError):
    """The backend cannot enforce an isolation the spec asks for (a blocked network without namespaces); the
    API answers 501 rather than report a property that would not hold."""


REFUSALS = ("quota_exceeded", "forbidden", "invalid")
"""Why a platform refuses a sandbox (`RefusedError.reason`)."""


class RefusedError(BackendError):
    """The platform under the backend refused the sandbox for a reason a retry alone does not change: a quota is
    used up ("quota_exceeded"), its policies forbid the request ("forbidden": RBAC, an admission policy), or it
    finds an object invalid ("invalid"). `reason` says which; the message, what the platform said. The API
    answers 403 (422 for "invalid"), never a 5xx that a client would retry."""

    def __init__(self, message: str, *, reason: str) -> None:
        if reason not in REFUSALS:
            raise ValueError(f"reason must be one of {REFUSALS}, got {reason!r}")
        super().__init__(message)
        self.reason = reason


class CapacityError(BackendError):
    """The backend cannot take another sandbox right now (the API answers 503 with Retry-After)."""


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox is made of. Limits of None mean the backend's defaults."""

    image: str = "host"
    """Name of a root file system in the backend's image registry ("host" = the host's, read-only)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables every command in the sandbox starts with."""
    network: bool = False
    """Allow network egress; off by default."""
    cpu: float | None = None
    """CPU limit in cores."""
    memory_mb: int | None = None
    """Memory limit in MiB."""
    pids: int | None = None
    """Maximum number of processes in the sandbox."""
    workdir: str = "/workspace"
    """Default working directory of commands."""


@dataclass(frozen=True)
class ExecRequest:
    command: str | list[str]
    """A shell string (run by `bash -lc`) or an argv list (run directly)."""
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    stdin: bytes | None = None
    max_output_bytes: int = 1 << 20
    """Cap per stream; the rest is dropped and the stream's `*_truncated` flag set."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    """The command's exit status; -signal when it was killed, 124 on timeout (as `timeout(1)`)."""
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0


@dataclass(frozen=True)
class FileInfo:
    path: str
    """Relative to the workspace root."""
    size: int
    is_dir: bool
    mode: int
    mtime: float


@dataclass(frozen=True)
class Resources:
    cpu: float | None
    memory_mb: int | None
    pids: int | None
    disk_bytes: int
    """Bytes used by the workspace."""


class PtySession(Protocol):
    """An interactive terminal inside a sandbox."""

    async def write(self, data: bytes) -> None: ...

    def read(self) -> AsyncIterator[bytes]:
        """Output chunks until the terminal's process exits."""
        ...

    async def resize(self, cols: int, rows: int) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """A place sandboxes live. Every method is safe to call concurrently for different sandboxes; the
    orchestrator serialises execs within one sandbox.

    Besides the members below, a backend may expose `isolation: str`, a word the service reports on /health
    (the local backend: "bubblewrap", or "process-group" when it had to fall back; Kubernetes: "pod").
    It may also expose `blocks_network: bool`, whether a sandbox created with `network=False` really has no
    network (the local backend: only under bubblewrap); the API reports `block_network` as it is enforced.
    Neither is part of the protocol so that test doubles need not define them; read them with
    `getattr(backend, "isolation", "unknown")` and `getattr(backend, "blocks_network", True)`.
    """

    name: str

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Make the sandbox ready to run commands. Idempotent for an id that already exists."""
        ...

    async def delete(self, sandbox_id: str) -> None:
        """Destroy the sandbox, ending every process in it. Idempotent."""
        ...

    async def exists(self, sandbox_id: str) -> bool: ...

    async def list_ids(self) -> list[str]:
        """Ids of the sandboxes this backend holds (used after an orchestrator restart to reconcile)."""
        ...

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        """Run one command to completion or timeout; a timeout ends its whole process tree."""
        ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int | None = None) -> None: ...

    async def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> bytes: ...

    async def extract_archive(self, sandbox_id: str, path: str, data: bytes) -> tuple[int, int]:
        """Unpack a tar (gzipped or not) into the directory `path` without a process in the sandbox (see
        `orchard.env.agent.archive`: members that leave `path` raise `PathEscapeError`, nothing written);
        returns the members and the file bytes written."""
        ...

    async def list_files(self, sandbox_id: str, path: str = ".", recursive: bool = False) -> list[FileInfo]: ...

    async def apply_patch(self, sandbox_id: str, patch: str) -> ExecResult:
        """Apply a unified diff with `git apply` inside the workspace; the patch is passed as data."""
        ...

    async def resources(self, sandbox_id: str) -> Resources: ...

    async def open_pty(self, sandbox_id: str, command: str | None = None, cols: int = 80, rows: int = 24) -> PtySession: ...

    async def close(self) -> None:
        """Release the backend's own resources (not the sandboxes)."""
        ...


class SnapshotNotFoundError(BackendError):
    """The backend holds no snapshot with this id."""


@runtime_checkable
class SnapshotBackend(Protocol):
    """A backend that can copy a sandbox's workspace: snapshots and forks (optional; the API answers 501
    `snapshots_unsupported` for a backend without them).

    A snapshot holds the workspace only (``/workspace``: files, directories, links, permission bits and times):
    running processes, a terminal's state, the sandbox's home and its environment's memory are not carried. It
    stays valid when its sandbox is deleted. A fork is a new sandbox whose workspace starts as a copy of a
    snapshot's or of a live sandbox's; it is as isolated from its source (and the source from it) as from any
    other sandbox: a write in one is never seen in the other.

    The orchestrator calls `snapshot` and `fork(parent_id=...)` only while no command of the source runs (it
    holds the source's exec lock), so the copy is of a quiet workspace.
    """

    async def snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        """Copy the sandbox's workspace into a new snapshot; `SandboxNotFoundError` when there is no sandbox.
        Either the whole snapshot exists afterwards or none (a failed copy leaves nothing)."""
        ...

    async def fork(self, sandbox_id: str, spec: SandboxSpec, *, parent_id: str | None = None,
                   snapshot_id: str | None = None) -> None:
        """Create sandbox `sandbox_id` as `create` does, its workspace a copy of the live sandbox `parent_id`'s
        or of the snapshot `snapshot_id`'s (exactly one); `SandboxNotFoundError` / `SnapshotNotFoundError` when
        the source is missing, and then nothing is made."""
        ...

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove the snapshot. Idempotent; forks made from it are not affected."""
        ...

    async def list_snapshot_ids(self) -> list[str]:
        """Ids of the complete snapshots the backend holds (used after a restart to reconcile)."""
        ...
