"""The orchestrator: sandbox lifecycle, the job store, exec scheduling, idempotency, the reaper.

It owns ids, state and queues; a `Backend` owns the sandboxes themselves. The REST API (`orchard.env.server`)
is a thin layer over this class: it parses requests into `CreateParams` / `ExecParams` and shows records as
JSON; nothing here knows HTTP beyond the status code each `SandboxError` carries. Everything here is tested
through real HTTP too.

Scheduling. Execs in one sandbox run one at a time, in arrival order (an `asyncio.Lock` per sandbox, as a shell
session would). Across sandboxes at most `max_concurrent_execs` run at once (a semaphore); the rest wait in
line. When `max_pending_execs` is set and that many are already waiting, a new exec is refused with 503 and
`Retry-After` instead of queueing.

Exactly-once. A mutating request that carries an `Idempotency-Key` is recorded with a fingerprint of the request.
A retry with the same key never runs the operation again: it gets the first answer replayed, or, for an exec
still in flight, is attached to the same job. The key and the job are written in one transaction, so even a
retry that races the first request cannot start a second job.

Restart. State lives in the store. On `start()` the orchestrator reconciles it with `backend.list_ids()`: live
sandboxes are kept, a ready sandbox the backend no longer holds is marked `failed` with a `status_message`
starting with "lost:" (its client learns why on its next call; the reaper removes it as any other), other
records of sandboxes the backend no longer holds are dropped, sandboxes the store does not know are deleted (but
not by a store that holds no sandbox at all: see below), and jobs that were queued or running when the previous
process died are marked `failed` with `error` starting with "lost:". A lost job is never re-run: the command may have had side effects, and running
it twice would break the exactly-once promise. Then the reaper runs once, so what expired while the orchestrator
was down is deleted straight away.

An empty store beside live sandboxes. A store with no sandbox record while the backend holds sandboxes is far
more likely a store that lost its data (a Redis restarted without its append-only file, a SQLite file deleted)
than a cluster full of leaks; deleting them all would destroy every client's work. So `reconcile` then deletes
none: it logs an error that names how many it kept, counts them on `/resources` (`unknown_sandboxes_kept`), and
leaves them to the operator, who deletes them by hand or restarts one replica with `allow_empty_store_sweep`
(`orchard env serve --allow-empty-store-sweep`, or `ORCHARD_ENV_ALLOW_EMPTY_STORE_SWEEP=1`) to sweep them as
unknown sandboxes are swept otherwise. A store that holds any record is trusted as before.

Replicas. With a shared store (`RedisStore`) several orchestrators serve one URL over one backend. Each is a
replica with an id and a lease in the store, renewed every third of `replica_lease_s`. A job is queued by the
replica that got the request and claimed by it atomically before it runs (`StateStore.claim_job`), so a job is
run at most once; an exec holds the store lock of its sandbox (`orchard.env.locks.StoreLock`), so execs of one
sandbox run one at a time across replicas, and the job's result is written with the lock's fencing token, so a
replica paused past its lease cannot write. Every reaper pass fails, as lost, the queued and running jobs of
replicas whose lease has ended: the same "lost:" jobs a restart reports, never re-run. It also settles the
creates such a replica left in flight (`settle_creates`; a sandbox record names the replica that creates it): a
sandbox the backend holds is adopted (waited for until ready, or failed with the backend's reason), one it does
not is dropped with whatever its create had made, and the create's Idempotency-Key is answered or forgotten, as
a restart does. A restart leaves alone the pending records of replicas that are still alive. Sandbox records
are fenced like job results: the settling replica first takes the pending record over (a conditional write
that expects it pending and its creator's), and the creator writes its outcome only while the record is still
pending and its own (`StateStore.put_sandbox_if`), so a creator that was paused past its lease, not dead, cannot
overwrite the settlement when it resumes: its client gets `CreateTakenOverError` (409) instead. A user's delete
of a pending record waits for the create on whichever replica makes it (polling the store for another's) and
then writes "deleting" conditionally on the record it read; it takes the record over without waiting only when
its creator's lease has ended, or once its wait is up (`delete_sandbox`). Once "deleting", no create writes the
record, and a creator (or settler) whose write a delete refused deletes what it made: the delete wins and
leaves nothing behind. The reaper leaves a pending record alone while its create runs (it reaps it, if still
due, once created); one whose create no longer runs (its creator's last store write failed, or its creator
died) it reaps like any other.
A wait (`wait_sandbox`) and the readiness check of an exec or a file call wait for a create the same way,
through the same helper (`_past_create`), bounded by their timeout; one whose creator's lease has ended they
poll until `settle_creates` settles it, rather than take it over as a delete does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shlex
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from orchard.env.backends.base import (
    Backend,
    BackendError,
    CapacityError,
    ExecRequest,
    ExecResult,
    FileInfo,
    IsolationUnavailableError,
    PathEscapeError,
    PtySession,
    RefusedError,
    Resources,
    SandboxNotFoundError,
    SandboxSpec,
)
from orchard.env.errors import (
    BackendRefusedError,
    BadRequestError,
    ConflictError,
    IdempotencyKeyReuseError,
    NotFoundError,
    PathError,
    SandboxError,
    ServerError,
    ServiceUnavailable,
    WaitTimeoutError,
)
from orchard.env.locks import StoreLock
from orchard.env.store.base import (
    JOB_DONE,
    LOST_JOB_ERROR,
    IdempotencyRecord,
    JobRecord,
    SandboxRecord,
    StateStore,
)

logger = logging.getLogger(__name__)

SANDBOX_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
STORE_OUTAGE_ERROR = "store unavailable: the state store stayed unreachable for {seconds:g} s; the command was not run"
"""The `error` of a job that an outage of the store kept from running (formatted with `store_outage_s`)."""
LOST_WHILE_DOWN = "lost: the backend no longer holds this sandbox (it went while no replica of the service ran)"
"""The `status_message` of a ready sandbox that `reconcile` finds gone from the backend."""
__all__ = ["LOST_JOB_ERROR", "LOST_WHILE_DOWN", "STORE_OUTAGE_ERROR", "CreateParams", "CreateTakenOverError",
           "ExecParams", "Orchestrator"]
_T = TypeVar("_T")


class CreateTakenOverError(ConflictError):
    """This replica's create was settled by another replica, which took it over when this one's lease had
    ended (it was stalled, not dead), or the sandbox was deleted meanwhile: the record is no longer this
    create's to write. The outcome is the other writer's, and so is the create's Idempotency-Key."""


@dataclass(frozen=True)
class CreateParams:
    """A create request, as the API received it (Orchard Env field names)."""

    image: str = "host"
    block_network: bool = True
    sandbox_id: str | None = None
    cpu: str | None = None
    memory: str | None = None
    timeout: int | None = None
    ttl_seconds: float | None = None
    heartbeat_timeout: float | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecParams:
    command: str | list[str]
    timeout_seconds: float | None = None
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    login_shell: bool = False
    max_output_bytes: int | None = None
    stdin: bytes | None = None


def parse_cpu(value: str | None) -> float | None:
    """Kubernetes CPU quantity to cores: "2" -> 2.0, "500m" -> 0.5. None stays None."""
    if value is None or value == "":
        return None
    text = str(value).strip()
    try:
        cores = float(text[:-1]) / 1000.0 if text.endswith("m") else float(text)
    except ValueError:
        raise BadRequestError(f"cpu must look like '2' or '500m', got {value!r}") from None
    if not cores > 0:
        raise BadRequestError(f"cpu must be > 0, got {value!r}")
    return cores


_MEMORY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6,
                 "G": 10**9, "T": 10**12, "": 1}


def parse_memory_mb(value: str | None) -> int | None:
    """Kubernetes memory quantity to MiB, rounded up: "16Gi" -> 16384, "1G" -> 954, "512Mi" -> 512."""
    if value is None or value == "":
        return None
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(Ki|Mi|Gi|Ti|K|M|G|T|)\s*", str(value))
    if not match:
        raise BadRequestError(f"memory must look like '512Mi' or '2Gi', got {value!r}")
    n_bytes = float(match.group(1)) * _MEMORY_UNITS[match.group(2)]
    if n_bytes <= 0:
        raise BadRequestError(f"memory must be > 0, got {value!r}")
    return max(1, -(-int(n_bytes) // (1 << 20)))


@contextlib.contextmanager
def backend_errors(sandbox_id: str) -> Iterator[None]:
    """Translate a backend's exceptions into API errors (PathEscapeError first: it is also a ValueError)."""
    try:
        yield
    except PathEscapeError as exc:
        raise PathError(str(exc), detail={"error": "path_escape", "message": str(exc)}) from exc
    except SandboxNotFoundError as exc:
        raise NotFoundError(f"Sandbox {sandbox_id} not found") from exc
    except FileNotFoundError as exc:
        raise NotFoundError(f"File not found: {exc.filename or exc}") from exc
    except (IsADirectoryError, NotADirectoryError) as exc:
        raise BadRequestError(f"{type(exc).__name__}: {exc}") from exc
    except CapacityError as exc:
        raise ServiceUnavailable(f"backend at capacity: {exc}") from exc
    except IsolationUnavailableError as exc:
        # not retryable (501, not 503): nothing changes until the operator fixes the machine or opts in
        raise ServerError(str(exc), status_code=501,
                          detail={"error": "isolation_unavailable", "message": str(exc)}) from exc
    except ValueError as exc:
        raise BadRequestError(str(exc)) from exc
    except RefusedError as exc:  # a 4xx: a retry alone changes nothing
        raise BackendRefusedError(str(exc), status_code=422 if exc.reason == "invalid" else 403,
                                  detail={"error": exc.reason, "message": str(exc)}) from exc
    except BackendError as exc:
        raise ServerError(f"backend error: {exc}") from exc


class Orchestrator:
    """Sandbox lifecycle, exec jobs and idempotency over a `Backend` and a `StateStore`.

    Args:
        backend: where sandboxes live.
        store: where state lives (survives restarts when the store does).
        max_concurrent_execs: execs (and patches) running at once across all sandboxes. Default 64.
        max_pending_execs: execs allowed to wait for a slot before new ones get 503; None = unbounded.
        default_exec_timeout_s: an exec's timeout when the request gives none. Default 300 (Orchard Env's).
        heartbeat_timeout_s: a sandbox with no heartbeat, exec or running job for this long is deleted.
            Default 600.
        reap_interval_s: how often the reaper runs. Default 5.
        job_retention_s: finished jobs are forgotten this long after they end. Default 6 h.
        idempotency_ttl_s: how long a key is remembered. Default 24 h.
        max_output_bytes: per-stream output cap of an exec (the request may lower it). Default 1 MiB.
        retry_after_s: the `Retry-After` sent with a 503. Default 1.
        replica_lease_s: how long this replica counts as alive in the store without renewing (it renews every
            third of it), and the lease of a sandbox's store lock during an exec. With a shared store, the jobs
            of a replica that died are reported lost this long after it stopped. Default 30.
        store_outage_s: how long an exec waits for a store that cannot be reached (`StateStore.unavailable_errors`:
            Redis restarting, a dropped connection) to take its lock, claim its job and record its result,
            trying again with backoff. An outage thus delays a result, never changes it. Default 1 h.
        allow_empty_store_sweep: delete the sandboxes the backend holds and the store does not know even when the
            store holds no sandbox at all (a store that lost its data looks so). Default False: they are kept
            and an error is logged (see "An empty store beside live sandboxes" above).
        max_snapshots: how many snapshots may exist at once (`orchard.env.forks`); one more is refused with 403
            `quota_exceeded`. None (default): no bound.
        max_forks: how many forked sandboxes may exist at once; one more is refused the same way. None: no bound.
        clock: epoch-seconds clock (tests pass a fake one).

    Attributes:
        sandbox_response: how the API shows a sandbox (set by the HTTP layer, `create_app`). After a restart,
            a create whose answer was lost with the previous process is answered with it; while it is None,
            such a create's Idempotency-Key is forgotten instead.
    """

    def __init__(
        self,
        backend: Backend,
        store: StateStore,
        *,
        max_concurrent_execs: int = 64,
        max_pending_execs: int | None = None,
        default_exec_timeout_s: float = 300.0,
        heartbeat_timeout_s: float = 600.0,
        reap_interval_s: float = 5.0,
        job_retention_s: float = 6 * 3600.0,
        idempotency_ttl_s: float = 24 * 3600.0,
        max_output_bytes: int = 1 << 20,
        retry_after_s: float = 1.0,
        replica_lease_s: float = 30.0,
        store_outage_s: float = 3600.0,
        allow_empty_store_sweep: bool = False,
        max_snapshots: int | None = None,
        max_forks: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(max_concurrent_execs, int) or max_concurrent_execs < 1:
            raise ValueError(f"max_concurrent_execs must be an int >= 1, got {max_concurrent_execs!r}")
        if max_pending_execs is not None and (not isinstance(max_pending_execs, int) or max_pending_execs < 0):
            raise ValueError(f"max_pending_execs must be None or an int >= 0, got {max_pending_execs!r}")
        for name, value in (("default_exec_timeout_s", default_exec_timeout_s),
                            ("heartbeat_timeout_s", heartbeat_timeout_s), ("reap_interval_s", reap_interval_s),
                            ("job_retention_s", job_retention_s), ("idempotency_ttl_s", idempotency_ttl_s),
                            ("retry_after_s", retry_after_s), ("replica_lease_s", replica_lease_s),
                            ("store_outage_s", store_outage_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        for name, bound in (("max_snapshots", max_snapshots), ("max_forks", max_forks)):
            if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {bound!r}")
        self.max_snapshots = max_snapshots
        self.max_forks = max_forks
        if not isinstance(max_output_bytes, int) or max_output_bytes < 1:
            raise ValueError(f"max_output_bytes must be an int >= 1, got {max_output_bytes!r}")
        self.backend = backend
        self.store = store
        self.max_concurrent_execs = max_concurrent_execs
        self.max_pending_execs = max_pending_execs
        self.default_exec_timeout_s = float(default_exec_timeout_s)
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.reap_interval_s = float(reap_interval_s)
        self.job_retention_s = float(job_retention_s)
        self.idempotency_ttl_s = float(idempotency_ttl_s)
        self.max_output_bytes = max_output_bytes
        self.retry_after_s = float(retry_after_s)
        self.replica_lease_s = float(replica_lease_s)
        self.store_outage_s = float(store_outage_s)
        if not isinstance(allow_empty_store_sweep, bool):
            raise ValueError(f"allow_empty_store_sweep must be a bool, got {allow_empty_store_sweep!r}")
        self.allow_empty_store_sweep = allow_empty_store_sweep
        self.unknown_sandboxes_kept: list[str] = []
        """Sandboxes the backend holds that the last `reconcile` kept although no record owns them (the store
        was empty and `allow_empty_store_sweep` was off)."""
        self.replica_id = uuid.uuid4().hex[:12]
        """This orchestrator's name in the store: the owner of the jobs it queues and runs."""
        self.clock = clock
        self._slots = asyncio.Semaphore(max_concurrent_execs)
        self._locks: dict[str, asyncio.Lock] = {}
        self._job_done: dict[str, asyncio.Event] = {}
        self._live_jobs: dict[str, JobRecord] = {}
        self._ready: dict[str, asyncio.Event] = {}
        self._idem_done: dict[str, asyncio.Event] = {}
        self._active_jobs: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self.pending_execs = 0
        self.running_execs = 0
        self.sandbox_response: Callable[[SandboxRecord], dict[str, Any]] | None = None

    @property
    def namespace(self) -> str:
        return getattr(self.backend, "name", "local")

    @property
    def isolation(self) -> str:
        """How the backend isolates sandboxes ("bubblewrap", "process-group", ...; "unknown" if it does not say)."""
        return getattr(self.backend, "isolation", "unknown")

    @property
    def blocks_network(self) -> bool:
        """Whether a sandbox created with `block_network` really has no network."""
        return bool(getattr(self.backend, "blocks_network", True))

    # life of the orchestrator itself
    async def start(self, *, reaper: bool = True) -> None:
        """Register this replica, reconcile the store with the backend, reap what expired, and start the
        periodic reaper."""
        await self.store.register_replica(self.replica_id, self.replica_lease_s)
        self._beat = asyncio.create_task(self._beat_forever())
        await self.reconcile()
        await self.reap_once()
        if reaper:
            self._reaper = asyncio.create_task(self._reap_forever())

    async def close(self) -> None:
        """Stop the reaper, cancel running jobs (their records stay; the next start marks them lost), and close
        the backend and the store. Sandboxes are left as they are: a restart finds them."""
        for task in (self._reaper, self._beat):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.backend.close()
        await self.store.close()

    async def reconcile(self) -> dict[str, list[str]]:
        """Make the store agree with the backend after a restart. Returns what it did, by kind."""
        now = self.clock()
        report: dict[str, list[str]] = {"lost_jobs": [], "dropped": [], "failed": [], "orphans_deleted": [],
                                        "orphans_kept": [], "kept": []}
        report["lost_jobs"] = await self.store.mark_lost_jobs(now)
        live = set(await self.backend.list_ids())
        known = {record.sandbox_id: record for record in await self.store.list_sandboxes()}
        in_flight: set[str] = set()
        for sandbox_id, record in known.items():
            if record.status == "pending" and await self._creating_elsewhere(record):
                in_flight.add(sandbox_id)  # another live replica is making it: its create decides
            elif record.status == "pending":
                outcome = await self._settle_create(record, live)
                report["dropped" if outcome == "dropped" else "kept"].append(sandbox_id)
            elif sandbox_id not in live and record.status == "ready":
                # gone while no replica watched (a pod deleted, a workspace removed): its client is told why
                # on its next call, as for a loss seen live, instead of a 404 for a sandbox it made
                record.status, record.status_message = "failed", LOST_WHILE_DOWN
                if await self.store.put_sandbox_if(record, status="ready", replica=record.replica):
                    logger.warning("sandbox %s failed: %s", sandbox_id, LOST_WHILE_DOWN)
                    report["failed"].append(sandbox_id)
            elif sandbox_id not in live and record.status == "failed":
                report["kept"].append(sandbox_id)  # its client learns why; its delete or TTL removes the record
            elif sandbox_id not in live:
                await self.store.delete_sandbox(sandbox_id)
                report["dropped"].append(sandbox_id)
            elif record.status == "deleting":
                await self._destroy(sandbox_id)
                report["dropped"].append(sandbox_id)
            else:
                report["kept"].append(sandbox_id)
        unknown = sorted(live - set(known))
        if unknown and not known and not self.allow_empty_store_sweep:
            report["orphans_kept"] = unknown
            logger.error("the state store holds no sandbox, yet the backend holds %d: kept them all (the store may "
                         "have lost its data; deleting them would destroy every client's work). Delete them by "
                         "hand, or restart one replica with allow_empty_store_sweep (--allow-empty-store-sweep, "
                         "ORCHARD_ENV_ALLOW_EMPTY_STORE_SWEEP=1) to sweep them. First ids: %s",
                         len(unknown), ", ".join(unknown[:10]))
            unknown = []
        self.unknown_sandboxes_kept = report["orphans_kept"]
        for sandbox_id in unknown:
            with contextlib.suppress(Exception):
                await self.backend.delete(sandbox_id)
            report["orphans_deleted"].append(sandbox_id)
        await self._settle_create_claims(lambda claim: claim.resource_id not in in_flight)
        logger.info("reconciled: %s", {k: len(v) for k, v in report.items()})
        return report

    async def _creating_elsewhere(self, record: SandboxRecord) -> bool:
        """Whether a pending record's create is in flight on another replica that is still alive."""
        return (record.replica is not None and record.replica != self.replica_id
                and await self.store.replica_alive(record.replica))

    async def _create_in_flight(self, record: SandboxRecord) -> bool:
        """Whether a pending record's create (or settlement) is still running: this replica's own while its
        event is there (until its outcome is written, or its write failed), another's while that replica's
        lease holds. One that is not will not end by itself: a delete may take it over."""
        if record.replica == self.replica_id:
            return record.sandbox_id in self._ready
        return await self._creating_elsewhere(record)

    async def _settle_create(self, record: SandboxRecord, live: set[str]) -> str:
        """Finish a create whose replica stopped half-way; what became of it: "ready", "failed" or "dropped"
        (or the status another writer gave the record meanwhile).

        First the record is taken over (pending, this replica's), expecting it pending and its creator's, so
        that the creator, were it only stalled, can no longer write its own outcome over this one. Then: the
        backend holds the sandbox (with Kubernetes: its pod was made): it is adopted, i.e. waited for as the
        create would have, and then is "ready", or "failed" with the reason. It does not: the create died before
        the sandbox existed, so the record is dropped and then what it may have made already (a Secret, a
        NetworkPolicy) deleted, as if the create had failed; a client's retry creates it anew."""
        sandbox_id, creator = record.sandbox_id, record.replica
        record.replica = self.replica_id
        if not await self.store.put_sandbox_if(record, status="pending", replica=creator):
            return await self._status_now(sandbox_id)  # its creator finished it after all
        if sandbox_id in live:
            # waited for on this replica as its own create is (`delete_sandbox`, `wait_sandbox`)
            event = self._ready[sandbox_id] = asyncio.Event()
            try:
                try:
                    await self.backend.create(sandbox_id, self._spec(record))
                    record.status = "ready"
                except Exception as exc:
                    record.status, record.status_message = "failed", f"create failed: {exc}"
                if not (self._own_create(sandbox_id, event)
                        and await self.store.put_sandbox_if(record, status="pending", replica=self.replica_id)):
                    now = await self._unless_deleted(sandbox_id)  # deleted meanwhile
                    return now.status if now is not None else "dropped"
                return record.status
            finally:
                self._end_create(sandbox_id, event)
        # the record goes first: a stalled creator whose sandbox appears after this finds no record and deletes
        # the sandbox itself (`_taken_over`); the other way round, one appearing between the two steps found the
        # record still there, kept its sandbox, and then the record went: a sandbox nobody knew of
        if not await self.store.delete_sandbox_if(sandbox_id, status="pending", replica=self.replica_id):
            return await self._status_now(sandbox_id)  # deleted meanwhile, with its sandbox
        with contextlib.suppress(Exception):
            await self.backend.delete(sandbox_id)
        return "dropped"

    async def _status_now(self, sandbox_id: str) -> str:
        record = await self.store.get_sandbox(sandbox_id)
        return record.status if record is not None else "dropped"

    async def _settle_create_claims(self, which: Callable[[IdempotencyRecord], bool]) -> None:
        """The pending Idempotency-Keys `which` selects, of creates no replica is making any more: answered
        with the sandbox when it is ready, else forgotten (a retry then runs the create again)."""
        for claim in await self.store.list_idempotency(pending_only=True):
            if not which(claim):
                continue
            made = await self.store.get_sandbox(claim.resource_id) if claim.resource_id else None
            if made is not None and made.status == "ready" and self.sandbox_response is not None:
                await self.store.complete_idempotency(claim.key, 200, json.dumps(self.sandbox_response(made)))
            else:
                await self.store.delete_idempotency(claim.key)

    async def settle_creates(self) -> dict[str, str]:
        """Settle the creates that replicas whose lease ended left in flight (their records "pending"): each
        is adopted ("ready", or "failed" with the reason) or dropped ("dropped") as `reconcile` does after a
        restart, and its pending Idempotency-Key answered or forgotten. Returns sandbox id -> what became of it.
        Every reaper pass runs it when the store is shared."""
        abandoned = [r for r in await self.store.list_sandboxes()
                     if r.status == "pending" and r.replica not in (None, self.replica_id)
                     and not await self.store.replica_alive(r.replica)]  # type: ignore[arg-type]
        if not abandoned:
            return {}
        live = set(await self.backend.list_ids())
        settled: dict[str, str] = {}
        for record in abandoned:
            # one survivor settles it: the sandbox's store lock (an exec's) keeps a second one out, and a record
            # no longer pending when the lock is had was settled meanwhile
            async with StoreLock(self.store, f"sandbox:{record.sandbox_id}", self.replica_lease_s):
                current = await self.store.get_sandbox(record.sandbox_id)
                if current is None or current.status != "pending" or current.replica != record.replica:
                    continue
                settled[record.sandbox_id] = await self._settle_create(current, live)
        if not settled:
            return settled
        await self._settle_create_claims(lambda claim: claim.resource_id in settled)
        logger.warning("creates left in flight by replicas whose lease ended, settled: %s", settled)
        return settled

    async def fail_lost_sandboxes(self) -> list[str]:
        """Mark "failed", with the backend's reason as `status_message`, every ready sandbox the backend has
        lost for good (Kubernetes: its pod failed, or was deleted out of band), and delete what is left of it
        (a pod's Secret and NetworkPolicy). Done only once the record says "failed": then no create of the same
        id can be under way. A loss of a sandbox deleted meanwhile is forgotten. Every reaper pass runs it, for
        backends that report losses (`lost_sandboxes`). Returns the ids marked failed."""
        lost_sandboxes = getattr(self.backend, "lost_sandboxes", None)
        if lost_sandboxes is None:
            return []
        failed = []
        for sandbox_id, reason in (await lost_sandboxes()).items():
            record = await self.store.get_sandbox(sandbox_id)
            if record is not None and record.status == "ready":
                record.status, record.status_message = "failed", reason
                if not await self.store.put_sandbox_if(record, status="ready", replica=record.replica):
                    continue  # changed meanwhile: the next pass reads it again
                logger.warning("sandbox %s failed: %s", sandbox_id, reason)
                failed.append(sandbox_id)
            if record is not None and record.status == "failed":
                with contextlib.suppress(Exception):
                    await self.backend.delete(sandbox_id)
            elif record is None or record.status == "deleting":  # its delete cleans up
                self.backend.forget_lost(sandbox_id)  # type: ignore[attr-defined]
        return failed

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.replica_lease_s / 3)
            try:
                await self.store.register_replica(self.replica_id, self.replica_lease_s)
            except Exception:
                logger.exception("renewing replica %s's lease failed", self.replica_id)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                await self.reap_once()
            except Exception:
                logger.exception("reaper failed")

    async def reap_once(self) -> list[str]:
        """Delete expired sandboxes (TTL passed, or idle past their heartbeat timeout with no job running),
        forget old finished jobs and old idempotency keys. Returns the ids of the sandboxes deleted."""
        now = self.clock()
        reaped = []
        for record in await self.store.list_sandboxes():
            expired = record.expires_at is not None and now >= record.expires_at
            idle = (self._active_jobs.get(record.sandbox_id, 0) == 0
                    and now - record.last_heartbeat >= record.heartbeat_timeout)
            # a create still running is left to its creator: a later pass reaps it once it is out of pending,
            # rather than this one waiting for it. A pending record with none running (its creator's last
            # write failed, or its creator died) is reaped as any other: nothing else would end it.
            in_flight = record.status == "pending" and await self._create_in_flight(record)
            if (expired or idle) and record.status != "deleting" and not in_flight:
                try:
                    await self.delete_sandbox(record.sandbox_id)
                    reaped.append(record.sandbox_id)
                except SandboxError:
                    logger.exception("reaping %s failed", record.sandbox_id)
        if self.store.shared:  # another replica may have died since the last pass; alone, only a restart loses
            lost = await self.store.mark_lost_jobs(now)
            if lost:
                logger.warning("jobs of replicas whose lease ended, failed as lost: %s", lost)
            await self.settle_creates()
        await self.fail_lost_sandboxes()
        await self.store.delete_jobs_completed_before(now - self.job_retention_s)
        await self.store.delete_idempotency_before(now - self.idempotency_ttl_s)
        if reaped:
            logger.info("reaped %d sandbox(es): %s", len(reaped), reaped)
        return reaped

    # idempotency
    async def idempotent(
        self,
        key: str | None,
        fingerprint: str,
        operation: Callable[[], Awaitable[tuple[int, dict[str, Any]]]],
        *,
        resource_id: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Run `operation` once per key; a repeat gets the first (status, body) back. Errors of the client
        (4xx) are remembered like successes; server errors are not, so a retry runs the operation again."""
        if key is None:
            return await operation()
        claim = IdempotencyRecord(key=key, fingerprint=fingerprint, created_at=self.clock(),
                                  resource_id=resource_id)
        existing = await self.store.claim_idempotency(claim)
        if existing is not None:
            return await self._replay(existing, fingerprint)
        done = self._idem_done[key] = asyncio.Event()
        try:
            try:
                status, body = await operation()
            except SandboxError as exc:
                if exc.status_code >= 500 or isinstance(exc, CreateTakenOverError):
                    raise
                status, body = exc.status_code, {"detail": exc.detail}
            await self.store.complete_idempotency(key, status, json.dumps(body))
            return status, body
        except BaseException as exc:
            if not isinstance(exc, CreateTakenOverError):  # else the key is the settling replica's to answer
                await self.store.delete_idempotency(key)
            raise
        finally:
            done.set()
            self._idem_done.pop(key, None)

    async def _replay(self, record: IdempotencyRecord, fingerprint: str) -> tuple[int, dict[str, Any]]:
        if record.fingerprint != fingerprint:
            raise IdempotencyKeyReuseError(
                f"Idempotency-Key {record.key!r} was first used with a different request",
                detail={"error": "idempotency_key_reuse", "key": record.key},
            )
        deadline = time.monotonic() + 600.0
        while record.status_code is None:
            event = self._idem_done.get(record.key)
            if event is not None:
                await event.wait()
            elif time.monotonic() > deadline:
                raise ConflictError(f"the request with Idempotency-Key {record.key!r} is still in flight")
            else:
                await asyncio.sleep(0.05)
            fresh = await self.store.get_idempotency(record.key)
            if fresh is None:  # the first attempt failed with a server error: this retry runs it anew
                raise ServiceUnavailable("the first attempt of this request failed; retry",
                                         retry_after_s=self.retry_after_s)
            record = fresh
        assert record.response is not None
        return record.status_code, json.loads(record.response)

    # sandboxes
    def _spec(self, record: SandboxRecord) -> SandboxSpec:
        return SandboxSpec(image=record.image, env=dict(record.env), network=not record.block_network,
                           cpu=parse_cpu(record.cpu), memory_mb=parse_memory_mb(record.memory))

    async def create_sandbox(self, params: CreateParams, *,
                             make: Callable[[str, SandboxSpec], Awaitable[None]] | None = None,
                             forked_from: str | None = None) -> SandboxRecord:
        """Create a sandbox and wait until the backend has made it (status "ready").

        A fork (`orchard.env.forks`) passes `make`, what makes it in the backend instead of `backend.create`,
        and `forked_from`, its source as the record names it.

        Raises:
            BadRequestError: bad id, image, cpu, memory or timeouts (400).
            ConflictError: the id exists (409).
            ServiceUnavailable: the backend is at capacity (503).
        """
        sandbox_id = params.sandbox_id or uuid.uuid4().hex[:12]
        if not SANDBOX_ID_RE.match(sandbox_id):
            raise BadRequestError(f"sandbox_id must match {SANDBOX_ID_RE.pattern}, got {sandbox_id!r}")
        if not params.image or not isinstance(params.image, str):
            raise BadRequestError(f"image must be a non-empty string, got {params.image!r}")
        for name in ("ttl_seconds", "heartbeat_timeout", "timeout"):
            value = getattr(params, name)
            if value is not None and not value > 0:
                raise BadRequestError(f"{name} must be > 0, got {value!r}")
        now = self.clock()
        record = SandboxRecord(
            sandbox_id=sandbox_id, image=params.image, block_network=params.block_network, cpu=params.cpu,
            memory=params.memory, timeout=int(params.timeout or 3600), env=dict(params.env), status="pending",
            created_at=now, last_heartbeat=now,
            heartbeat_timeout=float(params.heartbeat_timeout or self.heartbeat_timeout_s),
            expires_at=now + params.ttl_seconds if params.ttl_seconds else None, replica=self.replica_id,
            forked_from=forked_from,
        )
        spec = self._spec(record)  # validates cpu and memory before anything is stored
        if not await self.store.insert_sandbox(record):
            raise ConflictError(f"Sandbox {sandbox_id} already exists")
        # set once the outcome is written, not before: a waiter on this replica then reads it from the store
        event = self._ready[sandbox_id] = asyncio.Event()
        try:
            try:
                with backend_errors(sandbox_id):
                    await (make or self.backend.create)(sandbox_id, spec)
            except BaseException as exc:
                # conditional, as the write below: a replica that settled this create meanwhile owns it now
                mine = (self._own_create(sandbox_id, event)
                        and await self.store.delete_sandbox_if(sandbox_id, status="pending", replica=self.replica_id))
                if mine:
                    with contextlib.suppress(Exception):
                        await self.backend.delete(sandbox_id)
                if mine or not isinstance(exc, Exception):
                    raise
                raise await self._taken_over(sandbox_id) from exc
            record.status = "ready"
            if not (self._own_create(sandbox_id, event)
                    and await self.store.put_sandbox_if(record, status="pending", replica=self.replica_id)):
                raise await self._taken_over(sandbox_id)
            return record
        finally:
            self._end_create(sandbox_id, event)

    def _own_create(self, sandbox_id: str, event: asyncio.Event) -> bool:
        """Whether the create (or settlement) that set up `event` still owns the sandbox's pending record on
        this replica. The store's fence (pending, this replica) cannot tell: a delete may have taken the record
        over and a new create of the same id on this replica inserted a record that matches it again."""
        return self._ready.get(sandbox_id) is event

    def _end_create(self, sandbox_id: str, event: asyncio.Event) -> None:
        """Wake the create's waiters; its entry goes only while it is its own, not a later create's."""
        if self._own_create(sandbox_id, event):
            del self._ready[sandbox_id]
        event.set()

    async def _taken_over(self, sandbox_id: str) -> CreateTakenOverError:
        """The error of a create whose record another replica settled while this one stalled past its lease.
        A record that replica dropped, or that a delete took, leaves what this create made to nobody: it is
        deleted here."""
        record = await self._unless_deleted(sandbox_id)
        now = f"it is {record.status} now" if record is not None else "it is gone"
        logger.warning("sandbox %s: create taken over by another replica (%s)", sandbox_id, now)
        return CreateTakenOverError(
            f"Sandbox {sandbox_id}: another replica settled the create while this one was stalled past its "
            f"lease, or the sandbox was deleted meanwhile ({now}); GET the sandbox, or retry with the same "
            "Idempotency-Key, for its state")

    async def _unless_deleted(self, sandbox_id: str) -> SandboxRecord | None:
        """The record as it is now, after this replica's write of a create's outcome (its own or one it settles)
        was refused. When it is gone or "deleting", a delete ran before or while this replica's backend create
        made the sandbox, and may have found nothing to delete: what the create made is deleted here (a backend
        delete is idempotent, so a second one does no harm)."""
        record = await self.store.get_sandbox(sandbox_id)
        if record is None or record.status == "deleting":
            with contextlib.suppress(Exception):
                await self.backend.delete(sandbox_id)
        return record

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord:
        record = await self.store.get_sandbox(sandbox_id)
        if record is None:
            raise NotFoundError(f"Sandbox {sandbox_id} not found")
        return record

    async def wait_sandbox(self, sandbox_id: str, timeout: float) -> SandboxRecord:
        """Block until the sandbox is out of "pending"; `WaitTimeoutError` (408) after `timeout` seconds.

        The create is waited for on whichever replica makes it (`_past_create`): this replica's own on its
        event, another's by polling the store. A create whose replica's lease has ended is left to the reaper's
        `settle_creates` (on any replica) and polled until `timeout` like a live one: a wait only reads, unlike
        a delete, which takes such a record over. A pending record of this replica's with no create running
        (nothing will end it before a restart's `reconcile`) is returned as it is, at once.

        Raises:
            NotFoundError: no such sandbox, or it was deleted during the wait (404).
            WaitTimeoutError: still pending after `timeout` seconds (408).
            ValueError: `timeout` is not a number >= 0.
        """
        if not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout must be a number >= 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        record = await self._past_create(sandbox_id, deadline, take_over_abandoned=False)
        if record.status == "pending" and time.monotonic() >= deadline:  # else no create is running to wait for
            raise WaitTimeoutError(f"Sandbox {sandbox_id} not ready within {timeout}s")
        return record

    async def _ready_sandbox(self, sandbox_id: str) -> SandboxRecord:
        """The record of a ready sandbox, for an exec or a file call: a create in flight on any replica is
        waited for up to 600 s first (`wait_sandbox`); then any status but "ready" is a `ConflictError` (409)."""
        record = await self.wait_sandbox(sandbox_id, 600.0)
        if record.status != "ready":
            why = f": {record.status_message}" if record.status_message else ""
            raise ConflictError(f"Sandbox {sandbox_id} is {record.status}, not ready{why}")
        return record

    async def _past_create(self, sandbox_id: str, deadline: float, *, take_over_abandoned: bool) -> SandboxRecord:
        """The sandbox's record once it is out of "pending", or as it stands at `deadline` (`time.monotonic()`).

        A create this replica makes (or settles) is waited for on its event; a pending record of this replica's
        with no create running is returned at once, since nothing here will end it. Another replica's create is
        waited for by polling the store, from 20 ms up to every 0.5 s: only the store tells when it ends. When
        that replica's lease has ended, the record is returned at once with `take_over_abandoned` (a delete,
        which takes it over); without it, it is polled like a live one until `deadline`, since the reaper's
        `settle_creates` (on any replica) settles it.

        Raises:
            NotFoundError: no such sandbox, or it was deleted meanwhile (404).
        """
        pause = 0.02
        while True:
            record = await self.get_sandbox(sandbox_id)
            left = deadline - time.monotonic()
            if record.status != "pending" or left <= 0:
                return record
            mine = record.replica == self.replica_id
            if (mine or take_over_abandoned) and not await self._create_in_flight(record):
                return record
            if mine:  # in flight: `_create_in_flight` read the event without yielding, so it is still there
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._ready[sandbox_id].wait(), left)
                continue
            await asyncio.sleep(min(pause, left))
            pause = min(2 * pause, 0.5)

    async def heartbeat(self, sandbox_id: str) -> SandboxRecord:
        if not await self.store.touch_sandbox(sandbox_id, self.clock()):
            raise NotFoundError(f"Sandbox {sandbox_id} not found")
        return await self.get_sandbox(sandbox_id)

    async def delete_sandbox(self, sandbox_id: str, *, wait_s: float = 600.0) -> None:
        """Delete the sandbox and every process in it; queued execs then fail with "sandbox deleted".

        A create in flight finishes first, on whichever replica makes it: this replica waits for its own (or
        one it is settling), and for another live replica's polls the store (from 20 ms up to every 0.5 s)
        until the record leaves "pending". The create thus ends as it would without the delete (its client
        gets the sandbox, its Idempotency-Key is answered) and the delete follows. The delete takes the record
        over instead, without waiting more, when the creator's lease has ended (the create is abandoned, as
        `settle_creates` would find it) or after `wait_s` seconds: it is then the create's settler, so it
        forgets the create's pending Idempotency-Key (a retry creates anew), and the creator's own write is
        refused (`CreateTakenOverError`) and the creator deletes what it made after the delete.

        The "deleting" write is fenced: it expects the status and replica the delete read, so it never lands
        between a creator's (or settler's) read and write; a record changed meanwhile is read again. Once
        "deleting", no create writes it any more: the user's delete wins, whatever the create's outcome. The
        taken-over create's key is settled even when the backend delete fails: a retried delete reads
        "deleting", no longer the create.

        Raises:
            NotFoundError: no such sandbox (404).
            ValueError: `wait_s` is not a number >= 0.
        """
        if not isinstance(wait_s, (int, float)) or not wait_s >= 0:
            raise ValueError(f"wait_s must be a number >= 0, got {wait_s!r}")
        deadline = time.monotonic() + wait_s
        took_a_create = False
        while True:
            record = await self._past_create(sandbox_id, deadline, take_over_abandoned=True)
            if record.status == "deleting":
                break  # another delete's: ending the sandbox again does no harm
            read_status, read_replica = record.status, record.replica
            record.status = "deleting"
            if await self.store.put_sandbox_if(record, status=read_status, replica=read_replica):
                took_a_create = read_status == "pending"
                break
        try:
            await self._destroy(sandbox_id)
        finally:
            # also when the destroy failed: a retried delete reads "deleting", not the create it took over
            if took_a_create:
                await self._settle_create_claims(lambda claim: claim.resource_id == sandbox_id)

    async def _destroy(self, sandbox_id: str) -> None:
        with backend_errors(sandbox_id):
            try:
                await self.backend.delete(sandbox_id)
            except SandboxNotFoundError:
                pass
        await self.store.delete_sandbox(sandbox_id)
        self._locks.pop(sandbox_id, None)

    # execs
    async def submit_exec(self, sandbox_id: str, params: ExecParams, *, key: str | None = None,
                          fingerprint: str = "") -> JobRecord:
        """Queue a command; returns its job (status "queued"). With a `key` already seen, returns the job that
        key started instead of starting another."""
        timeout = params.timeout_seconds if params.timeout_seconds is not None else self.default_exec_timeout_s
        try:
            if not timeout > 0:
                raise BadRequestError(f"timeout_seconds must be > 0, got {params.timeout_seconds!r}")
            if params.max_output_bytes is not None and params.max_output_bytes < 1:
                raise BadRequestError(f"max_output_bytes must be >= 1, got {params.max_output_bytes!r}")
            if (isinstance(params.command, list) and not params.command) or params.command == "":
                raise BadRequestError("command must be a non-empty string or list")
            record = await self._ready_sandbox(sandbox_id)
            if self.max_pending_execs is not None and self.pending_execs >= self.max_pending_execs:
                raise ServiceUnavailable(f"{self.pending_execs} execs are waiting for a slot; retry later",
                                         retry_after_s=self.retry_after_s)
        except SandboxError:
            # A retry of an exec that already started gets its job, whatever became of the sandbox or the queue
            # since. A new key is found out by `create_job_idempotent` below, so the common first attempt
            # costs no extra read of the store.
            existing = await self.store.get_idempotency(key) if key is not None else None
            if existing is None:
                raise
            return await self._job_for_claim(existing, fingerprint)
        now = self.clock()
        command = params.command if isinstance(params.command, str) else shlex.join(params.command)
        job = JobRecord(job_id=str(uuid.uuid4()), sandbox_id=sandbox_id, command=command, created_at=now,
                        replica=self.replica_id)
        claim = None
        if key is not None:
            claim = IdempotencyRecord(key=key, fingerprint=fingerprint, created_at=now, resource_id=job.job_id,
                                      status_code=200, response=json.dumps({"job_id": job.job_id}))
        existing = await self.store.create_job_idempotent(job, claim, touched_at=now)
        if existing is not None:
            return await self._job_for_claim(existing, fingerprint)
        self._live_jobs[job.job_id] = job
        self._job_done[job.job_id] = asyncio.Event()
        self._active_jobs[sandbox_id] = self._active_jobs.get(sandbox_id, 0) + 1
        self.pending_execs += 1
        task = asyncio.create_task(self._run_job(job, params, float(timeout), record.created_at))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _job_for_claim(self, claim: IdempotencyRecord, fingerprint: str) -> JobRecord:
        if claim.fingerprint != fingerprint:
            raise IdempotencyKeyReuseError(
                f"Idempotency-Key {claim.key!r} was first used with a different request",
                detail={"error": "idempotency_key_reuse", "key": claim.key},
            )
        job = await self.store.get_job(claim.resource_id or "")
        if job is None:
            raise NotFoundError(f"the job of Idempotency-Key {claim.key!r} has been forgotten")
        return job

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = self._locks[sandbox_id] = asyncio.Lock()
        return lock

    async def _run_job(self, job: JobRecord, params: ExecParams, timeout: float, incarnation: float) -> None:
        waiting = True
        lock: StoreLock | None = None
        try:
            async with self._lock(job.sandbox_id), self._slots:
                self.pending_execs -= 1
                waiting = False
                async with contextlib.AsyncExitStack() as held:
                    if self.store.shared:  # one exec at a time in a sandbox across replicas, not only here
                        lock = await held.enter_async_context(
                            StoreLock(self.store, f"sandbox:{job.sandbox_id}", self.replica_lease_s,
                                      outage_s=self.store_outage_s))
                    await self._claim_and_run(job, params, timeout, incarnation, lock)
        except asyncio.CancelledError:
            raise
        except self.store.unavailable_errors:
            # Unreachable past `store_outage_s`. The store's error is no outcome of the command: a result it gave
            # is kept (and answered to this replica's waiters); one it never gave says it did not run.
            logger.exception("job %s: the store stayed unreachable for %g s", job.job_id, self.store_outage_s)
            if job.completed_at is None:
                job.status, job.completed_at = "failed", self.clock()
                job.error = STORE_OUTAGE_ERROR.format(seconds=self.store_outage_s)
        except Exception as exc:
            logger.exception("job %s failed", job.job_id)
            if job.completed_at is None:  # never written over the result the command gave
                job.status, job.error, job.completed_at = "failed", f"{type(exc).__name__}: {exc}", self.clock()
            with contextlib.suppress(*self.store.unavailable_errors):
                await self._write_job(job, lock)
        finally:
            if waiting:
                self.pending_execs -= 1
            left = self._active_jobs.get(job.sandbox_id, 1) - 1
            if left > 0:
                self._active_jobs[job.sandbox_id] = left
            else:
                self._active_jobs.pop(job.sandbox_id, None)
            self._live_jobs.pop(job.job_id, None)
            event = self._job_done.pop(job.job_id, None)
            if event is not None:
                event.set()

    async def _stored(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """`call()`, made again while the store is unreachable (`StateStore.unavailable_errors`): after 0.05 s,
        then twice as long each time up to 2 s, until `store_outage_s` has passed; then the store's error is
        raised. Only for reads and writes that, made twice, leave the store as once does: a call whose answer the
        outage lost may have taken effect (its second answer may then differ, so callers read back what
        matters)."""
        errors = self.store.unavailable_errors
        deadline, pause = None, 0.05
        while True:
            try:
                return await call()
            except errors:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.store_outage_s
                    logger.warning("%s: the store is unreachable; trying again for up to %g s", what,
                                   self.store_outage_s, exc_info=True)
                if now >= deadline:
                    raise
                await asyncio.sleep(min(pause, deadline - now))
                pause = min(2 * pause, 2.0)

    async def _claim_and_run(self, job: JobRecord, params: ExecParams, timeout: float, incarnation: float,
                             lock: StoreLock | None) -> None:
        started = self.clock()
        if not await self._claim(job, started):
            # Failed as lost while it queued (this replica stalled past its lease): running it now could run
            # a command its caller was told would never run. Waiters get what the store says.
            logger.warning("job %s was no longer queued when its turn came; not run", job.job_id)
            await self._refresh(job)
            return
        job.status, job.started_at, job.replica = "running", started, self.replica_id
        current = await self._stored(f"job {job.job_id}", lambda: self.store.get_sandbox(job.sandbox_id))
        # Deleted while the job queued (perhaps re-created under the same id): never run it there.
        if current is None or current.created_at != incarnation or current.status != "ready":
            gone = ("sandbox deleted" if current is None or current.created_at != incarnation
                    or current.status == "deleting" else f"sandbox {current.status}: {current.status_message}")
            job.status, job.error, job.started_at, job.completed_at = "failed", gone, None, self.clock()
            await self._write_job(job, lock)
            return
        self.running_execs += 1
        try:
            await self._exec_into(job, params, timeout)
        finally:
            self.running_execs -= 1
        job.completed_at = self.clock()
        await self._write_job(job, lock)

    async def _claim(self, job: JobRecord, started: float) -> bool:
        """`StateStore.claim_job`, through store outages. A claim that an outage answered may have been made
        and then refuses its own repeat: the record, running by this replica since `started`, tells."""
        what = f"claiming job {job.job_id}"
        if await self._stored(what, lambda: self.store.claim_job(job.job_id, self.replica_id, started)):
            return True
        stored = await self._stored(what, lambda: self.store.get_job(job.job_id))
        return (stored is not None and stored.status == "running" and stored.replica == self.replica_id
                and stored.started_at == started)

    async def _write_job(self, job: JobRecord, lock: StoreLock | None) -> None:
        """Store the job; under a store lock, only while its token still holds the lock (fenced). A store
        outage delays the write (`_stored`), up to `store_outage_s`."""
        what = f"recording job {job.job_id}"
        if lock is None or lock.token is None:
            await self._stored(what, lambda: self.store.put_job(job))
            return
        token = lock.token
        if await self._stored(what, lambda: self.store.put_job_fenced(job, lock.name, token)):
            return
        stored = await self._stored(what, lambda: self.store.get_job(job.job_id))
        if stored is not None and vars(stored) == vars(job):
            return  # written by a try whose answer an outage lost
        if stored is not None and stored.status == "running" and stored.replica == self.replica_id:
            # The lock's lease lapsed while this replica lived (a stall shorter than its own lease): no
            # reaper reports the job lost, so unless its result is written now it stays "running" for
            # good. It is written under the lock taken again; a loss reported meanwhile still wins.
            async with StoreLock(self.store, lock.name, self.replica_lease_s, outage_s=self.store_outage_s) as again:
                again_token = again.token
                assert again_token is not None
                if await self._stored(what, lambda: self.store.put_job_fenced(job, again.name, again_token)):
                    return
        logger.warning("job %s: result not recorded: the lease of %s ended before it was written (this "
                       "replica stalled past it?)", job.job_id, lock.name)
        await self._refresh(job)

    async def _refresh(self, job: JobRecord) -> None:
        stored = await self._stored(f"reading job {job.job_id}", lambda: self.store.get_job(job.job_id))
        if stored is not None:
            vars(job).update(vars(stored))

    async def _exec_into(self, job: JobRecord, params: ExecParams, timeout: float) -> None:
        command: str | list[str] = params.command
        if isinstance(command, str) and not params.login_shell:
            command = ["bash", "-c", command]  # Orchard Env: bash -c unless login_shell asks for bash -lc
        cap = min(params.max_output_bytes or self.max_output_bytes, self.max_output_bytes)
        request = ExecRequest(command=command, cwd=params.cwd, env=dict(params.env), timeout_s=timeout,
                              stdin=params.stdin, max_output_bytes=cap)
        try:
            with backend_errors(job.sandbox_id):
                result = await self.backend.exec(job.sandbox_id, request)
        except SandboxError as exc:
            job.status, job.error = "failed", str(exc)
            return
        job.stdout = result.stdout.decode("utf-8", errors="replace")
        job.stderr = result.stderr.decode("utf-8", errors="replace")
        job.exit_code = result.exit_code
        job.stdout_truncated, job.stderr_truncated = result.stdout_truncated, result.stderr_truncated
        job.timed_out, job.duration_s = result.timed_out, result.duration_s
        job.status = "succeeded" if result.exit_code == 0 and not result.timed_out else "failed"
        if result.timed_out:
            job.error = f"Command timed out after {timeout:g}s"

    async def get_job(self, job_id: str) -> JobRecord:
        job = await self.store.get_job(job_id)
        if job is None:
            raise NotFoundError(f"Job {job_id} not found")
        return job

    async def wait_job(self, job_id: str, timeout: float) -> JobRecord:
        """The job once it is done, or as it stands after `timeout` seconds (status "queued"/"running")."""
        # A job this process runs is read from memory, where each change is made before it is written to the
        # store: it saves two reads of the store per waited exec.
        live = self._live_jobs.get(job_id)
        job = live or await self.get_job(job_id)
        event = self._job_done.get(job_id)
        if job.status not in JOB_DONE and event is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), max(0.0, timeout))
            job = live or await self.get_job(job_id)
        elif job.status not in JOB_DONE and self.store.shared:
            # run by another replica: only the store knows when it ends
            deadline, pause = time.monotonic() + timeout, 0.02
            while job.status not in JOB_DONE and (left := deadline - time.monotonic()) > 0:
                await asyncio.sleep(min(pause, left))
                pause = min(2 * pause, 0.5)
                with contextlib.suppress(*self.store.unavailable_errors):  # an outage delays the answer
                    job = await self.get_job(job_id)
        return job

    # files, patches, resources, terminals
    async def apply_patch(self, sandbox_id: str, patch: str, timeout: float = 30.0) -> ExecResult:
        """`git apply` a unified diff in the workspace, serialised with the sandbox's execs; past `timeout`
        seconds the result is exit code 124 with `timed_out` set."""
        if not isinstance(patch, str) or not patch.strip():
            raise BadRequestError("patch must be a non-empty unified diff")
        if not timeout > 0:
            raise BadRequestError(f"timeout_seconds must be > 0, got {timeout!r}")
        await self._ready_sandbox(sandbox_id)
        async with self._lock(sandbox_id), self._slots:
            try:
                with backend_errors(sandbox_id):
                    return await asyncio.wait_for(self.backend.apply_patch(sandbox_id, patch), timeout)
            except asyncio.TimeoutError:
                return ExecResult(exit_code=124, stdout=b"", stderr=b"", timed_out=True, duration_s=timeout)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int | None = None) -> int:
        await self._ready_sandbox(sandbox_id)
        with backend_errors(sandbox_id):
            await self.backend.write_file(sandbox_id, path, data, mode)
        return len(data)

    async def extract_archive(self, sandbox_id: str, path: str, data: bytes) -> tuple[int, int]:
        await self._ready_sandbox(sandbox_id)
        with backend_errors(sandbox_id):
            return await self.backend.extract_archive(sandbox_id, path, data)

    async def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> bytes:
        await self._ready_sandbox(sandbox_id)
        with backend_errors(sandbox_id):
            return await self.backend.read_file(sandbox_id, path, max_bytes)

    async def list_files(self, sandbox_id: str, path: str, recursive: bool = False) -> list[FileInfo]:
        await self._ready_sandbox(sandbox_id)
        with backend_errors(sandbox_id):
            return await self.backend.list_files(sandbox_id, path, recursive)

    async def sandbox_resources(self, sandbox_id: str) -> Resources:
        await self._ready_sandbox(sandbox_id)
        with backend_errors(sandbox_id):
            return await self.backend.resources(sandbox_id)

    async def open_pty(self, sandbox_id: str, command: str | None, cols: int, rows: int) -> PtySession:
        await self._ready_sandbox(sandbox_id)
        await self.store.touch_sandbox(sandbox_id, self.clock())
        with backend_errors(sandbox_id):
            return await self.backend.open_pty(sandbox_id, command, cols=cols, rows=rows)

    async def summary(self) -> dict[str, Any]:
        """What `/resources` reports: the service's own load, not a cluster's."""
        sandboxes = await self.store.list_sandboxes()
        return {
            "status": "ok",
            "backend": self.namespace,
            "sandboxes": len(sandboxes),
            "sandboxes_ready": sum(s.status == "ready" for s in sandboxes),
            "max_concurrent_execs": self.max_concurrent_execs,
            "running_execs": self.running_execs,
            "queued_execs": self.pending_execs,
            "max_pending_execs": self.max_pending_execs,
            "unknown_sandboxes_kept": len(self.unknown_sandboxes_kept),
            "snapshots": len(await self.store.list_snapshots()),
            "max_snapshots": self.max_snapshots,
            "max_forks": self.max_forks,
        }
