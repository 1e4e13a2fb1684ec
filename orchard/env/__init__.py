"""orchard.env: the sandbox service (Orchard-Env-compatible REST API) and its clients.

Import cost stays low: the client and errors load eagerly; the server, orchestrator and backends load only
when used (`orchard.env.embedded.serve`, `orchard env serve`).
"""

from orchard.env.client import (
    AsyncSandbox,
    AsyncSandboxClient,
    AsyncSandboxPool,
    FileEntry,
    JobResult,
    PatchResult,
    RetryPolicy,
    Sandbox,
    SandboxClient,
)
from orchard.env.errors import (
    AuthError,
    BadRequestError,
    ConflictError,
    IdempotencyKeyReuseError,
    NotFoundError,
    PathError,
    SandboxConnectionError,
    SandboxError,
    ServerError,
    ServiceUnavailable,
    WaitTimeoutError,
)

__all__ = [
    "AsyncSandbox",
    "AsyncSandboxClient",
    "AsyncSandboxPool",
    "AuthError",
    "BadRequestError",
    "ConflictError",
    "FileEntry",
    "IdempotencyKeyReuseError",
    "JobResult",
    "NotFoundError",
    "PatchResult",
    "PathError",
    "RetryPolicy",
    "Sandbox",
    "SandboxClient",
    "SandboxConnectionError",
    "SandboxError",
    "ServerError",
    "ServiceUnavailable",
    "WaitTimeoutError",
]
