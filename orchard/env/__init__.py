"""orchard.env: the sandbox service (Orchard-Env-compatible REST API) and its clients.

Import cost stays low: the client and errors load eagerly; the server, orchestrator and backends load only
when used (`orchard.env.embedded.serve`, `orchard env serve`). `BASE_URL_ENV` and `API_KEY_ENV` name the variables
the clients read (`SANDBOX_BASE_URL`, `SANDBOX_API_KEY`); `orchard.env.embedded.API_KEY_ENV` is another one, the
service's own key.
"""

from orchard.env.client import (
    API_KEY_ENV,
    BASE_URL_ENV,
    AsyncSandbox,
    AsyncSandboxClient,
    AsyncSandboxPool,
    AsyncSnapshot,
    FileEntry,
    JobResult,
    PatchResult,
    RetryPolicy,
    Sandbox,
    SandboxClient,
    Snapshot,
)
from orchard.env.errors import (
    AuthError,
    BackendRefusedError,
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
    "API_KEY_ENV",
    "BASE_URL_ENV",
    "AsyncSandbox",
    "AsyncSandboxClient",
    "AsyncSandboxPool",
    "AsyncSnapshot",
    "AuthError",
    "BackendRefusedError",
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
    "Snapshot",
    "WaitTimeoutError",
]
