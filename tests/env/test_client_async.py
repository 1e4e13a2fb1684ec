"""The asyncio client against the real service under load: 200 concurrent execs over 50 sandboxes."""

from __future__ import annotations

import asyncio

import pytest

from orchard.env import AsyncSandboxClient
from orchard.env.embedded import serve


@pytest.mark.slow
async def test_200_concurrent_execs_over_50_sandboxes_all_succeed():
    with serve() as (url, key):
        async with AsyncSandboxClient(url, key) as client:
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
