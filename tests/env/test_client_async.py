"""The asyncio client against the real service: files, patches, the PTY, and load (200 concurrent execs over
50 sandboxes)."""

from __future__ import annotations

import asyncio
import os

import pytest

from orchard.env import AsyncSandboxClient, NotFoundError, PathError
from orchard.env.embedded import serve


@pytest.fixture(scope="module")
def service():
    with serve() as svc:
        yield svc


async def test_async_files_patch_pty_and_jobs(service, tmp_path):
    async with AsyncSandboxClient(service.url, service.api_key) as client, await client.create() as sb:
        blob = os.urandom(1001)
        assert await sb.upload("/workspace/a/b.bin", blob) == 1001
        assert await sb.download("a/b.bin") == blob
        local = tmp_path / "in.txt"
        local.write_text("one\n")
        await sb.upload_file(local, "f.txt")
        assert await sb.download_file("f.txt", tmp_path / "out.txt") == 4
        assert (tmp_path / "out.txt").read_text() == "one\n"
        assert {e.name for e in await sb.list_files()} == {"a", "f.txt"}
        with pytest.raises(PathError):
            await sb.download("../../etc/passwd")
        with pytest.raises(NotFoundError):
            await sb.download("nope")
        patch = "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1,2 @@\n one\n+two\n"
        assert (await sb.apply_patch(patch)).success
        assert await sb.download("f.txt") == b"one\ntwo\n"
        job = await sb.exec(["sh", "-c", "sleep 0.2; echo late"], wait=False)
        assert (await sb.get_job(job.job_id)).status in ("queued", "running")
        assert (await sb.wait_job(job.job_id, 30)).stdout == "late\n"
        assert (await sb.resources())["disk_bytes"] >= 1001 + 8
        await sb.heartbeat()
        proc = await sb.pty(["bash", "--norc", "--noprofile"], cwd="/workspace/a", env={"WHO": "async"})
        async with proc:
            await proc.write("echo $WHO-$(pwd)\n")
            out = await proc.read_until(b"async-/workspace/a", timeout=20)
            assert b"async-/workspace/a" in out
            await proc.write("exit 3\n")
            assert await proc.wait(timeout=20) == 3


@pytest.mark.slow
async def test_200_concurrent_execs_over_50_sandboxes_all_succeed(service):
    async with AsyncSandboxClient(service.url, service.api_key) as client:
        sandboxes = await asyncio.gather(*(client.create() for _ in range(50)))
        assert len({sb.sandbox_id for sb in sandboxes}) == 50

        async def run(i: int):
            sb = sandboxes[i % 50]
            return i, await sb.exec(f"echo {i} >> seen.txt; echo {i}")

        results = await asyncio.gather(*(run(i) for i in range(200)))
        assert all(r.ok and r.stdout == f"{i}\n" for i, r in results), [r for _, r in results if not r.ok][:3]
        # every sandbox saw exactly its four commands, once each
        for k, sb in enumerate(sandboxes):
            seen = sorted(int(x) for x in (await sb.download("seen.txt")).split())
            assert seen == [k, k + 50, k + 100, k + 150]
        summary = await client.resources()
        assert summary["sandboxes"] == 50 and summary["running_execs"] == 0 and summary["queued_execs"] == 0
        await asyncio.gather(*(sb.delete() for sb in sandboxes))
        assert await client.list_sandboxes() == []
