"""The sandboxes a run uses, against the real embedded service: `PooledSandboxes` serves a stage's rollouts from
its warm pool and leaves no sandbox behind when the stage ends, also when it raises; `sandbox_service` shows the
embedded service's sandboxes the shared folders it was given, and leaves a service by URL as it is."""

from __future__ import annotations

import asyncio

import pytest

from orchard.env import AsyncSandboxClient
from orchard.stages import PooledSandboxes, pooled_sandboxes, sandbox_service


async def test_a_stage_serves_its_pools_sandboxes_and_other_requests_on_the_spot(embedded_service, sandbox_ids):
    async with AsyncSandboxClient(embedded_service.url, embedded_service.api_key) as client:
        sandboxes = PooledSandboxes(client)
        assert sandboxes.base_url == client.base_url and sandboxes.api_key == client.api_key
        async with sandboxes.stage(2) as pool:
            await pool.wait_filled()
            ahead = await sandbox_ids(client)
            # the defaults, and the defaults spelled out (the SWE eval harness asks for image "host"): the pool's
            drawn = [await sandboxes.create(), await sandboxes.create(image="host", block_network=True)]
            assert {s.sandbox_id for s in drawn} == ahead
            named = await sandboxes.create(sandbox_id="named")  # a pool names none of its sandboxes
            other = await sandboxes.create(env={"A": "1"})  # not what the pool makes
            assert named.sandbox_id == "named" and other.sandbox_id not in ahead
            with pytest.raises(RuntimeError, match="do not nest"):
                async with sandboxes.stage(1):
                    pass
        assert sandboxes.pool is None
        outside = await sandboxes.create()  # between stages: the client's
        left = await sandbox_ids(client)
        # the stage's two refills were deleted with it: what is left is what was handed out
        assert left == {s.sandbox_id for s in [*drawn, named, other, outside]}
        for sandbox in [*drawn, named, other, outside]:
            await sandbox.delete()


async def test_a_runs_cap_and_pool_options_shape_every_stages_pool(embedded_service, sandbox_ids, monkeypatch):
    monkeypatch.setenv("SANDBOX_API_KEY", embedded_service.api_key)
    async with pooled_sandboxes(embedded_service.url, max_pool=2, pool_options={"env": {"A": "1"}}) as sandboxes:
        client = sandboxes.client
        async with sandboxes.stage(5) as pool:  # asks for 5, the run allows 2
            await pool.wait_filled()
            assert pool.create_options == {"env": {"A": "1"}} and len(await sandbox_ids(client)) == 2
            ahead = await sandbox_ids(client)
            drawn = await sandboxes.create(env={"A": "1"})  # what the run's episodes ask for: from the pool
            assert drawn.sandbox_id in ahead
            await drawn.delete()
        async with sandboxes.stage(1, image="host") as pool:  # a stage's own options win
            assert pool.create_options == {"image": "host"}
        async with sandboxes.stage(0) as pool:  # 0: every sandbox on the spot
            assert pool.size == 0
    with pytest.raises(ValueError, match="max_pool must be an int >= 0 or None, got -1"):
        PooledSandboxes(client, max_pool=-1)


async def test_a_stage_that_raises_leaves_no_sandbox(embedded_service, sandbox_ids):
    async with AsyncSandboxClient(embedded_service.url, embedded_service.api_key) as client:
        sandboxes = PooledSandboxes(client)
        with pytest.raises(RuntimeError, match="the stage failed"):
            async with sandboxes.stage(3) as pool:
                await pool.wait_filled()
                async with await sandboxes.create():  # a rollout's sandbox: deleted when its episode ends
                    pass
                # the pool is making a replacement now: it is deleted too, once made
                raise RuntimeError("the stage failed")
        assert await sandbox_ids(client) == set()
        assert pool.idle == 0


def test_the_embedded_service_shows_every_sandbox_the_shared_folders():
    filled = []

    def fill(folder):
        filled.append(folder)
        (folder / "tool.txt").write_text("shared\n")

    async def read(url, key):
        async with AsyncSandboxClient(url, key) as client, await client.create() as sandbox:
            cat = await sandbox.exec("cat /.orchard-shared/tools/tool.txt; echo x > /.orchard-shared/tools/new")
            return cat.stdout, cat.exit_code

    with sandbox_service(None, shared={"tools": fill}) as (url, key):
        stdout, code = asyncio.run(read(url, key))
    assert stdout == "shared\n" and code != 0  # read in place, read-only
    assert len(filled) == 1 and not filled[0].exists()  # removed with the service


def test_a_service_by_url_keeps_its_own_shared_folders(monkeypatch):
    monkeypatch.setenv("SANDBOX_API_KEY", "k")

    def fill(folder):
        raise AssertionError("a service by URL is not given folders")

    with sandbox_service("http://127.0.0.1:1", shared={"tools": fill}) as env:
        assert env == ("http://127.0.0.1:1", "k")


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="shared must map names to functions"), \
            sandbox_service(None, shared={"tools": "/srv/tools"}):
        pass
    with pytest.raises(ValueError, match="client must be an AsyncSandboxClient"):
        PooledSandboxes("http://127.0.0.1:1")
