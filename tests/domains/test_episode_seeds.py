"""The program-driven runners (the Claw text harness, the SWE harness conventions) seed each episode's proxy
session by its task id and place in the group, so a program that sends no seed still plays the episodes one
process would; an unseeded run seeds no session."""

import asyncio

import pytest

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.claw.tasks import make_task
from orchard.domains.claw.text_rollout import run_text_episodes
from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.tool_rollout import run_swe_episodes
from orchard.env.errors import SandboxError
from orchard.rollout import derive_seed
from orchard.rollout.proxy import RecordingProxy
from orchard.rollout.scripted import ScriptedEngine


class SeedSpy(RecordingProxy):
    """A proxy that keeps every `seed_session` call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seeded: dict[str, int] = {}

    def seed_session(self, session_id, seed):
        super().seed_session(session_id, seed)
        self.seeded[session_id] = seed


class NoSandboxes:
    """A sandbox service whose every create fails at once (the episodes end as env_error, unplayed)."""

    base_url, api_key = "http://127.0.0.1:9", "k"

    async def create(self, **_):
        raise SandboxError("no sandboxes here")


INSTANCES = [SWEInstance(f"toy__calc-{i}", "toy/calc", "0" * 40, "bug", "p", "", ["t.py::a"], [],
                         files={"a.py": "x = 1\n"}) for i in (1, 2)]


@pytest.mark.parametrize("runner", ["claw", "swe"])
def test_each_episode_session_is_seeded_by_task_and_group_index(runner):
    tokenizer = build_chat_tokenizer()
    tasks = [make_task("add_event", 1), make_task("set_stock", 2)] if runner == "claw" else INSTANCES
    ids = [t.id for t in tasks] if runner == "claw" else [t.instance_id for t in tasks]
    play = run_text_episodes if runner == "claw" else run_swe_episodes

    def run(seed):
        proxy = SeedSpy(ScriptedEngine(tokenizer, ["unused"]), tokenizer)

        async def main():
            try:
                return await play(tasks, client=NoSandboxes(), proxy=proxy, group_size=2, run_id="r", seed=seed)
            finally:
                await proxy.aclose()

        episodes = asyncio.run(main())
        assert [e.termination_reason for e in episodes] == ["env_error"] * 4
        return proxy.seeded

    # episode i is session f"r-{i}": task i // 2, group index i % 2
    assert run(6) == {f"r-{i}": derive_seed(6, ids[i // 2], i % 2) for i in range(4)}
    assert run(None) == {}
    with pytest.raises(ValueError, match="seed"):
        run(1.5)
