"""The orchestrator without HTTP: the reaper on a fake clock, the concurrency cap, idempotent submits, the
SQLite store, quantity parsing. The backend is the real LocalBackend."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import sqlite3
import tempfile
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.env.backends.base import BackendError
from orchard.env.backends.local import LocalBackend
from orchard.env.errors import (
    BadRequestError,
    ConflictError,
    IdempotencyKeyReuseError,
    NotFoundError,
    ServerError,
    WaitTimeoutError,
)
from orchard.env.orchestrator import (
    LOST_WHILE_DOWN,
    CreateParams,
    CreateTakenOverError,
    ExecParams,
    Orchestrator,
    parse_cpu,
    parse_memory_mb,
)
from orchard.env.server import job_view
from orchard.env.store import IdempotencyRecord, JobRecord, SandboxRecord, SQLiteStore
from orchard.env.store.sqlite import DELETE_OLD_JOBS, DELETE_OLD_KEYS


class Clock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="orchard-env-orch-")
    os.chmod(path, 0o711)  # sandbox uids walk through it to their workspaces
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def orch(root):
    clock = Clock()
    o = Orchestrator(LocalBackend(f"{root}/sandboxes"), SQLiteStore(f"{root}/state.sqlite3"), clock=clock,
                     heartbeat_timeout_s=5.0, max_concurrent_execs=2)
    o.test_clock = clock
    await o.start(reaper=False)
    yield o
    for record in await o.store.list_sandboxes():
        await o.backend.delete(record.sandbox_id)
    await o.close()


@pytest.mark.parametrize(("text", "cores"), [("2", 2.0), ("500m", 0.5), ("1.5", 1.5), ("2000m", 2.0), (None, None)])
def test_parse_cpu(text, cores):
    assert parse_cpu(text) == cores


@pytest.mark.parametrize(("text", "mib"), [
    ("16Gi", 16 * 1024),          # 16 * 2**30 / 2**20
    ("512Mi", 512),
    ("1G", 954),                  # 10**9 / 2**20 = 953.67 -> rounded up
    ("1536Ki", 2),                # 1.5 MiB -> 2
    ("1048576", 1),               # bytes
    (None, None),
])
def test_parse_memory_mb(text, mib):
    assert parse_memory_mb(text) == mib


@pytest.mark.parametrize("bad", ["", "x", "-1", "0"])
def test_parse_rejects(bad):
    if bad == "":
        assert parse_cpu(bad) is None and parse_memory_mb(bad) is None
        return
    with pytest.raises(BadRequestError):
        parse_cpu(bad)
    with pytest.raises(BadRequestError):
        parse_memory_mb(bad + "Mi")


def test_constructor_validates():
    with pytest.raises(ValueError, match="max_concurrent_execs"):
        Orchestrator(object(), SQLiteStore(":memory:"), max_concurrent_execs=0)
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        Orchestrator(object(), SQLiteStore(":memory:"), heartbeat_timeout_s=-1)


async def test_reaper_ttl_idle_and_running_jobs(orch):
    clock = orch.test_clock
    await orch.create_sandbox(CreateParams(sandbox_id="ttl", ttl_seconds=10, heartbeat_timeout=100))
    await orch.create_sandbox(CreateParams(sandbox_id="idle"))            # heartbeat timeout 5 (server default)
    await orch.create_sandbox(CreateParams(sandbox_id="beating"))
    await orch.create_sandbox(CreateParams(sandbox_id="busy"))
    clock.now += 4
    await orch.heartbeat("beating")                                        # last beat at 1004
    job = await orch.submit_exec("busy", ExecParams(command="sleep 1"))    # activity at 1004, job runs ~1 s
    clock.now += 2                                                         # 1006: idle silent for 6 s > 5
    assert await orch.reap_once() == ["idle"]
    clock.now += 4.5                                                       # 1010.5: ttl (1010) passed
    reaped = await orch.reap_once()
    assert "ttl" in reaped and "beating" in reaped                         # beating: silent 6.5 s
    assert "busy" not in reaped                                            # silent too, but a job runs
    assert (await orch.wait_job(job.job_id, 30)).status == "succeeded"
    assert await orch.reap_once() == ["busy"]                              # idle once the job ended
    assert await orch.store.list_sandboxes() == []
    assert await orch.backend.list_ids() == []


async def test_concurrency_cap_is_reached_and_never_passed(orch):
    for i in range(4):
        await orch.create_sandbox(CreateParams(sandbox_id=f"s{i}"))
    start = time.monotonic()
    jobs = [await orch.submit_exec(f"s{i % 4}", ExecParams(command="sleep 0.2")) for i in range(8)]
    peak = 0

    async def all_done() -> bool:
        statuses = [(await orch.get_job(j.job_id)).status for j in jobs]
        return all(s in ("succeeded", "failed") for s in statuses)

    while not await all_done():
        peak = max(peak, orch.running_execs)
        assert orch.running_execs <= 2
        await asyncio.sleep(0.01)
    assert peak == 2
    # 8 jobs of 0.2 s, at most 2 at a time: at least 4 rounds, 0.8 s
    assert time.monotonic() - start >= 0.8
    assert [(await orch.get_job(j.job_id)).status for j in jobs] == ["succeeded"] * 8


async def test_concurrent_submits_with_one_key_start_one_job(orch):
    await orch.create_sandbox(CreateParams(sandbox_id="idem"))
    params = ExecParams(command="echo x >> ran.txt")
    jobs = await asyncio.gather(*(orch.submit_exec("idem", params, key="k1", fingerprint="f") for _ in range(5)))
    assert len({j.job_id for j in jobs}) == 1
    await orch.wait_job(jobs[0].job_id, 30)
    assert await orch.read_file("idem", "ran.txt") == b"x\n"
    with pytest.raises(IdempotencyKeyReuseError):
        await orch.submit_exec("idem", params, key="k1", fingerprint="other")
    await orch.delete_sandbox("idem")
    # a retry after the sandbox is gone still gets its job; a new request gets the 404
    assert (await orch.submit_exec("idem", params, key="k1", fingerprint="f")).job_id == jobs[0].job_id
    with pytest.raises(IdempotencyKeyReuseError):
        await orch.submit_exec("idem", params, key="k1", fingerprint="other")
    with pytest.raises(NotFoundError):
        await orch.submit_exec("idem", params, key="k2", fingerprint="f")
    with pytest.raises(BadRequestError):  # invalid, and no job of its own: refused as before
        await orch.submit_exec("idem", ExecParams(command=""), key="k3", fingerprint="f")


async def test_idempotent_replays_client_errors_but_not_server_errors(orch):
    calls = []

    async def conflict():
        calls.append(1)
        raise ConflictError("taken")

    assert await orch.idempotent("a", "f", conflict) == (409, {"detail": "taken"})
    assert await orch.idempotent("a", "f", conflict) == (409, {"detail": "taken"})
    assert len(calls) == 1

    async def crash():
        calls.append(2)
        raise RuntimeError("boom")

    for _ in range(2):  # not remembered: each retry runs again
        with pytest.raises(RuntimeError):
            await orch.idempotent("b", "f", crash)
    assert calls == [1, 2, 2]


async def test_sqlite_store_survives_reopen_and_claims_atomically(root):
    path = f"{root}/s.sqlite3"
    store = SQLiteStore(path)
    await store.put_sandbox(SandboxRecord(sandbox_id="a", image="host", env={"K": "v"}, created_at=1.0))
    claim = IdempotencyRecord(key="k", fingerprint="f", created_at=2.0, resource_id="j1", status_code=200,
                              response="{}")
    assert await store.create_job_idempotent(JobRecord(job_id="j1", sandbox_id="a", command="c"), claim) is None
    dup = IdempotencyRecord(key="k", fingerprint="f", created_at=3.0, resource_id="j2")
    assert (await store.create_job_idempotent(JobRecord(job_id="j2", sandbox_id="a", command="c"), dup)
            ).resource_id == "j1"
    assert await store.get_job("j2") is None  # the losing job was never written
    third = JobRecord(job_id="j3", sandbox_id="a", command="c")
    assert await store.create_job_idempotent(third, dup, touched_at=9.0) is not None  # key taken: no touch
    assert (await store.get_sandbox("a")).last_heartbeat == 0.0 and await store.get_job("j3") is None
    assert await store.create_job_idempotent(third, None, touched_at=9.0) is None  # written with the touch
    assert (await store.get_sandbox("a")).last_heartbeat == 9.0 and (await store.get_job("j3")).command == "c"
    for query in (DELETE_OLD_JOBS, DELETE_OLD_KEYS):  # what the reaper runs every few seconds
        (*_, plan), = store._db.execute("EXPLAIN QUERY PLAN " + query, (1.0,)).fetchall()
        assert "USING INDEX" in plan, plan  # reads the rows it deletes, not every row kept
    rival = sqlite3.connect(path, timeout=0.1)  # one orchestrator owns the file while it has it open
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        rival.execute("SELECT count(*) FROM jobs").fetchone()
    rival.close()
    assert await store.insert_sandbox(SandboxRecord(sandbox_id="a", image="other")) is False
    await store.close()
    reopened = SQLiteStore(path)
    assert (await reopened.get_sandbox("a")).env == {"K": "v"}
    assert (await reopened.get_job("j1")).command == "c"
    assert (await reopened.claim_idempotency(dup)).resource_id == "j1"
    assert await reopened.delete_idempotency_before(2.5) == 1
    await reopened.close()
    with pytest.raises(ValueError, match="path"):
        SQLiteStore("")


async def test_queued_exec_of_a_deleted_sandbox_never_runs_in_its_successor(orch):
    await orch.create_sandbox(CreateParams(sandbox_id="x"))
    # The first runs until the delete ends it (a short sleep could finish first on a loaded machine).
    first = await orch.submit_exec("x", ExecParams(command="sleep 30"))
    second = await orch.submit_exec("x", ExecParams(command="touch ran"))  # queued behind the first
    for _ in range(1000):  # bounded: until the first has started
        if (await orch.get_job(first.job_id)).status == "running":
            break
        await asyncio.sleep(0.01)
    await orch.delete_sandbox("x")
    orch.test_clock.now += 1
    await orch.create_sandbox(CreateParams(sandbox_id="x"))  # a new sandbox under the same id
    assert (await orch.wait_job(first.job_id, 30)).status == "failed"
    job = await orch.wait_job(second.job_id, 30)
    assert job.status == "failed" and job.error == "sandbox deleted"
    assert [f.path for f in await orch.list_files("x", ".")] == []


async def test_a_pending_record_of_this_replica_with_no_create_running_is_answered_at_once(orch):
    # Left "pending" by a create of this replica's that no longer runs (a store write that failed): nothing on
    # this replica will end it and no other replica settles it, so waiting would only run out the timeout. The
    # wait answers it as it stands, an exec is refused (409), and a delete takes it over, all without waiting.
    now = orch.test_clock()
    await orch.store.insert_sandbox(SandboxRecord(sandbox_id="stuck", image="host", status="pending",
                                                  created_at=now, last_heartbeat=now, replica=orch.replica_id))
    assert (await asyncio.wait_for(orch.wait_sandbox("stuck", 600), 10)).status == "pending"
    with pytest.raises(ConflictError, match="pending, not ready"):
        await asyncio.wait_for(orch.submit_exec("stuck", ExecParams(command="true")), 10)
    await asyncio.wait_for(orch.delete_sandbox("stuck"), 10)
    with pytest.raises(NotFoundError):
        await orch.get_sandbox("stuck")
    with pytest.raises(ValueError, match="timeout"):
        await orch.wait_sandbox("stuck", -1)


class _HeldBackend(LocalBackend):
    """The real LocalBackend whose first `held` creates each wait for their own `release` event (a create
    stalled in the backend), and whose first `failing_deletes` deletes raise (the cluster API down a moment)."""

    def __init__(self, root: str, *, held: int = 0, failing_deletes: int = 0) -> None:
        super().__init__(root)
        self.entered = [asyncio.Event() for _ in range(held)]
        self.release = [asyncio.Event() for _ in range(held)]
        self.creates, self.failing_deletes = 0, failing_deletes

    async def create(self, sandbox_id, spec) -> None:
        n, self.creates = self.creates, self.creates + 1
        if n < len(self.release):
            self.entered[n].set()
            await self.release[n].wait()
        await super().create(sandbox_id, spec)

    async def delete(self, sandbox_id) -> None:
        if self.failing_deletes:
            self.failing_deletes -= 1
            raise BackendError("the backend did not answer")
        await super().delete(sandbox_id)


class _ReadyWriteFailsOnce(SQLiteStore):
    """A store whose first write of a "ready" sandbox record raises (a store blip after the backend made it)."""

    failed = False

    async def put_sandbox_if(self, record, *, status, replica) -> bool:
        if record.status == "ready" and not self.failed:
            self.failed = True
            raise sqlite3.OperationalError("disk I/O error")
        return await super().put_sandbox_if(record, status=status, replica=replica)


@contextlib.asynccontextmanager
async def _orchestrator(backend: LocalBackend, store: SQLiteStore, clock: Clock | None = None):
    o = Orchestrator(backend, store, clock=clock or Clock())
    await o.start(reaper=False)
    try:
        yield o
    finally:
        for sandbox_id in await backend.list_ids():
            await LocalBackend.delete(backend, sandbox_id)
        await o.close()


async def test_a_pending_record_whose_create_no_longer_runs_is_reaped_with_its_sandbox(root):
    # The backend made "s", then the write of "ready" failed: the create ended (500) with its record pending
    # and this replica's, and no settler runs on a store of one replica. Before the fix the reaper skipped
    # every pending record, so "s" lived on past its TTL: reap_once() == [] with the sandbox alive.
    clock = Clock()  # 1000.0
    async with _orchestrator(LocalBackend(f"{root}/sandboxes"), _ReadyWriteFailsOnce(f"{root}/state.sqlite3"),
                             clock) as orch:
        with pytest.raises(sqlite3.OperationalError):
            await orch.create_sandbox(CreateParams(sandbox_id="s", ttl_seconds=10, heartbeat_timeout=100))
        assert (await orch.get_sandbox("s")).status == "pending" and await orch.backend.exists("s")
        clock.now += 9                                      # 1009 < 1000 + 10: not due yet
        assert await orch.reap_once() == []
        clock.now += 1                                      # 1010: the TTL is up (idle only at 1100)
        assert await orch.reap_once() == ["s"]
        assert await orch.store.list_sandboxes() == [] and await orch.backend.list_ids() == []


async def test_a_delete_whose_destroy_fails_still_settles_the_create_it_took_over(root):
    # The delete takes over a create still held in the backend (wait_s=0), then the backend delete fails.
    # Before the fix the create's pending Idempotency-Key was settled only after a destroy that succeeded, and
    # a retried DELETE reads "deleting", not a create: the key stayed pending for its 24 h.
    backend = _HeldBackend(f"{root}/sandboxes", held=1, failing_deletes=1)
    async with _orchestrator(backend, SQLiteStore(f"{root}/state.sqlite3")) as orch:
        async def create() -> tuple[int, dict]:
            return 200, {"status": (await orch.create_sandbox(CreateParams(sandbox_id="s"))).status}

        creating = asyncio.create_task(orch.idempotent("key", "fingerprint", create, resource_id="s"))
        await backend.entered[0].wait()
        with pytest.raises(ServerError, match="did not answer"):
            await orch.delete_sandbox("s", wait_s=0)
        assert await orch.store.get_idempotency("key") is None  # forgotten: a retry creates anew
        backend.release[0].set()
        with pytest.raises(CreateTakenOverError, match="it is deleting"):
            await creating  # and the creator deleted the sandbox it made after the delete
        await orch.delete_sandbox("s")  # the client's retry
        assert await orch.store.list_sandboxes() == [] and await backend.list_ids() == []


async def test_a_create_taken_over_by_a_delete_leaves_a_new_create_of_its_id_alone(root):
    # A delete takes over the first create of "s" (held in the backend, wait_s=0) and a second create of "s"
    # starts on the same replica while the first is still held. The first ends first: its record is gone,
    # and the pending record it finds is the second's, which the store's fence (pending, this replica) cannot
    # tell from its own. Before the fix the first wrote "ready" over the second's record and took the second's
    # entry in the replica's table of creates in flight, so the second's own end raised KeyError (a 500).
    backend = _HeldBackend(f"{root}/sandboxes", held=2)
    async with _orchestrator(backend, SQLiteStore(f"{root}/state.sqlite3")) as orch:
        first = asyncio.create_task(orch.create_sandbox(CreateParams(sandbox_id="s")))
        await backend.entered[0].wait()
        await orch.delete_sandbox("s", wait_s=0)
        second = asyncio.create_task(orch.create_sandbox(CreateParams(sandbox_id="s", env={"RUN": "2"})))
        await backend.entered[1].wait()
        backend.release[0].set()
        with pytest.raises(CreateTakenOverError, match="it is pending"):
            await first
        assert (await orch.get_sandbox("s")).status == "pending"  # the second's, still being made
        backend.release[1].set()
        assert (await second).status == "ready"
        record = await orch.get_sandbox("s")
        assert record.status == "ready" and record.env == {"RUN": "2"} and await backend.exists("s")


async def test_waits_end_at_their_timeout_on_python_310(root, python_310_timeouts):
    # Before the fix both waits caught the builtin TimeoutError, which 3.10's wait_for does not raise: the
    # wait for a create was a 500, not a 408, and a wait for a running job raised instead of showing it.
    backend = _HeldBackend(f"{root}/sandboxes", held=1)
    async with _orchestrator(backend, SQLiteStore(f"{root}/state.sqlite3")) as orch:
        creating = asyncio.create_task(orch.create_sandbox(CreateParams(sandbox_id="s")))
        await backend.entered[0].wait()
        with pytest.raises(WaitTimeoutError, match=r"not ready within 0\.05s"):
            await orch.wait_sandbox("s", 0.05)  # this replica's own create, waited for on its event
        backend.release[0].set()
        assert (await creating).status == "ready"
        job = await orch.submit_exec("s", ExecParams(command="sleep 1"))
        assert (await orch.wait_job(job.job_id, 0.05)).status in ("queued", "running")  # 0.05 s < 1 s
        assert (await orch.wait_job(job.job_id, 30)).status == "succeeded"


class SlowCreateBackend(LocalBackend):
    """The real LocalBackend whose create takes a second, so that a sandbox is visibly "pending"."""

    async def create(self, sandbox_id, spec):
        await asyncio.sleep(1.0)
        await super().create(sandbox_id, spec)


def slow_create_backend(root):
    return SlowCreateBackend(root)


def test_wait_times_out_with_408_while_pending_then_succeeds():
    import threading

    import httpx

    from orchard.env.embedded import serve

    with serve(backend=f"{__name__}:slow_create_backend") as (url, key):
        h = {"X-API-Key": key}
        created = []
        creator = threading.Thread(target=lambda: created.append(
            httpx.post(f"{url}/sandboxes", json={"sandbox_id": "slow"}, headers=h, timeout=30)))
        creator.start()
        while httpx.get(f"{url}/sandboxes/slow", headers=h).status_code == 404:
            time.sleep(0.01)
        pending = httpx.get(f"{url}/sandboxes/slow", headers=h).json()
        assert pending["status"] == "pending" and pending["ready"] is False
        assert httpx.get(f"{url}/sandboxes/slow/wait", params={"timeout": 0.05}, headers=h).status_code == 408
        ready = httpx.get(f"{url}/sandboxes/slow/wait", params={"timeout": 10}, headers=h, timeout=30)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        creator.join()
        assert created[0].status_code == 200
        assert httpx.delete(f"{url}/sandboxes/slow", headers=h).status_code == 200


def test_job_view_is_a_detached_copy_of_every_field():
    job = JobRecord(job_id="j", sandbox_id="s", command="echo hi", status="succeeded", stdout="hi\n",
                    exit_code=0, duration_s=0.5, stderr_truncated=True)  # fmt: skip
    view = job_view(job)
    assert view == dataclasses.asdict(job)
    view["stdout"] = "changed"
    assert job.stdout == "hi\n"
    # no field holds a container, which is what makes the shallow copy equal to asdict's deep one
    types = [str(f.type) for f in dataclasses.fields(JobRecord)]
    assert not [t for t in types if any(c in t for c in ("dict", "list", "set", "tuple", "Record"))], types


async def test_sqlite_store_opens_a_file_of_the_earlier_schema(root):
    path = f"{root}/old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE sandboxes (sandbox_id TEXT PRIMARY KEY, data TEXT NOT NULL);
        CREATE TABLE jobs (job_id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, status TEXT NOT NULL,
                           completed_at REAL, data TEXT NOT NULL);
        CREATE INDEX jobs_status ON jobs (status);
        CREATE TABLE idempotency (key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, created_at REAL NOT NULL,
                                  resource_id TEXT, status_code INTEGER, response TEXT);
    """)
    old.execute("INSERT INTO jobs VALUES ('j', 's', 'running', NULL, ?)",
                ('{"job_id": "j", "sandbox_id": "s", "command": "c", "status": "running"}',))
    old.commit()
    old.close()
    store = SQLiteStore(path)
    indexes = {row[0] for row in store._db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
               if not row[0].startswith("sqlite_autoindex")}
    assert indexes == {"jobs_completed", "idempotency_created"}
    assert [j.job_id for j in await store.list_jobs(("queued", "running"))] == ["j"]
    await store.close()


_STORE_OPS = st.lists(st.tuples(st.sampled_from(["put", "insert", "delete", "touch", "job", "job-key"]),
                                st.sampled_from(["a", "b", "c"]), st.integers(0, 9)), max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops=_STORE_OPS)
def test_sqlite_store_reads_match_its_file_after_any_writes(ops):
    """The store answers sandbox reads from memory: after any sequence of writes they equal the file's rows,
    and a record a caller got (and changed) is a copy."""

    async def run() -> None:
        store = SQLiteStore(":memory:")
        for n, (op, sid, value) in enumerate(ops):
            record = SandboxRecord(sandbox_id=sid, image=f"img{value}", env={"V": str(value)}, created_at=value)
            if op == "put":
                await store.put_sandbox(record)
            elif op == "insert":
                await store.insert_sandbox(record)
            elif op == "delete":
                await store.delete_sandbox(sid)
            elif op == "touch":
                await store.touch_sandbox(sid, float(value))
            else:  # a job with the sandbox's touch, committed or (a key already taken) rolled back
                claim = IdempotencyRecord(key=f"k{value}", fingerprint="f", created_at=0.0) if op == "job-key" else None
                job = JobRecord(job_id=f"j{n}", sandbox_id=sid, command="c")
                await store.create_job_idempotent(job, claim, touched_at=100.0 + value)
            rows = {r.sandbox_id: r for r in (SandboxRecord(**json.loads(data)) for data, in
                                              store._db.execute("SELECT data FROM sandboxes"))}
            assert await store.list_sandboxes() == [rows[k] for k in sorted(rows)]
            for key in "abc":
                assert await store.get_sandbox(key) == rows.get(key)
            got = await store.get_sandbox(sid)
            if got is not None:
                got.env["V"], got.status = "changed", "changed"
                assert await store.get_sandbox(sid) == rows[sid]  # the caller's copy, not the store's
        await store.close()

    asyncio.run(run())


async def test_a_ready_sandbox_gone_while_no_replica_ran_fails_with_the_reason(root):
    # "gone" is removed from the backend while the service is down (a pod deleted, a workspace removed). Before
    # the fix the restart dropped its record, so its client got a 404 for a sandbox it made and never learned
    # why; now it is failed, says why on every call, and is deleted like any failed sandbox.
    first = Orchestrator(LocalBackend(f"{root}/sandboxes"), SQLiteStore(f"{root}/state.sqlite3"), clock=Clock())
    await first.start(reaper=False)
    for sandbox_id in ("gone", "kept"):
        await first.create_sandbox(CreateParams(sandbox_id=sandbox_id))
    await first.close()  # the sandboxes outlive it, as they outlive a service that stops
    outside = LocalBackend(f"{root}/sandboxes")
    await outside.delete("gone")
    await outside.close()
    backend = LocalBackend(f"{root}/sandboxes")
    orch = Orchestrator(backend, SQLiteStore(f"{root}/state.sqlite3"), clock=Clock())
    await orch.start(reaper=False)
    try:
        gone = await orch.get_sandbox("gone")
        assert (gone.status, gone.status_message) == ("failed", LOST_WHILE_DOWN)
        assert (await orch.get_sandbox("kept")).status == "ready"
        with pytest.raises(ConflictError, match="is failed, not ready: lost: the backend no longer holds"):
            await orch.submit_exec("gone", ExecParams(command="true"))
        report = await orch.reconcile()  # a second start keeps the failed record and its reason
        assert "gone" in report["kept"] and report["failed"] == []
        assert (await orch.get_sandbox("gone")).status_message == LOST_WHILE_DOWN
        await orch.delete_sandbox("gone")
        with pytest.raises(NotFoundError):
            await orch.get_sandbox("gone")
        await orch.delete_sandbox("kept")
    finally:
        await orch.close()
