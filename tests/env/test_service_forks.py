"""Snapshots and forks through the service as a server: the real app under uvicorn on loopback, real HTTP, the
local backend with real child processes, both clients. Isolation, parent deletion, quotas, idempotency, bad input
(each a status and a `detail.error`), a restart, a command on another replica."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
import uuid

import httpx
import pytest
from test_service_api import EchoBackend

from orchard.env import (
    AsyncSandboxClient,
    BackendRefusedError,
    ConflictError,
    NotFoundError,
    SandboxClient,
)
from orchard.env.backends.local import LocalBackend
from orchard.env.embedded import serve
from orchard.env.forks import ForkParams, Forks
from orchard.env.orchestrator import CreateParams, ExecParams, Orchestrator
from orchard.env.server import create_app
from orchard.env.store import SQLiteStore

MAX_SNAPSHOTS, MAX_FORKS = 3, 3


@pytest.fixture(scope="module")
def service():
    with serve(max_snapshots=MAX_SNAPSHOTS, max_forks=MAX_FORKS) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service):
    with SandboxClient(service.url, service.api_key) as c:
        yield c


@pytest.fixture(autouse=True)
def nothing_left(client):
    """Every test starts and ends with no snapshot and no sandbox: the quotas are the module service's."""
    yield
    for snap in client.list_snapshots():
        client.delete_snapshot(snap["snapshot_id"])
    assert client.list_snapshots() == []


_HTTP = httpx.Client(timeout=60)


def raw(service, method, path, **kwargs):
    headers = {"X-API-Key": service.api_key, **kwargs.pop("headers", {})}
    return _HTTP.request(method, service.url + path, headers=headers, **kwargs)


def error_of(response) -> tuple[int, str]:
    return response.status_code, response.json()["detail"]["error"]


def test_snapshot_and_forks_are_isolated_from_each_other_and_their_parent(client):
    with client.create(env={"ROLE": "parent"}) as parent:
        parent.exec("mkdir -p repo && echo v1 > repo/f.txt && git -C repo init -q && git -C repo add -A")
        with parent.snapshot() as snap:
            assert snap.info["status"] == "ready" and snap.info["sandbox_id"] == parent.sandbox_id
            assert snap.info["processes_carried"] is False and snap.info["contents"] == "workspace"
            assert snap.info["env"] == {"ROLE": "parent"}
            with snap.fork() as a, snap.fork() as b, parent.fork() as c:
                assert a.info["forked_from"] == f"snapshot:{snap.snapshot_id}"
                assert c.info["forked_from"] == f"sandbox:{parent.sandbox_id}"
                assert a.exec("echo $ROLE").stdout == "parent\n"  # the source's environment is inherited
                for sb in (parent, a, b, c):
                    assert sb.exec(f"echo {sb.sandbox_id} >> repo/f.txt && git -C repo status --short").ok
                for sb in (parent, a, b, c):
                    assert sb.download("repo/f.txt") == f"v1\n{sb.sandbox_id}\n".encode()
                assert {s["sandbox_id"] for s in client.list_sandboxes()} >= {a.sandbox_id, b.sandbox_id,
                                                                               c.sandbox_id}


def test_deleting_the_parent_keeps_its_forks_and_snapshots(client):
    parent = client.create()
    parent.upload("data/x.bin", b"\x00\x01" * 5000)
    snap = parent.snapshot()
    fork = parent.fork()
    parent.delete()
    assert client.get_snapshot(snap.snapshot_id).info["status"] == "ready"
    assert fork.download("data/x.bin") == b"\x00\x01" * 5000
    with snap.fork() as late:
        assert late.download("data/x.bin") == b"\x00\x01" * 5000
        assert late.exec("ls data").stdout == "x.bin\n"
    fork.delete()
    snap.delete()


def test_bad_input_is_a_clear_error_and_changes_nothing(service, client):
    assert error_of(raw(service, "POST", "/snapshots/nope/fork", json={})) == (404, "snapshot_not_found")
    assert error_of(raw(service, "GET", "/snapshots/nope")) == (404, "snapshot_not_found")
    assert error_of(raw(service, "DELETE", "/snapshots/nope")) == (404, "snapshot_not_found")
    assert error_of(raw(service, "POST", "/sandboxes/nope/snapshots", json={})) == (404, "sandbox_not_found")
    gone = client.create()
    gone.delete()
    assert error_of(raw(service, "POST", f"/sandboxes/{gone.sandbox_id}/fork", json={})) == (404, "sandbox_not_found")
    with client.create() as sb:
        assert raw(service, "POST", f"/sandboxes/{sb.sandbox_id}/snapshots",
                   json={"snapshot_id": "../etc"}).status_code == 400
        with sb.snapshot("fixed-id"):
            assert error_of(raw(service, "POST", f"/sandboxes/{sb.sandbox_id}/snapshots",
                                json={"snapshot_id": "fixed-id"})) == (409, "snapshot_exists")
            taken = raw(service, "POST", "/snapshots/fixed-id/fork", json={"sandbox_id": sb.sandbox_id})
            assert taken.status_code == 409  # the fork's id is taken: the existing sandbox is untouched
        assert sb.exec("true").ok
    with pytest.raises(NotFoundError):
        client.get_snapshot("fixed-id")
    assert len([s for s in client.list_sandboxes() if s["forked_from"]]) == 0


def test_a_fork_while_a_command_writes_is_refused_and_nothing_is_corrupted(service, client):
    with client.create() as sb:
        job = sb.exec("for i in $(seq 1 40); do echo $i >> log; sleep 0.05; done", wait=False)
        deadline = time.monotonic() + 10
        while client.get_job(job.job_id).status == "queued" and time.monotonic() < deadline:
            time.sleep(0.02)
        for path in (f"/sandboxes/{sb.sandbox_id}/fork", f"/sandboxes/{sb.sandbox_id}/snapshots"):
            assert error_of(raw(service, "POST", path, json={})) == (409, "sandbox_busy")
        with pytest.raises(ConflictError) as refused:
            sb.snapshot()
        assert refused.value.detail["error"] == "sandbox_busy"
        done = client.wait_job(job.job_id, timeout=60)
        assert done.ok  # the command ran to its end, undisturbed
        assert client.list_snapshots() == [] and not [s for s in client.list_sandboxes() if s["forked_from"]]
        with sb.fork() as fork:  # once it has ended, the copy holds every line
            assert fork.download("log").decode().split() == [str(i) for i in range(1, 41)]


def test_an_exec_that_arrives_during_a_copy_waits_for_it(client):
    with client.create() as sb:
        sb.exec("mkdir big && for i in $(seq 1 300); do head -c 20000 /dev/urandom > big/$i; done")
        outcome: list[object] = []

        def fork() -> None:
            try:
                outcome.append(sb.fork())
            except ConflictError as exc:  # the rm below came first and was still running
                outcome.append(exc.detail["error"])

        copier = threading.Thread(target=fork)
        copier.start()
        time.sleep(0.01)
        sb.exec("rm -rf big")  # serialised with the copy: never half the files
        copier.join(60)
        if outcome == ["sandbox_busy"]:
            return
        with outcome[0] as made:  # type: ignore[union-attr]
            assert made.exec("ls big 2>/dev/null | wc -l").stdout.strip() in ("0", "300")



def test_quotas_bound_snapshots_and_forks(service, client):
    with client.create() as sb:
        snaps = [sb.snapshot() for _ in range(MAX_SNAPSHOTS)]
        with pytest.raises(BackendRefusedError) as refused:
            sb.snapshot()
        assert (refused.value.status_code, refused.value.detail["error"]) == (403, "quota_exceeded")
        assert len(client.list_snapshots()) == MAX_SNAPSHOTS
        snaps.pop().delete()
        snaps.append(sb.snapshot())  # deleting one frees room
        forks = [snaps[0].fork() for _ in range(MAX_FORKS)]
        assert error_of(raw(service, "POST", f"/snapshots/{snaps[0].snapshot_id}/fork", json={})) == (
            403, "quota_exceeded")
        assert error_of(raw(service, "POST", f"/sandboxes/{sb.sandbox_id}/fork", json={})) == (403, "quota_exceeded")
        assert service_summary(service)["max_forks"] == MAX_FORKS
        forks.pop().delete()
        forks.append(sb.fork())
        for fork in forks:
            fork.delete()
        for snap in snaps:
            snap.delete()


def service_summary(service):
    return raw(service, "GET", "/resources").json()


def test_a_retried_fork_with_its_idempotency_key_forks_once(service, client):
    with client.create() as sb:
        key = {"Idempotency-Key": uuid.uuid4().hex}
        first = raw(service, "POST", f"/sandboxes/{sb.sandbox_id}/fork", json={}, headers=key)
        again = raw(service, "POST", f"/sandboxes/{sb.sandbox_id}/fork", json={}, headers=key)
        assert first.status_code == again.status_code == 200
        assert first.json()["sandbox_id"] == again.json()["sandbox_id"]
        assert len([s for s in client.list_sandboxes() if s["forked_from"]]) == 1
        client.sandbox(first.json()["sandbox_id"]).delete()


async def test_async_client_snapshots_and_forks(service):
    async with AsyncSandboxClient(service.url, service.api_key) as client, await client.create() as sb:
        await sb.upload("a.txt", "one")
        async with await sb.snapshot() as snap, await snap.fork() as a, await sb.fork() as b:
            await a.upload("a.txt", "two")
            assert (await sb.download("a.txt"), await a.download("a.txt"), await b.download("a.txt")) == (
                b"one", b"two", b"one")
            assert [s["snapshot_id"] for s in await client.list_snapshots()] == [snap.snapshot_id]
        assert await client.list_snapshots() == []


def test_snapshots_survive_a_restart_and_lost_ones_are_dropped():
    root = tempfile.mkdtemp(prefix="orchard-env-forks-")  # parents traversable by sandbox uids
    os.chmod(root, 0o711)
    try:
        with serve(root) as svc, SandboxClient(svc.url, svc.api_key, auto_cleanup=False) as client:
            sb = client.create(heartbeat_timeout=3600)
            sb.upload("f", "kept")
            sb.snapshot("kept")
            sb.snapshot("lost")
        shutil.rmtree(os.path.join(root, "sandboxes", ".snapshots", "lost"))  # lost while the service was down
        with serve(root) as svc, SandboxClient(svc.url, svc.api_key) as client:
            assert [s["snapshot_id"] for s in client.list_snapshots()] == ["kept"]
            with client.get_snapshot("kept").fork() as fork:
                assert fork.download("f") == b"kept"
            client.sandbox(sb.sandbox_id).delete()
            client.delete_snapshot("kept")
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_a_backend_without_copies_answers_501_and_bad_quotas_are_refused(tmp_path):
    orchestrator = Orchestrator(EchoBackend(), SQLiteStore(tmp_path / "state.sqlite3"))
    await orchestrator.start(reaper=False)
    app = create_app(orchestrator, ["k"], manage_lifecycle=False)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            made = await http.post("/sandboxes", json={"sandbox_id": "a"}, headers={"X-API-Key": "k"})
            assert made.status_code == 200 and made.json()["forked_from"] is None
            for path in ("/sandboxes/a/snapshots", "/sandboxes/a/fork"):
                r = await http.post(path, json={}, headers={"X-API-Key": "k"})
                assert (r.status_code, r.json()["detail"]["error"]) == (501, "snapshots_unsupported")
    finally:
        await orchestrator.close()
    for name, bad in (("max_snapshots", -1), ("max_forks", 1.5), ("max_forks", True)):
        with pytest.raises(ValueError, match=name):
            Orchestrator(EchoBackend(), SQLiteStore(":memory:"), **{name: bad})
    with pytest.raises(ValueError, match="orchestrator"):
        Forks("not an orchestrator")  # type: ignore[arg-type]


async def test_a_command_on_another_replica_makes_the_sandbox_busy(redis_url):
    # Two replicas on one Redis over one backend (as on Kubernetes, where every replica reaches every pod): the
    # copy must see the command that the other replica runs, which no lock of its own process knows of.
    from orchard.env.store.redis_store import RedisStore

    root = tempfile.mkdtemp(prefix="orchard-env-forks-")
    os.chmod(root, 0o711)
    backend = LocalBackend(root, use_bwrap=False, allow_weak_isolation=True)
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    first = Orchestrator(backend, RedisStore(redis_url, prefix=prefix))
    second = Orchestrator(backend, RedisStore(redis_url, prefix=prefix))
    try:
        for replica in (first, second):
            await replica.start(reaper=False)
        await first.create_sandbox(CreateParams(sandbox_id="s", block_network=False))
        job = await first.submit_exec("s", ExecParams(command="sleep 2; echo done > out"))
        while (await second.get_job(job.job_id)).status == "queued":
            await asyncio.sleep(0.02)
        with pytest.raises(ConflictError) as busy:
            await Forks(second).snapshot("s", "snap")
        assert busy.value.detail["error"] == "sandbox_busy"
        with pytest.raises(ConflictError):
            await Forks(second).fork(ForkParams(), parent_id="s")
        assert (await first.wait_job(job.job_id, 30)).status == "succeeded"
        assert (await Forks(second).snapshot("s", "snap")).status == "ready"  # quiet now
        made = await Forks(first).fork(ForkParams(sandbox_id="f"), snapshot_id="snap")
        assert made.forked_from == "snapshot:snap"
        assert await backend.read_file("f", "out") == b"done\n"
    finally:
        for sandbox_id in ("s", "f"):
            await backend.delete(sandbox_id)
        await backend.delete_snapshot("snap")
        await second.close()  # the backend is closed twice: the second finds nothing to end
        await first.close()
        shutil.rmtree(root, ignore_errors=True)
