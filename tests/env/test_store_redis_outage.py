"""Redis down for a moment under execs in flight (a real redis-server, stopped and started again with its data):
a store outage delays a job's result, never changes it, and leaves no job "running" after its command ended."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid

import pytest
import redis.exceptions
from _redis import RedisServer

from orchard.env.backends.local import LocalBackend
from orchard.env.orchestrator import CreateParams, ExecParams, Orchestrator
from orchard.env.store.redis_store import RedisStore


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="orchard-env-outage-")
    os.chmod(path, 0o711)  # sandbox uids walk through it to their workspaces
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def redis_server(root):
    server = RedisServer(tempfile.mkdtemp(prefix="redis-", dir=root))
    server.start()
    yield server
    server.stop()


async def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        if loop.time() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(0.02)


async def test_execs_whose_results_fall_in_a_redis_outage_keep_their_results(root, redis_server):
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    store = RedisStore(redis_server.url, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    orch = Orchestrator(backend, store, replica_lease_s=10.0)
    await orch.start(reaper=False)
    try:
        boxes = ["s0", "s1", "s2"]
        for sandbox_id in boxes:
            await orch.create_sandbox(CreateParams(sandbox_id=sandbox_id))
        # each command waits for a file the test writes while Redis is down, so that it ends in the outage;
        # the second exec of each sandbox waits in line behind the first and is claimed in the outage
        gated = ExecParams(command="while [ ! -e go ]; do sleep 0.02; done; echo first; echo ran >> count")
        after = ExecParams(command="echo second; echo ran >> count")
        firsts = [await orch.submit_exec(s, gated) for s in boxes]
        seconds = [await orch.submit_exec(s, after) for s in boxes]

        async def all_running() -> bool:
            return [(await orch.get_job(j.job_id)).status for j in firsts] == ["running"] * len(firsts)

        await _until(all_running, "the first execs running")
        redis_server.stop()
        for sandbox_id in boxes:
            await backend.write_file(sandbox_id, "go", b"")  # the backend needs no store

        async def firsts_ended() -> bool:
            for sandbox_id in boxes:
                try:
                    await backend.read_file(sandbox_id, "count")
                except FileNotFoundError:  # not yet written
                    return False
            return True

        await _until(firsts_ended, "the first commands' end")
        await asyncio.sleep(1.5)  # down for a while after the commands ended: their result writes meet it
        redis_server.start()

        for job, stdout in [(j, "first\n") for j in firsts] + [(j, "second\n") for j in seconds]:
            done = await orch.wait_job(job.job_id, 30)
            # before: "failed" with error "ConnectionError: ..." although the command succeeded
            assert (done.status, done.exit_code, done.error, done.stdout) == ("succeeded", 0, None, stdout)

        async def all_recorded() -> bool:  # a waiter may be answered before the store has the result
            return await store.list_jobs(("queued", "running")) == []

        await _until(all_recorded, "every result recorded")  # before: left "running" for good
        for job, stdout in [(j, "first\n") for j in firsts] + [(j, "second\n") for j in seconds]:
            stored = await orch.get_job(job.job_id)
            assert (stored.status, stored.exit_code, stored.error, stored.stdout) == ("succeeded", 0, None, stdout)
        for sandbox_id in boxes:
            assert await orch.read_file(sandbox_id, "count") == b"ran\nran\n"  # each command ran once
    finally:
        for sandbox_id in await backend.list_ids():
            await backend.delete(sandbox_id)
        await orch.close()


class _AnswersLost(RedisStore):
    """Redis whose first claim and first fenced write take effect and then lose their answer, as when the
    connection drops after the server ran the script but before its reply came."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lost: set[str] = set()

    async def _once(self, name: str, result):
        if name not in self.lost:
            self.lost.add(name)
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return result

    async def claim_job(self, job_id: str, replica: str, started_at: float) -> bool:
        return await self._once("claim", await super().claim_job(job_id, replica, started_at))

    async def put_job_fenced(self, record, lock: str, token: int) -> bool:
        return await self._once("write", await super().put_job_fenced(record, lock, token))


async def test_a_claim_and_a_result_whose_answers_were_lost_count_as_made(root, redis_server, caplog):
    backend = LocalBackend(f"{root}/sandboxes", box=False)
    store = _AnswersLost(redis_server.url, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    orch = Orchestrator(backend, store, replica_lease_s=10.0)
    await orch.start(reaper=False)
    try:
        await orch.create_sandbox(CreateParams(sandbox_id="s"))
        job = await orch.submit_exec("s", ExecParams(command="echo ran >> count; echo out"))
        done = await orch.wait_job(job.job_id, 30)
        assert (done.status, done.exit_code, done.stdout) == ("succeeded", 0, "out\n")
        assert store.lost == {"claim", "write"}
        stored = await orch.get_job(job.job_id)
        assert (stored.status, stored.exit_code, stored.stdout) == ("succeeded", 0, "out\n")
        assert await orch.read_file("s", "count") == b"ran\n"  # run once: the repeated claim was no second one
        assert "not recorded" not in caplog.text and "no longer queued" not in caplog.text
    finally:
        for sandbox_id in await backend.list_ids():
            await backend.delete(sandbox_id)
        await orch.close()
