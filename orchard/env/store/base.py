"""What the orchestrator remembers, and the interface every state store implements.

The orchestrator keeps four kinds of record: sandboxes, jobs (one per exec), idempotency records (one per
`Idempotency-Key` seen on a mutating request), and snapshots (copies of a workspace that sandboxes are forked
from). The embedded default is `SQLiteStore`; `RedisStore` serves several orchestrator replicas behind one URL and
implements the same `StateStore` protocol. Every method is a coroutine so that a store may do network I/O; the
SQLite store answers without awaiting.

Several replicas need three more things from the store, which both stores provide:

- replicas: each replica says it is alive with a lease (`register_replica`, renewed well before it ends); a job
  is run by one replica (`claim_job` moves it from queued to running atomically, so of two claims one wins), and
  the queued or running jobs of a replica whose lease ended are failed as lost (`mark_lost_jobs`), never re-run;
  the creates it left in flight are settled by another (`replica_alive` tells which replica ended);
- locks with leases and fencing tokens (`acquire_lock`): each grant of a lock gets a larger token, and a write
  that needs the lock (`put_job_fenced`) is refused unless its token still holds the lock, checked atomically
  with the write. A holder paused past its lease thus cannot write, whoever holds the lock since;
- conditional sandbox writes (`put_sandbox_if`, `delete_sandbox_if`): a write that happens only while the stored
  record still has the status and replica its writer last saw, checked atomically with the write. The replica
  that creates a sandbox writes its outcome so, and the replica that settles a create another left in flight
  first takes the record over so: a creator paused past its lease cannot overwrite (or delete) the settlement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

SANDBOX_STATUSES = ("pending", "ready", "failed", "deleting")
JOB_STATUSES = ("queued", "running", "succeeded", "failed")
JOB_DONE = ("succeeded", "failed")
LOST_JOB_ERROR = "lost: the orchestrator stopped while this job was {status}; it was not run again"
"""The `error` of a job failed by `mark_lost_jobs` (formatted with the status it had)."""


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
    replica: str | None = None
    """The orchestrator replica that created it: while the record is "pending", the one whose create is in
    flight. Once that replica's lease has ended, another settles the record (`Orchestrator.settle_creates`)."""
    forked_from: str | None = None
    """"sandbox:<id>" or "snapshot:<id>" for a fork (its workspace started as that one's copy); None otherwise."""


SNAPSHOT_STATUSES = ("pending", "ready", "deleting")


@dataclass
class SnapshotRecord:
    """A snapshot: a copy of a sandbox's workspace (not its processes), from which sandboxes are forked."""

    snapshot_id: str
    sandbox_id: str
    """The sandbox it was taken of; it may be deleted since, and the snapshot stays valid."""
    image: str
    """The sandbox's spec, which a fork inherits: image, network, limits, environment."""
    block_network: bool = True
    cpu: str | None = None
    memory: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    status: str = "pending"
    """"pending" while the workspace is copied, "ready", "deleting" while it is removed."""
    created_at: float = 0.0
    replica: str | None = None
    """The replica that takes it: a pending snapshot of a replica whose lease ended is dropped."""


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
    replica: str | None = None
    """The orchestrator replica that queued it and, once claimed, the one that runs it."""


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
    """Durable orchestrator state. Implementations must make `claim_idempotency`, `create_job_idempotent`,
    `claim_job`, `mark_lost_jobs` (per job), `acquire_lock` and `put_job_fenced` atomic: of two concurrent claims
    of one key, one job or one free lock exactly one succeeds."""

    shared: bool
    """True when orchestrators in other processes may use the store at the same time (Redis): an orchestrator
    then looks for lost jobs in every reaper pass and holds a store lock around each exec."""

    unavailable_errors: tuple[type[Exception], ...]
    """What a call raises when the store cannot be reached for now (a refused or dropped connection, a timeout):
    the call may or may not have taken effect. An orchestrator waits such an outage out on an exec's way (its
    claim, its result) rather than report the store's error as the command's outcome. Empty for a store that
    is never unreachable (SQLite)."""

    async def put_sandbox(self, record: SandboxRecord) -> None: ...

    async def insert_sandbox(self, record: SandboxRecord) -> bool:
        """Insert unless the id exists; False when it does."""
        ...

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None: ...

    async def list_sandboxes(self) -> list[SandboxRecord]: ...

    async def delete_sandbox(self, sandbox_id: str) -> None: ...

    async def put_sandbox_if(self, record: SandboxRecord, *, status: str, replica: str | None) -> bool:
        """`put_sandbox`, only while the stored record of `record.sandbox_id` has `status` and `replica`;
        False (nothing written) when it is gone or has changed. Atomic: of two such writes expecting the same
        state, one succeeds."""
        ...

    async def delete_sandbox_if(self, sandbox_id: str, *, status: str, replica: str | None) -> bool:
        """`delete_sandbox`, only while the stored record has `status` and `replica`; False (nothing deleted)
        otherwise. Atomic, as `put_sandbox_if`."""
        ...

    async def touch_sandbox(self, sandbox_id: str, last_heartbeat: float) -> bool:
        """Set only `last_heartbeat` (False when no such sandbox): never writes back a stale record."""
        ...

    async def insert_snapshot(self, record: SnapshotRecord, *, limit: int | None = None) -> str:
        """Insert unless the id exists ("exists") or `limit` snapshots exist already ("full"); "inserted" when
        it did. Atomic: of concurrent inserts, at most `limit` are held."""
        ...

    async def put_snapshot(self, record: SnapshotRecord) -> None: ...

    async def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None: ...

    async def list_snapshots(self) -> list[SnapshotRecord]:
        """Every snapshot record, by id."""
        ...

    async def delete_snapshot(self, snapshot_id: str) -> None: ...

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

    async def register_replica(self, replica: str, lease_s: float) -> None:
        """Say that `replica` is alive for the next `lease_s` seconds (call again before that to stay alive)."""
        ...

    async def replica_alive(self, replica: str) -> bool:
        """Whether `replica`'s lease (`register_replica`) has not ended yet."""
        ...

    async def claim_job(self, job_id: str, replica: str, started_at: float) -> bool:
        """If the job is queued: make it running, run by `replica`, started at `started_at`, and return True.
        False when it is gone or no longer queued (another replica claimed it, or it was marked lost): then it
        must not run."""
        ...

    async def mark_lost_jobs(self, completed_at: float) -> list[str]:
        """Fail every queued or running job whose replica's lease has ended (or that has no replica) with
        `error = LOST_JOB_ERROR`; returns their ids. A job that changes meanwhile is left alone."""
        ...

    async def acquire_lock(self, name: str, lease_s: float) -> int | None:
        """Take the lock `name` for `lease_s` seconds if it is free (never taken, released, or its lease
        ended). Returns the fencing token, larger than every token given before for `name`; None when held."""
        ...

    async def renew_lock(self, name: str, token: int, lease_s: float) -> bool:
        """Extend the lease to `lease_s` seconds from now while `token` still holds the lock; else False."""
        ...

    async def release_lock(self, name: str, token: int) -> None:
        """Free the lock if `token` holds it (a stale token frees nothing)."""
        ...

    async def put_job_fenced(self, record: JobRecord, lock: str, token: int) -> bool:
        """`put_job`, only while `token` holds the lock `lock` and the stored job is running, run by
        `record.replica`; False (nothing written) otherwise."""
        ...

    async def close(self) -> None: ...
