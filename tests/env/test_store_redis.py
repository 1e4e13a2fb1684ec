"""Orchestrator replicas on one Redis store (a real redis-server): shared idempotency, one run per exec, execs of
a sandbox serialised across replicas, and a replica that dies or stalls mid-job. In-process replicas share one
LocalBackend, as replicas share a cluster; killed and paused replicas are real child processes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from orchard.env.backends.base import Backend
from orchard.env.backends.local import LocalBackend
from orchard.env.embedded import serve
from orchard.env.errors import NotFoundError, WaitTimeoutError
from orchard.env.orchestrator import CreateParams, CreateTakenOverError, ExecParams, Orchestrator
from orchard.env.store import JobRecord, open_store
from orchard.env.store.redis_store import RedisStore


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="orchard-env-redis-")
    os.chmod(path, 0o711)  # sandbox uids walk through it to their workspaces
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def replicas(root, redis_url):
    """Two started orchestrators, A and B, over one backend and one Redis state (a fresh key prefix)."""
    # box=False: a bubblewrap per command, so the backend itself runs a sandbox's commands side by side and
    # only the orchestrators' store lock can keep them in turn
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    pair = [Orchestrator(backend, RedisStore(redis_url, prefix=prefix), replica_lease_s=5.0) for _ in "AB"]
    for orch in pair:
        await orch.start(reaper=False)
    yield pair
    for record in await backend.list_ids():
        await backend.delete(record)
    for orch in pair:
        await orch.close()  # closing the shared backend twice ends its processes once


def _db(redis_url: str, db: int) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{db}"  # a database of its own: child services use the default prefix


@contextlib.asynccontextmanager
async def _two_replicas(
        redis_url: str, *, a_backend: Backend, b_backend: Backend, leases_s: tuple[float, float],
        b_store: Callable[..., RedisStore] = RedisStore, b_clock: Callable[[], float] = time.time,
) -> AsyncIterator[tuple[Orchestrator, Orchestrator]]:
    """Replicas A and B, started without a reaper, over one Redis state (a fresh key prefix): A on `a_backend`
    with a plain RedisStore, B on `b_backend` with `b_store(redis_url, prefix=...)`; `leases_s` are A's and B's
    replica leases. The backends are one LocalBackend or wrappers of it, as replicas share a cluster. On exit
    B closes, and with it that backend, and A's store closes: A itself may have been made to stall or die."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    a = Orchestrator(a_backend, RedisStore(redis_url, prefix=prefix), replica_lease_s=leases_s[0])
    b = Orchestrator(b_backend, b_store(redis_url, prefix=prefix), replica_lease_s=leases_s[1], clock=b_clock)
    for orch in (a, b):
        await orch.start(reaper=False)
    try:
        yield a, b
    finally:
        await b.close()
        await a.store.close()


def test_open_store_names_the_store(tmp_path, redis_url):
    assert type(open_store(redis_url, tmp_path / "unused")).__name__ == "RedisStore"
    assert type(open_store("sqlite", tmp_path / "s.sqlite3")).__name__ == "SQLiteStore"
    with pytest.raises(ValueError, match="store must be"):
        open_store("postgres://x", tmp_path / "s.sqlite3")
    with pytest.raises(ValueError, match="url"):
        RedisStore("localhost:6379")


async def test_one_key_on_two_replicas_runs_one_job_once(replicas):
    a, b = replicas
    await a.create_sandbox(CreateParams(sandbox_id="s"))
    params = ExecParams(command="echo ran >> count")
    jobs = await asyncio.gather(a.submit_exec("s", params, key="k", fingerprint="f"),
                                b.submit_exec("s", params, key="k", fingerprint="f"))
    assert jobs[0].job_id == jobs[1].job_id  # the same key made one job, whichever replica got it first
    done = await b.wait_job(jobs[0].job_id, 30)  # B waits on the store for a job A may run
    assert done.status == "succeeded" and done.replica in (a.replica_id, b.replica_id)
    again = await a.submit_exec("s", params, key="k", fingerprint="f")  # a late retry, on either replica
    assert again.job_id == done.job_id
    await a.wait_job(again.job_id, 30)
    assert await b.read_file("s", "count") == b"ran\n"  # one run: one line


async def test_execs_of_one_sandbox_run_one_at_a_time_across_replicas(replicas):
    a, b = replicas
    await a.create_sandbox(CreateParams(sandbox_id="s"))
    step = ExecParams(command="echo start >> log; sleep 0.3; echo end >> log")
    jobs = [await a.submit_exec("s", step), await b.submit_exec("s", step), await a.submit_exec("s", step)]
    for job in jobs:
        assert (await b.wait_job(job.job_id, 30)).status == "succeeded"
    # each replica alone would serialise only its own execs: interleaved would read start, start, end, ...
    assert (await a.read_file("s", "log")).decode().split() == ["start", "end"] * 3


async def test_a_job_whose_lock_lease_lapsed_on_a_live_replica_still_gets_its_result(replicas):
    a, _ = replicas
    await a.create_sandbox(CreateParams(sandbox_id="s"))
    job = await a.submit_exec("s", ExecParams(command="sleep 0.6; echo done"))
    while (await a.get_job(job.job_id)).status != "running":
        await asyncio.sleep(0.02)
    # the lease lapses under A (as when its event loop stalls past it) while A's own replica lease holds:
    # no reaper reports the job lost, so only A can ever finish its record
    await a.store._r.delete(f"{a.store.prefix}lock:sandbox:s")
    done = await a.wait_job(job.job_id, 10)
    assert (done.status, done.stdout) == ("succeeded", "done\n")  # before: "running" for good
    assert (await a.get_job(job.job_id)).status == "succeeded"


async def test_a_live_replicas_reaper_reports_a_dead_replicas_job_lost_after_its_lease(root, redis_url):
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    async with _two_replicas(redis_url, a_backend=backend, b_backend=backend, leases_s=(1.5, 30.0)) as (a, b):
        await a.create_sandbox(CreateParams(sandbox_id="s"))
        params = ExecParams(command="echo ran >> count; sleep 30")
        job = await a.submit_exec("s", params, key="k", fingerprint="f")

        async def ran() -> bool:
            try:
                return await b.read_file("s", "count") == b"ran\n"
            except NotFoundError:  # the command has not yet made it
                return False

        # A dies after its command began: "running" is written before the process starts, so wait for the
        # command's own mark too (in CI once, A died between the two and the command never ran at all)
        while (await b.get_job(job.job_id)).status != "running" or not await ran():
            await asyncio.sleep(0.02)
        for task in (a._beat, *a._tasks):  # A dies: it renews nothing and writes nothing from here on
            task.cancel()
        await asyncio.gather(a._beat, *a._tasks, return_exceptions=True)
        await b.reap_once()
        assert (await b.get_job(job.job_id)).status == "running"  # A's lease (1.5 s) has not ended yet
        await asyncio.sleep(1.6)
        await b.reap_once()
        lost = await b.get_job(job.job_id)
        assert lost.status == "failed" and lost.error.startswith("lost: ") and lost.replica == a.replica_id
        retry = await b.submit_exec("s", params, key="k", fingerprint="f")  # the client's retry, to B
        assert retry.job_id == job.job_id and retry.status == "failed"
        assert await b.read_file("s", "count") == b"ran\n"  # ran once, on A; never again
        await b.delete_sandbox("s")


def _exec(url: str, key: str, command: str, idempotency_key: str) -> dict:
    response = httpx.post(f"{url}/sandboxes/s/exec", json={"command": command, "wait": False},
                          headers={"X-API-Key": key, "Idempotency-Key": idempotency_key}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _job(url: str, key: str, job_id: str) -> dict:
    return httpx.get(f"{url}/jobs/{job_id}", headers={"X-API-Key": key}, timeout=30).json()


def _count(url: str, key: str) -> bytes | None:
    """The file "count" in sandbox "s", or None while it is not there."""
    answer = httpx.get(f"{url}/sandboxes/s/files", params={"path": "count"}, headers={"X-API-Key": key}, timeout=30)
    return base64.b64decode(answer.json()["content"]) if answer.status_code == 200 else None


def _until(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.05)
    return value


@pytest.mark.slow
def test_a_killed_replicas_job_is_reported_lost_by_another_never_rerun(root, redis_url):
    key, store = "replica-key", _db(redis_url, 1)
    options = {"replica_lease_s": 1.0, "reap_interval_s": 0.2}
    with serve(root, api_key=key, in_process=False, store=store, **options) as first:
        h = {"X-API-Key": key}
        assert httpx.post(f"{first.url}/sandboxes", json={"sandbox_id": "s"}, headers=h, timeout=30).is_success
        command = "echo ran >> count; sleep 30"
        job = _exec(first.url, key, command, "exec-1")
        _until(lambda: _job(first.url, key, job["job_id"])["status"] == "running", "the job running")
        # "running" is written before the command starts: killed before its echo, the file would not be there
        _until(lambda: _count(first.url, key) == b"ran\n", "the command's echo")
        first.process.send_signal(signal.SIGKILL)
        assert first.process.wait(timeout=10) == -signal.SIGKILL

    with serve(root, api_key=key, in_process=False, store=store, **options) as second:
        # the first replica's lease (1 s) ends; a reaper pass of the second then reports its job lost
        lost = _until(lambda: (j := _job(second.url, key, job["job_id"]))["status"] != "running" and j,
                      "the job reported lost")
        assert lost["status"] == "failed" and lost["error"].startswith("lost:") and lost["exit_code"] is None
        retry = _exec(second.url, key, command, "exec-1")  # the client's retry of the same exec
        assert retry["job_id"] == job["job_id"] and retry["status"] == "failed"
        assert _count(second.url, key) == b"ran\n"  # run once, by the replica that died
        assert httpx.delete(f"{second.url}/sandboxes/s", headers=h, timeout=30).is_success


@pytest.mark.slow
def test_a_replica_paused_past_its_lease_cannot_record_its_result(root, redis_url):
    key, store = "pause-key", _db(redis_url, 2)
    with serve(root, api_key=key, in_process=False, store=store, replica_lease_s=1.0) as replica:
        h = {"X-API-Key": key}
        assert httpx.post(f"{replica.url}/sandboxes", json={"sandbox_id": "s"}, headers=h, timeout=30).is_success
        job = _exec(replica.url, key, "sleep 1.5; echo finished", "exec-1")
        _until(lambda: _job(replica.url, key, job["job_id"])["status"] == "running", "the job running")
        replica.process.send_signal(signal.SIGSTOP)  # stalls (GC, swap, a debugger) with its job running
        try:
            time.sleep(2.5)  # past its lease (1 s) and past the command's end (1.5 s)
            other = RedisStore(store)  # another replica's reaper pass
            assert asyncio.run(_sweep(other)) == [job["job_id"]]
        finally:
            replica.process.send_signal(signal.SIGCONT)
        # execs of a sandbox run in order on a replica: this one returns after the stalled job's write
        after = httpx.post(f"{replica.url}/sandboxes/s/exec", json={"command": "echo next", "wait": True}, headers=h,
                           timeout=60).json()
        assert after["stdout"] == "next\n"
        stalled = _job(replica.url, key, job["job_id"])
        assert stalled["status"] == "failed" and stalled["error"].startswith("lost:")
        assert stalled["stdout"] == ""  # the late result was refused, not written over the loss
        assert httpx.delete(f"{replica.url}/sandboxes/s", headers=h, timeout=30).is_success


async def _sweep(store: RedisStore) -> list[str]:
    try:
        return await store.mark_lost_jobs(time.time())
    finally:
        await store.close()


async def test_a_replica_back_between_the_sweeps_read_and_its_write_keeps_its_job(redis_url, monkeypatch):
    # The sweep reads the leases (replica "r" has none: dead), then "r" renews before the sweep writes the loss:
    # the write must check the lease again, at write time, and leave the job running.
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    sweeper, owner = RedisStore(redis_url, prefix=prefix), RedisStore(redis_url, prefix=prefix)
    try:
        await owner.put_job(JobRecord(job_id="j", sandbox_id="s", command="c", replica="r", status="running",
                                      started_at=5.0))
        read_leases = sweeper._r.mget

        async def then_r_comes_back(*args, **kwargs):
            beats = await read_leases(*args, **kwargs)
            await owner.register_replica("r", 0.3)
            return beats

        monkeypatch.setattr(sweeper._r, "mget", then_r_comes_back)
        assert await sweeper.mark_lost_jobs(50.0) == []
        job = await owner.get_job("j")
        assert (job.status, job.completed_at, job.error) == ("running", None, None)
        monkeypatch.setattr(sweeper._r, "mget", read_leases)
        await asyncio.sleep(0.4)  # past r's 0.3 s lease, with no renewal: now it is dead at write time too
        assert await sweeper.mark_lost_jobs(60.0) == ["j"]
        assert (await owner.get_job("j")).status == "failed"
    finally:
        await sweeper.close()
        await owner.close()


class _HeldCreates:
    """A backend whose create of sandbox `held` waits for `release` (a replica stalled mid-create: its lease
    runs out meanwhile), `before` or after the backend made the sandbox."""

    def __init__(self, backend: LocalBackend, held: str, *, before: bool) -> None:
        self.backend, self.held, self.before = backend, held, before
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    async def create(self, sandbox_id, spec) -> None:
        if sandbox_id == self.held and self.before:
            self.entered.set()
            await self.release.wait()
        await self.backend.create(sandbox_id, spec)
        if sandbox_id == self.held and not self.before:
            self.entered.set()
            await self.release.wait()


@pytest.mark.parametrize("made", [True, False], ids=["sandbox-made", "sandbox-not-made"])
async def test_a_creator_paused_past_its_lease_cannot_overwrite_the_settlement(root, redis_url, made):
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    held = _HeldCreates(backend, "s", before=not made)
    async with _two_replicas(redis_url, a_backend=held, b_backend=backend, leases_s=(1.0, 30.0)) as (a, b):
        async def create() -> tuple[int, dict]:
            record = await a.create_sandbox(CreateParams(sandbox_id="s"))
            return 200, {"status": record.status}

        creating = asyncio.create_task(a.idempotent("key", "fingerprint", create, resource_id="s"))
        await held.entered.wait()
        a._beat.cancel()  # A stalls mid-create: it renews nothing, so its lease (1 s) ends
        await asyncio.gather(a._beat, return_exceptions=True)
        await asyncio.sleep(1.1)
        # B's reaper pass: the sandbox the backend holds is adopted (ready); one it does not is dropped
        assert await b.settle_creates() == {"s": "ready" if made else "dropped"}
        settled = await b.store.get_sandbox("s")
        held.release.set()  # A resumes and would write "ready" over B's settlement (before the fix it did)
        with pytest.raises(CreateTakenOverError, match="another replica settled the create") as refused:
            await creating
        assert refused.value.status_code == 409
        assert await b.store.get_sandbox("s") == settled  # B's, untouched: "ready" and B's, or no record at all
        if made:
            assert (settled.status, settled.replica) == ("ready", b.replica_id)
            job = await b.submit_exec("s", ExecParams(command="echo adopted"))
            assert (await b.wait_job(job.job_id, 30)).stdout == "adopted\n"
            await b.delete_sandbox("s")
        else:
            assert settled is None
            assert not await backend.exists("s")  # what A made after the drop is deleted, not leaked
        assert await b.store.get_idempotency("key") is None  # B forgot the pending key, A did not answer it


class _DeleteThen:
    """A backend whose delete of sandbox `held` runs `then` once it has deleted (the settler's drop, with a
    stalled creator resuming right after the settler's backend delete)."""

    def __init__(self, backend: LocalBackend, held: str, then) -> None:
        self.backend, self.held, self.then = backend, held, then

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    async def delete(self, sandbox_id) -> None:
        await self.backend.delete(sandbox_id)
        if sandbox_id == self.held:
            await self.then()


async def test_a_creator_whose_sandbox_appears_during_the_settlers_drop_deletes_it(root, redis_url):
    # A stalls before its backend makes "s"; B finds no sandbox and drops the create. A resumes right after B's
    # backend delete and makes "s". Before the fix B deleted the record after that: A had still found it
    # (pending, B's), kept its sandbox, and "s" lived on with no record. Now B deletes the record first, so A
    # finds none and deletes what it made.
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    held = _HeldCreates(backend, "s", before=True)
    creating: list[asyncio.Task] = []

    async def resume_the_creator() -> None:
        held.release.set()
        await asyncio.wait(creating)  # A's create, to its end, inside B's drop

    async with _two_replicas(redis_url, a_backend=held,
                             b_backend=_DeleteThen(backend, "s", resume_the_creator),
                             leases_s=(1.0, 30.0)) as (a, b):
        creating.append(asyncio.create_task(a.create_sandbox(CreateParams(sandbox_id="s"))))
        await held.entered.wait()
        a._beat.cancel()  # A renews nothing: its lease (1 s) ends
        await asyncio.gather(a._beat, return_exceptions=True)
        await asyncio.sleep(1.1)
        assert await b.settle_creates() == {"s": "dropped"}
        assert creating[0].done() and await b.store.get_sandbox("s") is None
        assert not await backend.exists("s")  # made by A after B's backend delete, deleted by A
        with pytest.raises(CreateTakenOverError, match="it is gone"):
            creating[0].result()


class _AskedAbout(RedisStore):
    """A store that calls `then` each time its replica asks whether another replica is alive (a delete that
    found a create in flight elsewhere)."""

    def __init__(self, url: str, *, prefix: str, then) -> None:
        super().__init__(url, prefix=prefix)
        self.then = then

    async def replica_alive(self, replica: str) -> bool:
        alive = await super().replica_alive(replica)
        self.then()
        return alive


async def test_a_delete_on_another_replica_waits_for_the_create_in_flight_and_leaks_nothing(root, redis_url):
    # A (alive) is creating "s", held before its backend makes it; the user's delete reaches B. Before the fix B
    # wrote "deleting" at once and deleted the backend's (not yet made) sandbox; A, resumed right then, made
    # "s", found its write refused (the record was "deleting", not gone) and kept what it made; B then deleted
    # the record: a live sandbox that no record knew of, and a create answered 409. Now B waits until A's
    # create is written (A is released as soon as B checks A's lease), then deletes the ready sandbox.
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    held = _HeldCreates(backend, "s", before=True)
    creating: list[asyncio.Task] = []

    async def resume_the_creator() -> None:  # before the fix: inside B's backend delete, before its record delete
        held.release.set()
        await asyncio.wait(creating)

    async with _two_replicas(redis_url, a_backend=held,
                             b_backend=_DeleteThen(backend, "s", resume_the_creator),
                             b_store=functools.partial(_AskedAbout, then=held.release.set),
                             leases_s=(30.0, 30.0)) as (a, b):
        async def create() -> tuple[int, dict]:
            record = await a.create_sandbox(CreateParams(sandbox_id="s"))
            return 200, {"status": record.status}

        creating.append(asyncio.create_task(a.idempotent("key", "fingerprint", create, resource_id="s")))
        await held.entered.wait()
        await b.delete_sandbox("s")
        await asyncio.wait(creating)
        assert not await backend.exists("s")  # before: made by A after B's backend delete, and left there
        assert await b.store.get_sandbox("s") is None
        assert creating[0].result() == (200, {"status": "ready"})  # the create ended as it would alone...
        assert (await b.store.get_idempotency("key")).status_code == 200  # ...and its key was answered


@pytest.mark.parametrize("creator", ["lease-ended", "alive-past-wait"])
async def test_a_delete_takes_over_a_create_it_does_not_wait_for_and_the_creator_deletes_what_it_makes(
        root, redis_url, creator):
    # B's delete does not wait for A's create: A's lease has ended (A stalled), or A is alive but still
    # creating after the delete's `wait_s`. B writes "deleting" over the pending record (fenced), and A resumes
    # inside B's backend delete, so A's sandbox appears after B found nothing to delete. Before the fix A saw
    # the record "deleting", not gone, and kept its sandbox, which outlived the record; and the create's
    # Idempotency-Key stayed pending for its 24 h (a retry waited 600 s, then got 409).
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    held = _HeldCreates(backend, "s", before=True)
    creating: list[asyncio.Task] = []

    async def resume_the_creator() -> None:
        held.release.set()
        await asyncio.wait(creating)

    lease = 1.0 if creator == "lease-ended" else 30.0
    async with _two_replicas(redis_url, a_backend=held,
                             b_backend=_DeleteThen(backend, "s", resume_the_creator),
                             leases_s=(lease, 30.0)) as (a, b):
        async def create() -> tuple[int, dict]:
            record = await a.create_sandbox(CreateParams(sandbox_id="s"))
            return 200, {"status": record.status}

        creating.append(asyncio.create_task(a.idempotent("key", "fingerprint", create, resource_id="s")))
        await held.entered.wait()
        if creator == "lease-ended":
            a._beat.cancel()  # A renews nothing: its lease (1 s) ends
            await asyncio.gather(a._beat, return_exceptions=True)
            await asyncio.sleep(1.1)
            await b.delete_sandbox("s")  # the default wait_s (600 s) is not waited: nobody is creating "s"
        else:
            await b.delete_sandbox("s", wait_s=0.2)
        assert creating[0].done() and await b.store.get_sandbox("s") is None
        assert not await backend.exists("s")  # made by A after B's backend delete, deleted by A
        with pytest.raises(CreateTakenOverError, match="it is deleting"):
            creating[0].result()
        assert await b.store.get_idempotency("key") is None  # forgotten by B: a retry creates anew


async def test_the_reaper_leaves_a_create_in_flight_on_another_replica_to_its_creator(root, redis_url):
    # "s" is past its heartbeat timeout while A still creates it. Before the fix B's reaper deleted it under
    # A's create (and, on A itself, its pass waited up to 600 s for the create); now it is left to A.
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    held = _HeldCreates(backend, "s", before=True)
    async with _two_replicas(redis_url, a_backend=held, b_backend=backend,
                             # B's clock: a minute on, past the 1 s heartbeat timeout
                             leases_s=(30.0, 30.0), b_clock=lambda: time.time() + 60) as (a, b):
        creating = asyncio.create_task(a.create_sandbox(CreateParams(sandbox_id="s", heartbeat_timeout=1)))
        await held.entered.wait()
        assert await b.reap_once() == []
        held.release.set()
        assert (await creating).status == "ready"
        assert await b.reap_once() == ["s"]  # out of pending, and still idle: the next pass reaps it
        assert await b.store.get_sandbox("s") is None and not await backend.exists("s")


class _ReadsPending(RedisStore):
    """A store that calls `then` each time its replica reads a sandbox record that is still pending (a wait or
    an exec that found a create in flight elsewhere), after the read."""

    def __init__(self, url: str, *, prefix: str, then) -> None:
        super().__init__(url, prefix=prefix)
        self.then = then

    async def get_sandbox(self, sandbox_id: str):
        record = await super().get_sandbox(sandbox_id)
        if record is not None and record.status == "pending":
            self.then()
        return record


@pytest.mark.parametrize("call", ["wait", "exec"])
async def test_a_wait_or_exec_on_another_replica_waits_for_the_create_in_flight(root, redis_url, call):
    # A (alive) is creating "s", held before its backend makes it; the client's next call, behind a load
    # balancer, reaches B. A is released only once B has read the record pending, so B must wait for it. Before
    # the fix B waited only for creates of its own: the wait answered "pending" at once and the exec 409.
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    held = _HeldCreates(backend, "s", before=True)
    async with _two_replicas(redis_url, a_backend=held, b_backend=backend,
                             b_store=functools.partial(_ReadsPending, then=held.release.set),
                             leases_s=(30.0, 30.0)) as (a, b):
        creating = asyncio.create_task(a.create_sandbox(CreateParams(sandbox_id="s")))
        await held.entered.wait()
        if call == "wait":
            record = await b.wait_sandbox("s", 30)
            assert (record.status, record.replica) == ("ready", a.replica_id)  # before: ("pending", A's)
        else:
            job = await b.submit_exec("s", ExecParams(command="echo made by A"))  # before: ConflictError (409)
            assert (await b.wait_job(job.job_id, 30)).stdout == "made by A\n"
        assert (await creating).status == "ready"
        await b.delete_sandbox("s")


async def test_a_wait_on_another_replica_over_a_create_that_does_not_end_times_out(root, redis_url):
    # A's create of "s" stays held for the whole wait: B's wait gives up after its timeout with 408, as a wait
    # on the creating replica does. Before the fix B answered "pending" at once; a wait that polled without its
    # timeout would hang here, so the outer bound (30 s) only guards the suite.
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    held = _HeldCreates(backend, "s", before=True)
    async with _two_replicas(redis_url, a_backend=held, b_backend=backend, leases_s=(30.0, 30.0)) as (a, b):
        creating = asyncio.create_task(a.create_sandbox(CreateParams(sandbox_id="s")))
        await held.entered.wait()
        with pytest.raises(WaitTimeoutError, match=r"not ready within 0\.3s") as timed_out:
            await asyncio.wait_for(b.wait_sandbox("s", 0.3), 30)
        assert timed_out.value.status_code == 408
        assert (await b.store.get_sandbox("s")).status == "pending"  # the wait only read: A's create goes on
        held.release.set()
        assert (await creating).status == "ready"
        await b.delete_sandbox("s")


async def test_a_wait_over_a_create_whose_creator_died_is_answered_by_the_settlement(root, redis_url):
    # A stalls mid-create and its lease (1 s) ends. B's wait neither answers "pending" (as before the fix) nor
    # takes the record over (as a delete does): it polls until a reaper pass settles the create, here B's own
    # `settle_creates` running beside the wait, and answers with the adopted sandbox.
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    held = _HeldCreates(backend, "s", before=False)  # the backend made "s" before A stalled: it is adopted
    async with _two_replicas(redis_url, a_backend=held, b_backend=backend, leases_s=(1.0, 30.0)) as (a, b):
        creating = asyncio.create_task(a.create_sandbox(CreateParams(sandbox_id="s")))
        await held.entered.wait()
        a._beat.cancel()  # A renews nothing: its lease (1 s) ends
        await asyncio.gather(a._beat, return_exceptions=True)
        await asyncio.sleep(1.1)
        waiting = asyncio.create_task(b.wait_sandbox("s", 30))
        await asyncio.sleep(0.1)  # the wait has read the record pending and polls
        assert not waiting.done()  # before: done, answering "pending"
        assert await b.settle_creates() == {"s": "ready"}
        record = await waiting
        assert (record.status, record.replica) == ("ready", b.replica_id)
        held.release.set()
        with pytest.raises(CreateTakenOverError):
            await creating
        await b.delete_sandbox("s")
