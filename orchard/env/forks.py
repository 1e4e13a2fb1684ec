"""Snapshots and forks of sandboxes: the orchestrator's side (the REST routes are `orchard.env.fork_routes`).

A snapshot is a copy of a sandbox's workspace, kept by the backend (`SnapshotBackend`) under an id, with the
sandbox's spec in the state store. Running processes are not carried: a fork starts with the files and no process,
as a created sandbox does. A fork is a new sandbox whose workspace starts as a copy of a snapshot's or of a live
sandbox's (one copy, no snapshot kept); it inherits its source's image, network, limits and environment. Forks
are isolated from each other and from their source, and neither a snapshot nor a fork depends on its source
living on: deleting a sandbox leaves its snapshots and forks as they were.

Consistency. A snapshot, or a fork of a live sandbox, copies the workspace while no command runs in it: it is
refused with 409 `sandbox_busy` while one of the sandbox's execs is queued or running (on any replica), and the
copy holds the sandbox's exec lock, so an exec or `apply_patch` that arrives meanwhile waits for the copy to end.
(A command leaves no process behind, see `orchard.env.agent.process`; an open terminal, a file upload or an
archive unpack racing the copy is not serialised with it.)

Quotas (`Orchestrator(max_snapshots=..., max_forks=...)`): a snapshot or fork beyond them is refused with 403
`quota_exceeded`. The snapshot bound is atomic in the store (`StateStore.insert_snapshot`); the fork bound is
counted on the records just before the fork's record is inserted, with no wait in between on one replica, so
several replicas forking at the same instant may overshoot it by one each.

Errors carry `detail.error`: `sandbox_not_found` (404: no such sandbox, e.g. deleted), `snapshot_not_found`
(404), `sandbox_not_ready` (409: pending, failed or being deleted), `sandbox_busy` (409: a command is running),
`snapshot_not_ready` (409: still being taken), `snapshot_busy` (409: a fork is copying it), `snapshot_exists`
(409), `quota_exceeded` (403), `snapshots_unsupported` (501: the backend cannot copy workspaces).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from orchard.env.backends.base import (
    SandboxNotFoundError,
    SandboxSpec,
    SnapshotBackend,
    SnapshotNotFoundError,
)
from orchard.env.errors import (
    BackendRefusedError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    SandboxError,
    ServerError,
)
from orchard.env.locks import StoreLock
from orchard.env.orchestrator import SANDBOX_ID_RE, CreateParams, Orchestrator, backend_errors
from orchard.env.store.base import SandboxRecord, SnapshotRecord

logger = logging.getLogger(__name__)

__all__ = ["ForkParams", "Forks"]


def _refusal(cls: type[SandboxError], code: str, message: str, **kwargs: object) -> SandboxError:
    return cls(message, detail={"error": code, "message": message}, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ForkParams:
    """A fork request: the new sandbox's own settings (the rest is its source's)."""

    sandbox_id: str | None = None
    timeout: int | None = None
    ttl_seconds: float | None = None
    heartbeat_timeout: float | None = None


class Forks:
    """Snapshots and forks over an `Orchestrator` and its backend (which must be a `SnapshotBackend`)."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        if not isinstance(orchestrator, Orchestrator):
            raise ValueError(f"orchestrator must be an Orchestrator, got {type(orchestrator).__name__}")
        self.orch = orchestrator
        self._restoring: dict[str, int] = {}
        """Forks copying each snapshot now, on this replica: its delete waits for none, it is refused."""

    @property
    def supported(self) -> bool:
        return isinstance(self.orch.backend, SnapshotBackend)

    def _backend(self) -> SnapshotBackend:
        backend = self.orch.backend
        if not isinstance(backend, SnapshotBackend):
            raise _refusal(ServerError, "snapshots_unsupported", f"the {self.orch.namespace} backend cannot "
                           "snapshot or fork sandboxes", status_code=501)
        return backend

    # reading
    async def get_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        record = await self.orch.store.get_snapshot(snapshot_id)
        if record is None:
            raise _refusal(NotFoundError, "snapshot_not_found", f"Snapshot {snapshot_id} not found")
        return record

    async def list_snapshots(self) -> list[SnapshotRecord]:
        return await self.orch.store.list_snapshots()

    # taking and deleting
    async def snapshot(self, sandbox_id: str, snapshot_id: str | None = None) -> SnapshotRecord:
        """Copy the workspace of the ready sandbox `sandbox_id` into a new snapshot (id `snapshot_id`, or a
        fresh one); returns its record, "ready". See the module's docstring for the errors."""
        backend = self._backend()
        snapshot_id = snapshot_id or uuid.uuid4().hex[:12]
        if not isinstance(snapshot_id, str) or not SANDBOX_ID_RE.match(snapshot_id):
            raise BadRequestError(f"snapshot_id must match {SANDBOX_ID_RE.pattern}, got {snapshot_id!r}")
        source = await self._source(sandbox_id)
        record = SnapshotRecord(snapshot_id=snapshot_id, sandbox_id=sandbox_id, image=source.image,
                                block_network=source.block_network, cpu=source.cpu, memory=source.memory,
                                env=dict(source.env), status="pending", created_at=self.orch.clock(),
                                replica=self.orch.replica_id)
        async with self._quiet(sandbox_id):
            outcome = await self.orch.store.insert_snapshot(record, limit=self.orch.max_snapshots)
            if outcome == "exists":
                raise _refusal(ConflictError, "snapshot_exists", f"Snapshot {snapshot_id} already exists")
            if outcome == "full":
                raise _refusal(BackendRefusedError, "quota_exceeded", f"{self.orch.max_snapshots} snapshots "
                               "exist (max_snapshots); delete one first")
            try:
                with self._errors(sandbox_id):
                    await backend.snapshot(sandbox_id, snapshot_id)
            except BaseException:
                with contextlib.suppress(Exception):
                    await backend.delete_snapshot(snapshot_id)
                await self.orch.store.delete_snapshot(snapshot_id)
                raise
        record.status = "ready"
        await self.orch.store.put_snapshot(record)
        return record

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove the snapshot; forks made from it stay as they are. 409 while it is being taken or a fork is
        copying it."""
        backend = self._backend()
        record = await self.get_snapshot(snapshot_id)
        if self._restoring.get(snapshot_id):
            raise _refusal(ConflictError, "snapshot_busy", f"Snapshot {snapshot_id} is being copied into a fork; "
                           "delete it once the fork is made")
        if record.status == "pending":
            raise _refusal(ConflictError, "snapshot_not_ready", f"Snapshot {snapshot_id} is still being taken")
        record.status = "deleting"
        await self.orch.store.put_snapshot(record)
        with self._errors(record.sandbox_id):
            await backend.delete_snapshot(snapshot_id)
        await self.orch.store.delete_snapshot(snapshot_id)

    # forking
    async def fork(self, params: ForkParams, *, parent_id: str | None = None,
                   snapshot_id: str | None = None) -> SandboxRecord:
        """A new sandbox whose workspace is a copy of the live sandbox `parent_id`'s or of the snapshot's
        (exactly one), with its source's spec and `params`' own settings; returns its record, "ready"."""
        backend = self._backend()
        if (parent_id is None) == (snapshot_id is None):
            raise ValueError("fork needs exactly one of parent_id and snapshot_id")
        if parent_id is not None:
            source: SandboxRecord | SnapshotRecord = await self._source(parent_id)
        else:
            source = await self.get_snapshot(snapshot_id)  # type: ignore[arg-type]
            if source.status != "ready":
                raise _refusal(ConflictError, "snapshot_not_ready", f"Snapshot {snapshot_id} is {source.status}")
        create = CreateParams(image=source.image, block_network=source.block_network, sandbox_id=params.sandbox_id,
                              cpu=source.cpu, memory=source.memory, timeout=params.timeout,
                              ttl_seconds=params.ttl_seconds, heartbeat_timeout=params.heartbeat_timeout,
                              env=dict(source.env))

        async def make(sandbox_id: str, spec: SandboxSpec) -> None:
            with self._errors(parent_id, snapshot_id):
                await backend.fork(sandbox_id, spec, parent_id=parent_id, snapshot_id=snapshot_id)

        if parent_id is not None:
            async with self._quiet(parent_id):
                await self._check_fork_quota()
                return await self.orch.create_sandbox(create, make=make, forked_from=f"sandbox:{parent_id}")
        assert snapshot_id is not None
        self._restoring[snapshot_id] = self._restoring.get(snapshot_id, 0) + 1
        try:
            await self._check_fork_quota()
            return await self.orch.create_sandbox(create, make=make, forked_from=f"snapshot:{snapshot_id}")
        finally:
            left = self._restoring[snapshot_id] - 1
            if left:
                self._restoring[snapshot_id] = left
            else:
                del self._restoring[snapshot_id]

    async def _check_fork_quota(self) -> None:
        # no wait between this count and the insert of create_sandbox on one replica (see the module's docstring)
        bound = self.orch.max_forks
        if bound is None:
            return
        held = sum(r.forked_from is not None for r in await self.orch.store.list_sandboxes())
        if held >= bound:
            raise _refusal(BackendRefusedError, "quota_exceeded", f"{bound} forked sandboxes exist (max_forks); "
                           "delete one first")

    # helpers
    async def _source(self, sandbox_id: str) -> SandboxRecord:
        """The record of the ready sandbox a snapshot or fork copies (a create in flight is waited for)."""
        try:
            return await self.orch._ready_sandbox(sandbox_id)
        except NotFoundError:
            raise _refusal(NotFoundError, "sandbox_not_found", f"Sandbox {sandbox_id} not found (deleted, or "
                           "never made): nothing to copy") from None
        except ConflictError as exc:
            raise _refusal(ConflictError, "sandbox_not_ready", str(exc)) from None

    @contextlib.asynccontextmanager
    async def _quiet(self, sandbox_id: str) -> AsyncIterator[None]:
        """Hold the sandbox's exec lock (and, with a shared store, its store lock) for a copy; 409
        `sandbox_busy` when one of its commands is queued or running instead of waiting for it."""
        lock = self.orch._lock(sandbox_id)
        if lock.locked() or self.orch._active_jobs.get(sandbox_id, 0):
            raise self._busy(sandbox_id)
        async with lock, contextlib.AsyncExitStack() as held:
            if self.orch.store.shared:
                jobs = await self.orch.store.list_jobs(("queued", "running"))
                if any(job.sandbox_id == sandbox_id for job in jobs):
                    raise self._busy(sandbox_id)
                await held.enter_async_context(
                    StoreLock(self.orch.store, f"sandbox:{sandbox_id}", self.orch.replica_lease_s))
            yield

    @staticmethod
    def _busy(sandbox_id: str) -> SandboxError:
        return _refusal(ConflictError, "sandbox_busy", f"Sandbox {sandbox_id} is running a command: its workspace "
                        "may be changing. Snapshot or fork it once its commands have ended")

    @contextlib.contextmanager
    def _errors(self, sandbox_id: str | None, snapshot_id: str | None = None) -> Iterator[None]:
        """A backend's errors as API errors, naming the source the copy was of."""
        with backend_errors(sandbox_id or ""):
            try:
                yield
            except SnapshotNotFoundError:
                raise _refusal(NotFoundError, "snapshot_not_found", f"Snapshot {snapshot_id} not found") from None
            except SandboxNotFoundError:
                raise _refusal(NotFoundError, "sandbox_not_found", f"Sandbox {sandbox_id} not found") from None

    async def reconcile(self) -> dict[str, list[str]]:
        """Make the store's snapshots agree with the backend's after a restart: records of snapshots the backend
        lacks, of deletes that did not finish, and of snapshots being taken by a replica that is gone are dropped
        (with what the backend holds of them); snapshots the backend holds and no record names are deleted, unless
        the store holds no sandbox and no snapshot at all (a store that lost its data, as `Orchestrator.reconcile`
        treats sandboxes). Returns what it did."""
        report: dict[str, list[str]] = {"kept": [], "dropped": [], "orphans_deleted": []}
        if not self.supported:
            return report
        backend = self._backend()
        live = set(await backend.list_snapshot_ids())
        records = await self.orch.store.list_snapshots()
        for record in records:
            if record.status == "ready" and record.snapshot_id in live:
                report["kept"].append(record.snapshot_id)
                continue
            if (record.status == "pending" and record.replica not in (None, self.orch.replica_id)
                    and await self.orch.store.replica_alive(record.replica)):  # type: ignore[arg-type]
                report["kept"].append(record.snapshot_id)  # another live replica is taking it
                continue
            with contextlib.suppress(Exception):
                await backend.delete_snapshot(record.snapshot_id)
            await self.orch.store.delete_snapshot(record.snapshot_id)
            report["dropped"].append(record.snapshot_id)
        unknown = sorted(live - {r.snapshot_id for r in records})
        store_has_data = bool(records) or bool(await self.orch.store.list_sandboxes())
        if unknown and (store_has_data or self.orch.allow_empty_store_sweep):
            for snapshot_id in unknown:
                with contextlib.suppress(Exception):
                    await backend.delete_snapshot(snapshot_id)
                report["orphans_deleted"].append(snapshot_id)
        elif unknown:
            logger.error("the state store holds no record, yet the backend holds %d snapshots: kept them (see "
                         "allow_empty_store_sweep)", len(unknown))
        return report
