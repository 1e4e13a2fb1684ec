"""What the orchestrator remembers, and the interface every state store implements.

The orchestrator keeps three kinds of record: sandboxes, jobs (one per exec), and idempotency records (one per
`Idempotency-Key` seen on a mutating request). The embedded default is `SQLiteStore`; a Redis store for several
orchestrator replicas implements the same `StateStore` protocol. Every method is a coroutine so that a store may
do network I/O; the SQLite store answers without awaiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

SANDBOX_STATUSES = ("pending", "ready", "failed", "deleting")
JOB_STATUSES = ("queued", "running", "succeeded", "failed")
JOB_DONE = ("succeeded", "failed")


@dataclass
class SandboxRecord:
    sandbox_id: str
    image: str
    block_network: bool = True
    cpu: str | None = None
    """As the API was given it ("2", "500m"); None = the backend's default."""
    memory: str | None = None
    """As the API was given it ("512Mi", "2Gi"); None = the backend's default."""
    timeout: int = 3600
    """Orchard Env's ready timeout in seconds, echoed back."""
    env: dict[str, str] = field(default_factory=dict)
    status: str = "pending"
    status_message: str = ""
    created_at: float = 0.0
    last_heartbeat: float = 0.0
    heartbeat_timeout: float = 600.0
    """Seconds without a heartbeat (or any exec) after which the reaper deletes the sandbox."""
    expires_at: float | None = None
    """Hard end of life (epoch seconds) from `ttl_seconds`; None = none."""


@dataclass
class JobRecord:
    job_id: str
    sandbox_id: str
    command: str
    status: str = "queued"
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    created_at: float = 0.0
    started_at: float | None = None
    completed_at: float | None = None
    error: str | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float | None = None


@dataclass
class IdempotencyRecord:
    key: str
    fingerprint: str
    """sha256 of method, path and body: the same key with another request is refused."""
    created_at: float
    resource_id: str | None = None
    """The sandbox or job the request made (known before it finishes, so a retry can attach to it)."""
    status_code: int | None = None
    """None while the first request is still in flight."""
    response: str | None = None
    """The JSON body first answered, replayed to every retry."""


@runtime_checkable
class StateStore(Protocol):
    """Durable orchestrator state. Implementations must make `claim_idempotency` atomic: of two concurrent
    claims of one key exactly one gets None back."""

    async def put_sandbox(self, record: SandboxRecord) -> None: ...

    async def insert_sandbox(self, record: SandboxRecord) -> bool:
        """Insert unless the id exists; False when it does."""
        ...

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None: ...

    async def list_sandboxes(self) -> list[SandboxRecord]: ...

    async def delete_sandbox(self, sandbox_id: str) -> None: ...

    async def touch_sandbox(self, sandbox_id: str, last_heartbeat: float) -> bool:
        """Set only `last_heartbeat` (False when no such sandbox): never writes back a stale record."""
        ...

    async def put_job(self, record: JobRecord) -> None: ...

    async def get_job(self, job_id: str) -> JobRecord | None: ...

    async def list_jobs(self, statuses: tuple[str, ...] | None = None) -> list[JobRecord]: ...

    async def delete_jobs_completed_before(self, before: float) -> int: ...

    async def claim_idempotency(self, record: IdempotencyRecord) -> IdempotencyRecord | None:
        """Store `record` if its key is new and return None; otherwise return the existing record unchanged."""
        ...

    async def create_job_idempotent(
        self, job: JobRecord, claim: IdempotencyRecord | None, *, touched_at: float | None = None
    ) -> IdempotencyRecord | None:
        """Insert `job` and, atomically with it, `claim` (resource_id = the job id) and, with `touched_at`,
        `touch_sandbox(job.sandbox_id, touched_at)`. When the key exists nothing is written and the existing
        record is returned."""
        ...

    async def complete_idempotency(self, key: str, status_code: int, response: str) -> None: ...

    async def get_idempotency(self, key: str) -> IdempotencyRecord | None: ...

    async def list_idempotency(self, pending_only: bool = False) -> list[IdempotencyRecord]: ...

    async def delete_idempotency(self, key: str) -> None: ...

    async def delete_idempotency_before(self, before: float) -> int: ...

    async def close(self) -> None: ...
