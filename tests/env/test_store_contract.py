"""The `StateStore` contract, one suite over both stores: the embedded SQLite store and the Redis store (a real
redis-server). "Two replicas" are two handles on the same state: two `RedisStore`s on one database, or, for
SQLite, whose file one process owns at a time, the same store twice."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from orchard.env.locks import StoreLock
from orchard.env.store import (
    LOST_JOB_ERROR,
    IdempotencyRecord,
    JobRecord,
    SandboxRecord,
    SnapshotRecord,
    SQLiteStore,
    StateStore,
)


@pytest.fixture(params=["sqlite", "redis"])
async def handles(request, tmp_path):
    """`handles()` gives a store; each call a new handle on the same state (a new replica's view)."""
    opened: list[StateStore] = []
    if request.param == "sqlite":
        store = SQLiteStore(tmp_path / "state.sqlite3")
        opened.append(store)

        def new() -> StateStore:
            return store
    else:
        from orchard.env.store.redis_store import RedisStore

        url, prefix = request.getfixturevalue("redis_url"), f"test-{uuid.uuid4().hex[:8]}:"

        def new() -> StateStore:
            opened.append(RedisStore(url, prefix=prefix))
            return opened[-1]
    yield new
    for store in opened:
        await store.close()


async def test_sandboxes_round_trip(handles):
    store = handles()
    record = SandboxRecord(sandbox_id="b", image="img", env={"K": "v"}, created_at=1712345678.123456,
                           last_heartbeat=1712345678.654321, expires_at=1712349278.5, cpu="500m")
    assert await store.insert_sandbox(record) is True
    assert await store.insert_sandbox(SandboxRecord(sandbox_id="b", image="other")) is False  # the id exists
    await store.put_sandbox(SandboxRecord(sandbox_id="a", image="img"))
    assert await store.get_sandbox("b") == record  # every field, floats to the last digit
    assert [r.sandbox_id for r in await handles().list_sandboxes()] == ["a", "b"]  # by id, seen by another handle
    assert await store.touch_sandbox("b", 2e9 + 0.25) is True
    assert (await store.get_sandbox("b")).last_heartbeat == 2e9 + 0.25
    assert (await store.get_sandbox("b")).image == "img"  # a touch changes the heartbeat only
    assert await store.touch_sandbox("none", 1.0) is False
    await store.delete_sandbox("b")
    assert await store.get_sandbox("b") is None and await store.touch_sandbox("b", 3.0) is False
    assert [r.sandbox_id for r in await store.list_sandboxes()] == ["a"]


async def test_jobs_and_retention(handles):
    store = handles()
    for job_id, status, completed in (("q", "queued", None), ("r", "running", None), ("old", "succeeded", 1.0),
                                      ("new", "failed", 2.0)):
        await store.put_job(JobRecord(job_id=job_id, sandbox_id="s", command="c", status=status,
                                      completed_at=completed, stdout="ü\n"))
    assert (await store.get_job("q")).stdout == "ü\n" and await store.get_job("none") is None
    assert sorted(j.job_id for j in await store.list_jobs(("queued", "running"))) == ["q", "r"]
    assert sorted(j.job_id for j in await store.list_jobs(("failed",))) == ["new"]
    assert len(await store.list_jobs()) == 4
    await store.put_job(JobRecord(job_id="q", sandbox_id="s", command="c", status="succeeded", completed_at=3.0))
    assert sorted(j.job_id for j in await store.list_jobs(("queued", "running"))) == ["r"]  # q left the queue
    # completed before 2.0: old (1.0) only; new (2.0) is not before it, q (3.0) and r (running) stay
    assert await store.delete_jobs_completed_before(2.0) == 1
    assert await store.get_job("old") is None and await store.get_job("new") is not None
    assert await store.delete_jobs_completed_before(3.5) == 2  # new and q


async def test_idempotency_claims_are_shared_and_atomic(handles):
    one, two = handles(), handles()
    claim = IdempotencyRecord(key="k", fingerprint="f1", created_at=1712345678.125, resource_id="sb")
    results = await asyncio.gather(one.claim_idempotency(claim), two.claim_idempotency(
        IdempotencyRecord(key="k", fingerprint="f2", created_at=5.0)))
    assert sorted(r is None for r in results) == [False, True]  # exactly one claim wins
    seen = await two.get_idempotency("k")
    assert seen.status_code is None and seen.response is None  # still in flight
    assert [r.key for r in await two.list_idempotency(pending_only=True)] == ["k"]
    await one.complete_idempotency(seen.key, 201, '{"ok": true}')
    replay = await two.claim_idempotency(IdempotencyRecord(key="k", fingerprint="f3", created_at=9.0))
    assert (replay.fingerprint, replay.status_code, replay.response) == (seen.fingerprint, 201, '{"ok": true}')
    assert await two.list_idempotency(pending_only=True) == [] and len(await two.list_idempotency()) == 1
    await one.claim_idempotency(IdempotencyRecord(key="later", fingerprint="f", created_at=2e9))
    # created before 2e9: k (1712345678.125 or 5.0) only
    assert await two.delete_idempotency_before(2e9) == 1 and await one.get_idempotency("k") is None
    await one.complete_idempotency("k", 200, "{}")  # a deleted key is not brought back
    assert await two.get_idempotency("k") is None
    await two.delete_idempotency("later")
    assert await one.list_idempotency() == []


async def test_create_job_idempotent_writes_all_or_nothing(handles):
    store = handles()
    await store.put_sandbox(SandboxRecord(sandbox_id="a", image="host", created_at=1.0))
    claim = IdempotencyRecord(key="k", fingerprint="f", created_at=2.0, resource_id="j1", status_code=200,
                              response="{}")
    assert await store.create_job_idempotent(JobRecord(job_id="j1", sandbox_id="a", command="c"), claim) is None
    dup = IdempotencyRecord(key="k", fingerprint="f", created_at=3.0, resource_id="j2")
    assert (await handles().create_job_idempotent(JobRecord(job_id="j2", sandbox_id="a", command="c"), dup)
            ).resource_id == "j1"
    assert await store.get_job("j2") is None  # the losing job was never written
    third = JobRecord(job_id="j3", sandbox_id="a", command="c", replica="r1")
    assert await store.create_job_idempotent(third, dup, touched_at=9.0) is not None  # key taken: no touch
    assert (await store.get_sandbox("a")).last_heartbeat == 0.0 and await store.get_job("j3") is None
    assert await store.create_job_idempotent(third, None, touched_at=9.0) is None  # written with the touch
    assert (await store.get_sandbox("a")).last_heartbeat == 9.0 and await store.get_job("j3") == third
    assert [j.job_id for j in await store.list_jobs(("queued",))] == ["j1", "j3"]


async def test_of_two_replicas_claiming_a_job_exactly_one_runs_it(handles):
    one, two = handles(), handles()
    await one.put_job(JobRecord(job_id="j", sandbox_id="s", command="c", replica="A"))
    wins = await asyncio.gather(one.claim_job("j", "A", 10.5), two.claim_job("j", "B", 11.5))
    assert sorted(wins) == [False, True]
    job = await two.get_job("j")
    winner, started = ("A", 10.5) if wins[0] else ("B", 11.5)
    assert (job.status, job.replica, job.started_at) == ("running", winner, started)
    assert await one.claim_job("j", "A", 12.0) is False  # running: no second start, not even by its owner
    assert await one.claim_job("none", "A", 12.0) is False


async def test_jobs_of_a_replica_whose_lease_ended_are_lost_never_rerun(handles):
    one, two = handles(), handles()
    await one.register_replica("alive", 30.0)
    await one.register_replica("dead", 0.2)
    jobs = [JobRecord(job_id="a-queued", sandbox_id="s", command="c", replica="alive"),
            JobRecord(job_id="d-queued", sandbox_id="s", command="c", replica="dead"),
            JobRecord(job_id="d-running", sandbox_id="s", command="c", replica="dead", status="running",
                      started_at=5.0),
            JobRecord(job_id="d-done", sandbox_id="s", command="c", replica="dead", status="succeeded",
                      completed_at=6.0),
            JobRecord(job_id="nobody", sandbox_id="s", command="c", status="running"),
            JobRecord(job_id="unknown", sandbox_id="s", command="c", replica="never-registered")]
    for job in jobs:
        await one.put_job(job)
    assert sorted(await two.mark_lost_jobs(50.0)) == ["nobody", "unknown"]  # "dead" is alive for 0.2 s more
    await asyncio.sleep(0.3)
    assert sorted(await two.mark_lost_jobs(60.0)) == ["d-queued", "d-running"]
    running = await one.get_job("d-running")
    assert (running.status, running.completed_at, running.started_at) == ("failed", 60.0, 5.0)
    assert running.error == LOST_JOB_ERROR.format(status="running") and running.error.startswith("lost:")
    assert (await one.get_job("d-queued")).error == LOST_JOB_ERROR.format(status="queued")
    assert (await one.get_job("d-done")).status == "succeeded" and (await one.get_job("a-queued")).status == "queued"
    assert await one.claim_job("d-queued", "dead", 61.0) is False  # the dead replica, back: may not run it
    assert await two.mark_lost_jobs(70.0) == []  # each job is lost once
    assert [j.job_id for j in await one.list_jobs(("queued", "running"))] == ["a-queued"]


async def test_a_replica_is_alive_while_its_lease_holds(handles):
    one, two = handles(), handles()
    await one.register_replica("long", 30.0)
    await one.register_replica("short", 1.0)
    assert [await two.replica_alive(r) for r in ("long", "short", "never")] == [True, True, False]
    await asyncio.sleep(1.1)  # "short"'s 1 s lease has ended; "long" has 28.9 s left
    assert [await two.replica_alive(r) for r in ("long", "short")] == [True, False]
    await one.register_replica("short", 30.0)  # a renewal after the end makes it alive again
    assert await two.replica_alive("short") is True


async def test_locks_grant_growing_tokens_and_refuse_a_stale_one(handles):
    one, two = handles(), handles()
    first = await one.acquire_lock("sandbox:s", 30.0)
    assert first is not None and await two.acquire_lock("sandbox:s", 30.0) is None  # held
    assert await two.acquire_lock("sandbox:t", 30.0) is not None  # locks are per name
    await two.release_lock("sandbox:s", first + 1)  # a token that does not hold it frees nothing
    assert await two.acquire_lock("sandbox:s", 30.0) is None
    assert await one.renew_lock("sandbox:s", first, 30.0) is True
    await one.release_lock("sandbox:s", first)
    second = await two.acquire_lock("sandbox:s", 30.0)
    assert second is not None and second > first
    assert await one.renew_lock("sandbox:s", first, 30.0) is False


async def test_a_holder_paused_past_its_lease_cannot_write(handles):
    one, two = handles(), handles()
    job = JobRecord(job_id="j", sandbox_id="s", command="c", replica="A")
    await one.put_job(job)
    assert await one.claim_job("j", "A", 1.0)
    token = await one.acquire_lock("sandbox:s", 0.2)
    job.status, job.replica, job.started_at, job.stdout, job.completed_at = "running", "A", 1.0, "partial", None
    assert await one.put_job_fenced(job, "sandbox:s", token) is True  # holds the lock: written
    await asyncio.sleep(0.3)  # "paused": the lease ends without a renewal
    job.status, job.stdout, job.completed_at = "succeeded", "late\n", 2.0
    assert await one.put_job_fenced(job, "sandbox:s", token) is False  # nobody took it, still refused
    assert await one.renew_lock("sandbox:s", token, 30.0) is False
    newer = await two.acquire_lock("sandbox:s", 30.0)
    assert newer is not None and newer > token
    assert await one.put_job_fenced(job, "sandbox:s", token) is False  # another holder now: refused too
    stored = await two.get_job("j")
    assert (stored.status, stored.stdout, stored.completed_at) == ("running", "partial", None)
    other = JobRecord(job_id="j", sandbox_id="s", command="c", replica="B", status="succeeded", completed_at=3.0)
    assert await two.put_job_fenced(other, "sandbox:s", newer) is False  # the job is not B's to finish
    assert await two.put_job_fenced(job, "sandbox:s", newer) is True
    assert (await one.get_job("j")).stdout == "late\n"
    assert await one.list_jobs(("queued", "running")) == []  # and it left the queue's index


async def test_a_creator_whose_create_was_taken_over_cannot_write_or_delete_the_record(handles):
    a, b = handles(), handles()
    pending = SandboxRecord(sandbox_id="s", image="img", status="pending", replica="A")
    assert await a.insert_sandbox(pending)
    # B settles A's create: it takes the record over (expecting it pending and A's), then writes its outcome
    taken = SandboxRecord(sandbox_id="s", image="img", status="pending", replica="B", last_heartbeat=5.0)
    assert await b.put_sandbox_if(taken, status="pending", replica="A") is True
    assert await a.put_sandbox_if(taken, status="pending", replica="A") is False  # a second takeover: refused
    settled = SandboxRecord(sandbox_id="s", image="img", status="failed", status_message="by B", replica="B")
    assert await b.put_sandbox_if(settled, status="pending", replica="B") is True
    # A resumes: its outcome and its clean-up both expect the record pending and its own, and are refused
    ready = SandboxRecord(sandbox_id="s", image="img", status="ready", replica="A")
    assert await a.put_sandbox_if(ready, status="pending", replica="A") is False
    assert await a.delete_sandbox_if("s", status="pending", replica="A") is False
    assert await handles().get_sandbox("s") == settled  # B's settlement, whole (its heartbeat too)
    assert await b.put_sandbox_if(ready, status="pending", replica="B") is False  # B's own state changed too
    # the condition is on status and replica both, a missing record refuses, and a match deletes
    assert await b.delete_sandbox_if("s", status="ready", replica="B") is False
    assert await b.delete_sandbox_if("s", status="failed", replica="B") is True
    assert await a.get_sandbox("s") is None
    assert await a.put_sandbox_if(ready, status="failed", replica="B") is False  # gone: not brought back
    assert await a.delete_sandbox_if("s", status="failed", replica="B") is False
    assert await a.list_sandboxes() == []


async def test_conditional_sandbox_writes_match_a_record_without_a_replica(handles):
    store = handles()
    await store.put_sandbox(SandboxRecord(sandbox_id="s", image="img", status="pending", replica=None))
    assert await store.put_sandbox_if(SandboxRecord(sandbox_id="s", image="img", status="ready"), status="pending",
                                      replica="A") is False  # None is not "A"
    assert await store.put_sandbox_if(SandboxRecord(sandbox_id="s", image="img", status="ready"), status="pending",
                                      replica=None) is True
    assert (await store.get_sandbox("s")).status == "ready"


async def test_of_two_takeovers_of_one_create_exactly_one_succeeds(handles):
    await handles().insert_sandbox(SandboxRecord(sandbox_id="s", image="img", status="pending", replica="A"))
    takers = [handles() for _ in range(8)]
    won = await asyncio.gather(*(
        store.put_sandbox_if(SandboxRecord(sandbox_id="s", image="img", status="pending", replica=f"R{i}"),
                             status="pending", replica="A") for i, store in enumerate(takers)))
    assert sum(won) == 1
    assert (await handles().get_sandbox("s")).replica == f"R{won.index(True)}"


async def test_a_fenced_write_needs_a_running_job(handles):
    store = handles()
    queued = JobRecord(job_id="q", sandbox_id="s", command="c", replica="A")
    await store.put_job(queued)
    token = await store.acquire_lock("sandbox:s", 30.0)
    # the claim, not a fenced write, starts a job: a write that skipped it is refused
    assert await store.put_job_fenced(queued, "sandbox:s", token) is False
    assert await store.put_job_fenced(JobRecord(job_id="none", sandbox_id="s", command="c", status="running",
                                                replica="A"), "sandbox:s", token) is False
    assert await store.get_job("none") is None


async def test_store_lock_renews_its_lease_while_held_and_waits_its_turn(handles):
    one, two = handles(), handles()
    async with StoreLock(one, "sandbox:s", lease_s=0.3) as held:
        await asyncio.sleep(0.7)  # two leases long: held only because it renewed (every 0.1 s)
        assert not held.lost and await two.acquire_lock("sandbox:s", 30.0) is None
        job = JobRecord(job_id="j", sandbox_id="s", command="c", replica="A")
        await one.put_job(job)
        assert await one.claim_job("j", "A", 1.0)
        job.status, job.started_at = "running", 1.0
        assert await one.put_job_fenced(job, held.name, held.token) is True  # the first token still holds it
        waiter = asyncio.create_task(_hold(StoreLock(two, "sandbox:s", lease_s=30.0)))
        await asyncio.sleep(0.1)
        assert not waiter.done()  # waits for the holder, not past it
    assert held.token is None and await waiter > 1  # then gets the next token


async def _hold(lock: StoreLock) -> int:
    async with lock:
        return lock.token


class CancelSwallowingStore:
    """A store whose ``renew_lock`` turns the cancellation that interrupts it into a connection error, as a store
    client may when a request in flight is cancelled."""

    def __init__(self, inner: SQLiteStore) -> None:
        self.inner, self.renewals = inner, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def renew_lock(self, name: str, token: int, lease_s: float) -> bool:
        self.renewals += 1
        try:
            await asyncio.sleep(3600)  # the reply never comes before the holder leaves
        except asyncio.CancelledError:
            raise ConnectionError("connection closed while reading the reply") from None
        return True


async def test_leaving_a_lock_ends_a_renewal_whose_cancellation_the_client_turned_into_an_error():
    store = CancelSwallowingStore(SQLiteStore(":memory:"))

    async def hold() -> None:
        async with StoreLock(store, "sandbox:s", lease_s=0.3):
            await asyncio.sleep(0.2)  # the first renewal (due at 0.1 s) is in flight when the block ends

    # Before the fix the renewal loop retried after the ConnectionError and renewed a released lock forever, so
    # leaving the block never returned (an exec's lock held by a live replica, its next jobs queued for good).
    await asyncio.wait_for(hold(), timeout=10)
    assert store.renewals == 1
    assert await store.inner.acquire_lock("sandbox:s", 1.0) is not None  # released


def test_store_lock_validates():
    store = SQLiteStore(":memory:")
    for kwargs, name in (({"lease_s": 0}, "lease_s"), ({"lease_s": 1, "poll_s": -1}, "poll_s")):
        with pytest.raises(ValueError, match=name):
            StoreLock(store, "x", **kwargs)
    with pytest.raises(ValueError, match="name"):
        StoreLock(store, "", 1.0)


async def test_snapshots_round_trip_and_the_bound_is_atomic(handles):
    store = handles()
    record = SnapshotRecord(snapshot_id="s1", sandbox_id="b", image="img", env={"K": "v"}, cpu="2",
                            created_at=1712345678.123456, replica="r1")
    assert await store.insert_snapshot(record, limit=2) == "inserted"
    assert await store.insert_snapshot(SnapshotRecord(snapshot_id="s1", sandbox_id="x", image="i")) == "exists"
    assert await handles().get_snapshot("s1") == record  # every field, seen by another handle
    record.status = "ready"
    await store.put_snapshot(record)
    assert (await store.get_snapshot("s1")).status == "ready"
    # of 6 concurrent inserts from several handles under a bound of 2 with one held, exactly one gets in
    outcomes = await asyncio.gather(*(handles().insert_snapshot(
        SnapshotRecord(snapshot_id=f"c{i}", sandbox_id="b", image="img"), limit=2) for i in range(6)))
    assert sorted(outcomes) == ["full"] * 5 + ["inserted"]
    assert len(await store.list_snapshots()) == 2
    assert await store.insert_snapshot(SnapshotRecord(snapshot_id="free", sandbox_id="b", image="i")) == "inserted"
    ids = [r.snapshot_id for r in await store.list_snapshots()]
    assert ids == sorted(ids) and len(ids) == 3
    await store.delete_snapshot("s1")
    assert await store.get_snapshot("s1") is None
    assert await store.insert_snapshot(SnapshotRecord(snapshot_id="s1", sandbox_id="b", image="i"), limit=0) == "full"
