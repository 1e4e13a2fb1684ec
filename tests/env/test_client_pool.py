"""The warm pool against the real service: sandboxes made and started ahead, handed out and replaced, the idle
ones deleted on close (also while a refill is in flight), none leaked."""

from __future__ import annotations

import asyncio

import pytest

from orchard.env import AsyncSandboxClient, AsyncSandboxPool
from orchard.env.embedded import serve

# A file in the home (outside the workspace) shows the warm command ran, so the sandbox's box has started (the
# local backend starts it with the first command and keeps it until delete).
WARM = ["sh", "-c", "echo started > ~/.warm"]


async def test_the_pool_hands_out_started_sandboxes_refills_and_deletes_the_idle_on_close(embedded_service,
                                                                                          sandbox_ids):
    async with AsyncSandboxClient(embedded_service.url, embedded_service.api_key) as client:
        pool = AsyncSandboxPool(client, 2, warm_command=WARM)
        async with pool:
            await pool.wait_filled()
            ahead = await sandbox_ids(client)
            assert pool.idle == 2 and len(ahead) == 2
            taken = [await pool.acquire() for _ in range(3)]  # two from the pool, the third created at once
            assert {s.sandbox_id for s in taken[:2]} == ahead
            for sandbox in taken[:2]:
                assert (await sandbox.exec("cat ~/.warm")).stdout == "started\n"
                assert (await sandbox.exec(["ls", "-A"])).stdout == ""  # an empty workspace, as a fresh one
            assert (await taken[2].exec("cat ~/.warm")).exit_code != 0  # not from the pool
            await pool.wait_filled()
            # 3 handed out + 2 made again (each acquire tops the pool up to 2, never beyond)
            assert pool.idle == 2 and len(await sandbox_ids(client)) == 3 + 2
        assert await sandbox_ids(client) == {s.sandbox_id for s in taken}  # closed: the idle two deleted
        with pytest.raises(RuntimeError, match="closed"):
            await pool.acquire()
        for sandbox in taken:
            await sandbox.delete()
        assert await sandbox_ids(client) == set()


async def test_closing_while_refilling_leaks_nothing(embedded_service, sandbox_ids):
    async with AsyncSandboxClient(embedded_service.url, embedded_service.api_key) as client:
        pool = AsyncSandboxPool(client, 3)
        pool.start()
        await pool.aclose()  # three creations in flight: each is deleted once made
        assert pool.idle == 0 and await sandbox_ids(client) == set()
        await pool.aclose()


async def test_a_failed_warm_command_is_never_handed_out(embedded_service, sandbox_ids):
    async with AsyncSandboxClient(embedded_service.url, embedded_service.api_key) as client:
        async with AsyncSandboxPool(client, 2, warm_command=["false"]) as pool:
            await pool.wait_filled()
            assert pool.idle == 0 and pool.failures == 2 and await sandbox_ids(client) == set()
            sandbox = await pool.acquire()  # created directly
            assert (await sandbox.exec(["true"])).exit_code == 0
            await sandbox.delete()
            await pool.wait_filled()  # the refill acquire started failed as well
            assert pool.failures == 4
        assert await sandbox_ids(client) == set()


@pytest.fixture(scope="module")
def reaping_service():
    """A service that deletes a sandbox idle for 2 s (its reaper looks every 0.2 s)."""
    with serve(heartbeat_timeout_s=2.0, reap_interval_s=0.2) as svc:
        yield svc


async def test_idle_sandboxes_outlive_the_heartbeat_timeout(reaping_service, sandbox_ids):
    # The pool beats each idle sandbox every 2 / 3 s, a third of the timeout it reads from the sandbox's info
    # (the create options name none). Before the fix nothing did: idle 5 s = 2.5 timeouts, both were reaped and
    # `acquire` handed them out anyway, so the first command got 404.
    async with AsyncSandboxClient(reaping_service.url, reaping_service.api_key) as client:
        async with AsyncSandboxPool(client, 2) as pool:
            await pool.wait_filled()
            ahead = await sandbox_ids(client)
            await asyncio.sleep(5.0)
            taken = [await pool.acquire(), await pool.acquire()]
            assert {s.sandbox_id for s in taken} == ahead
            for sandbox in taken:
                assert (await sandbox.exec(["true"])).exit_code == 0
                await sandbox.delete()
            assert pool.lost == 0
        assert await sandbox_ids(client) == set()


async def test_a_handed_out_sandbox_beats_only_with_keepalive_among_the_create_options(reaping_service,
                                                                                        sandbox_ids):
    # Handed out and left unused for 4 s (2 timeouts): the caller's to keep alive, so reaped; with keepalive_s
    # (the client's heartbeat, every 0.5 s) it lives on.
    async with (AsyncSandboxClient(reaping_service.url, reaping_service.api_key) as client,
                AsyncSandboxPool(client, 1) as plain, AsyncSandboxPool(client, 1, keepalive_s=0.5) as kept):
        await asyncio.gather(plain.wait_filled(), kept.wait_filled())
        abandoned, beating = await plain.acquire(), await kept.acquire()
        await asyncio.sleep(4.0)
        assert (beating.sandbox_id in await sandbox_ids(client)
                and abandoned.sandbox_id not in await sandbox_ids(client))
        await beating.delete()


async def test_acquire_never_hands_out_a_sandbox_the_service_no_longer_has(embedded_service, sandbox_ids):
    async with AsyncSandboxClient(embedded_service.url, embedded_service.api_key) as client:

        async def lose(sandbox):  # the service loses it behind the pool's back, as a reap or a restart would
            await client.request("DELETE", f"/sandboxes/{sandbox.sandbox_id}")

        async with AsyncSandboxPool(client, 2) as pool:
            await pool.wait_filled()
            first, second = pool._idle
            await lose(first)
            taken = [await pool.acquire()]
            assert taken[0] is second and pool.lost == 1 and first.deleted  # dropped; the next idle one taken
            await pool.wait_filled()
            for sandbox in list(pool._idle):
                await lose(sandbox)
            taken.append(await pool.acquire())  # both idle ones lost (1 + 2 = 3): one made on the spot
            assert pool.lost == 3 and taken[1].sandbox_id not in {first.sandbox_id, second.sandbox_id}
            for sandbox in taken:
                assert (await sandbox.exec(["true"])).exit_code == 0
                await sandbox.delete()
        assert await sandbox_ids(client) == set()


def test_pool_arguments_are_checked():
    client = AsyncSandboxClient("http://127.0.0.1:9", "k")
    for kwargs, name in (({"size": -1}, "size"), ({"size": True}, "size"), ({"size": 1, "warm_command": "true"},
                         "warm_command"), ({"size": 1, "sandbox_id": "a"}, "sandbox_id")):
        with pytest.raises(ValueError, match=name):
            AsyncSandboxPool(client, **kwargs)
