"""Seeded rollouts: an episode samples from its own seed (run seed, task id, place in the group), so a run split
into blocks of tasks (ranks) plays exactly the episodes of one call over every task, through the agent loop and
through the recording proxy alike."""

import asyncio

import httpx
import pytest

from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout import AgentLoopRollouts, RecordingProxy, derive_seed
from orchard.rollout.harness import ShellHarness
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.scripted import ScriptedEngine

FAST = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)


class SeedLog:
    """Wraps an engine and keeps every request's seed, in arrival order."""

    def __init__(self, inner):
        self.inner, self.seeds = inner, []

    async def generate(self, requests):
        self.seeds.extend(r.params.seed for r in requests)
        return await self.inner.generate(requests)

    async def update_weights(self, weights):
        await self.inner.update_weights(weights)


@pytest.fixture(scope="module")
def service():
    with serve() as svc:
        yield svc


def test_derive_seed_is_a_stable_hash_of_its_parts():
    assert derive_seed(3, "a", 1) == derive_seed(3, "a", 1)
    values = {derive_seed(3, "a", 1), derive_seed(3, "a1"), derive_seed(3, "a", "1"), derive_seed(4, "a", 1),
              derive_seed(3, 1, "a"), derive_seed(3)}
    assert len(values) == 6  # order, type and grouping of the parts all count
    assert all(0 <= v < 2**63 for v in values)
    for bad, name in (((1.5,), "seed"), ((True,), "seed"), ((1, 2.0), "parts"), ((1, None), "parts")):
        with pytest.raises(ValueError, match=name):
            derive_seed(*bad)


def _play(service, tokenizer, engine, tasks, *, seed):
    async def main():
        async with AsyncSandboxClient(service.url, service.api_key, retry=FAST) as client:
            rollouts = AgentLoopRollouts(client, ShellHarness(), tokenizer, max_tokens=12, start_jitter_s=0.0,
                                         max_steps=2, concurrency=4)
            return await rollouts(engine, tasks, group_size=2, temperature=1.0, seed=seed)

    return asyncio.run(main())


def _sampled(traj):
    return [m.token_ids for m in traj.messages if m.role == "assistant"]


def test_a_task_plays_the_same_episodes_alone_or_beside_others(service, tokenizer, tiny_model):
    # A real model sampling at temperature 1 in batches of different make-up: one call over tasks a, b, c (one
    # process) against b alone and then a, c (two ranks' blocks). Seeded, every task's episodes are the same.
    engine = HFEngine(tiny_model, max_batch_size=8)
    tasks = [{"id": t, "prompt": f"Task {t}: list the files."} for t in "abc"]
    together = _play(service, tokenizer, engine, tasks, seed=7)
    split = _play(service, tokenizer, engine, tasks[1:2], seed=7) + _play(service, tokenizer, engine,
                                                                         [tasks[0], tasks[2]], seed=7)
    by_task = {(t.task_id, k): _sampled(t) for k, t in enumerate(together)}
    blocks = {}
    for traj in split:
        blocks.setdefault(traj.task_id, []).append(_sampled(traj))
    for k, traj in enumerate(together):
        assert _sampled(traj) == blocks[traj.task_id][k % 2], (traj.task_id, k)
    # ... and the seed decides: the two members of a group differ, another run seed gives other episodes.
    assert by_task[("a", 0)] != by_task[("a", 1)]
    other = _play(service, tokenizer, engine, tasks[:1], seed=8)
    assert [_sampled(t) for t in other] != [by_task[("a", 0)], by_task[("a", 1)]]


def test_turn_k_of_episode_j_samples_with_its_derived_seed(service, tokenizer):
    # Two turns an episode (a tool call, then an answer), 2 episodes of task "t": the engine sees exactly
    # derive_seed(derive_seed(5, "t", j), k); unseeded, it sees no seed at all.
    def answer(text):
        return "Done." if "<|im_start|>tool" in text else \
            '<tool_call>\n{"name": "exec", "arguments": {"command": "true"}}\n</tool_call>'

    log = SeedLog(ScriptedEngine(tokenizer, answer))
    _play(service, tokenizer, log, [{"id": "t", "prompt": "Task t"}], seed=5)
    expected = {derive_seed(derive_seed(5, "t", j), k) for j in range(2) for k in range(2)}
    assert len(log.seeds) == 4 and set(log.seeds) == expected
    log.seeds.clear()
    _play(service, tokenizer, log, [{"id": "t", "prompt": "Task t"}], seed=None)
    assert log.seeds == [None] * 4


def test_a_seeded_proxy_session_seeds_each_call_and_keeps_a_clients_own_seed(tokenizer):
    log = SeedLog(ScriptedEngine(tokenizer, lambda _: "ok"))
    proxy = RecordingProxy(log, tokenizer)
    proxy.seed_session("s", 11)
    body = {"model": "orchard", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def main():
        transport = httpx.ASGITransport(app=proxy.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            for session, extra in (("s", {}), ("s", {}), ("s", {"seed": 5}), ("s", {}), ("free", {})):
                r = await http.post(f"/sessions/{session}/v1/chat/completions", json={**body, **extra})
                assert r.status_code == 200, r.text
            proxy.pop_session("s")  # the id is free again: a new episode under it is not seeded by the old one
            r = await http.post("/sessions/s/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        await proxy.aclose()

    asyncio.run(main())
    # call k of "s" gets derive_seed(11, k) unless it brings its own (call 2 keeps 5, and still counts);
    # a session nobody seeded forwards no seed, nor does "s" once popped.
    assert log.seeds == [derive_seed(11, 0), derive_seed(11, 1), 5, derive_seed(11, 3), None, None]
    with pytest.raises(ValueError, match="seed"):
        proxy.seed_session("s", 1.5)
    with pytest.raises(ValueError, match="session_id"):
        proxy.seed_session("", 1)
