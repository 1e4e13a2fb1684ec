"""SWE episodes in a run's sandboxes (`orchard.stages.pooled_sandboxes` with the domain's `shared_folders` and
`sandbox_options`, as the SWE recipe opens them), against the real embedded service: the service shares the pytest
bundle, read in place by every sandbox; a stage's rollouts (the harness program's episodes) play in its warm pool's
sandboxes; and a stage that raises leaves no sandbox behind on the service."""

from __future__ import annotations

import pytest

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe.generator import make_instance
from orchard.domains.swe.harnesses import swe_harnesses
from orchard.domains.swe.sandbox import prepare_sandbox, sandbox_options, shared_folders
from orchard.domains.swe.teacher import SWETeacherEngine, teacher_trajectories
from orchard.env.embedded import serve
from orchard.stages import pooled_sandboxes


def swe_sandboxes(url=None):
    """The run's sandboxes as the SWE recipe opens them (its default ``env_pool``: 64)."""
    return pooled_sandboxes(url, shared=shared_folders(), max_pool=64, pool_options=sandbox_options())


async def test_the_embedded_service_shares_pytest_with_every_sandbox():
    instance = make_instance("ledger", 0, level=1)
    async with swe_sandboxes() as sandboxes, await sandboxes.create() as sandbox:
        await prepare_sandbox(sandbox, instance)
        where = await sandbox.exec(["python3", "-c", "import pytest; print(pytest.__file__)"])
    # imported from the service's read-only copy, not from one sent into the sandbox
    assert where.exit_code == 0 and where.stdout.startswith("/.orchard-shared/orchard-pytest/pytest-"), where


async def test_the_pools_sandboxes_are_ready_without_a_command():
    instance = make_instance("ledger", 0, level=1)
    async with swe_sandboxes() as sandboxes, sandboxes.stage(2) as pool:
        await pool.wait_filled()
        acquire, drawn, commands = pool.acquire, [], []

        async def counted_acquire():
            drawn.append(1)
            return await acquire()

        pool.acquire = counted_acquire
        for _ in range(2):
            async with await sandboxes.create(**sandbox_options()) as sandbox:
                run = sandbox.exec

                async def counted(*args, _run=run, **kwargs):
                    commands.append(args[0])
                    return await _run(*args, **kwargs)

                sandbox.exec = counted
                await prepare_sandbox(sandbox, instance)
        assert len(drawn) == 2  # the SWE episodes' options are the pool's: both came from it
    # the first prepare probes the image once per service (1 command); the second runs none: the pool's sandboxes
    # carry pytest_env and the repository goes in by the archive upload (without the env: a .pth command each)
    assert len(commands) == 1, commands


async def test_a_stage_plays_in_its_pools_sandboxes_and_leaves_none_when_it_raises(monkeypatch):
    instances = [make_instance("ledger", i, level=1) for i in range(2)]
    tokenizer = build_chat_tokenizer()
    teacher = SWETeacherEngine(tokenizer, instances, failure_rate=0.0)
    with serve() as service:
        monkeypatch.setenv("SANDBOX_API_KEY", service.api_key)
        async with swe_sandboxes(service.url) as sandboxes:  # a service by URL: none started of its own
            harnesses = swe_harnesses(sandboxes, tokenizer, max_steps=12, max_tokens=256, max_time_s=300.0,
                                      concurrency=8)
            drawn = []
            with pytest.raises(RuntimeError, match="the stage failed"):
                async with sandboxes.stage(len(instances)) as pool:
                    acquire = pool.acquire

                    async def counted():
                        drawn.append(1)
                        return await acquire()

                    pool.acquire = counted
                    await pool.wait_filled()
                    trajectories = await teacher_trajectories(harnesses["bash"], teacher, instances, attempts=1)
                    # the program found the pool's sandboxes by their ids, and the careful teacher resolved both
                    assert [t.reward for t in trajectories] == [1.0, 1.0]
                    assert len(drawn) == 2
                    raise RuntimeError("the stage failed")  # while the pool makes the two replacements
            assert await sandboxes.client.list_sandboxes() == []
