"""EnginePool: sticky episodes, least-loaded routing, versions on every result, and weight sync that drains first;
then two real `orchard serve-model` replicas on loopback updated from one saved file."""

import asyncio

import pytest
import torch

from orchard.rollout.engine import Completion, GenerateRequest, GenerateResult, SamplingParams
from orchard.rollout.engine_pool import EnginePool


class Echo:
    """Answers prompt ``[..., x]`` with ``[x + 1, x + 2]``; logs starts, ends and updates in one shared list, and
    holds each request until ``gate`` (when given) is set."""

    def __init__(self, name, log, gate=None, fail_update=False):
        self.name, self.log, self.gate, self.fail_update = name, log, gate, fail_update
        self.prompts = []

    async def generate(self, requests):
        (r,) = requests
        self.prompts.append(list(r.prompt_ids))
        self.log.append(("start", self.name))
        if self.gate is not None:
            await self.gate.wait()
        self.log.append(("end", self.name))
        x = r.prompt_ids[-1]
        return [GenerateResult(r.prompt_ids, [Completion([x + 1, x + 2], [-0.5, -0.5], "stop")])]

    async def update_weights(self, weights):
        if self.fail_update:
            raise OSError("cannot read the file")
        self.log.append(("update", self.name, weights))

    async def close(self):
        pass


async def settle():
    """Let every ready task run until it blocks (gather's inner tasks need a few loop turns)."""
    for _ in range(10):
        await asyncio.sleep(0)


def req(*ids):
    return GenerateRequest(list(ids))


def test_turns_of_an_episode_stay_on_their_replica():
    async def main():
        log = []
        pool = EnginePool([Echo(0, log), Echo(1, log)])
        # First turns: equal load, ties broken round-robin -> A on replica 0, B on replica 1.
        await pool.generate([req(1, 2, 3)])
        await pool.generate([req(7, 8, 9)])
        # Turn 2 = turn 1's prompt + its answer + an observation. B's would go to replica 0 by round-robin
        # (third pick), so landing on 1 is stickiness.
        await pool.generate([req(7, 8, 9, 10, 11, 60)])
        await pool.generate([req(1, 2, 3, 4, 5, 50)])
        # Turn 3 continues turn 2 (answer [51, 52]), not turn 1.
        await pool.generate([req(1, 2, 3, 4, 5, 50, 51, 52, 70)])
        return pool

    pool = asyncio.run(main())
    assert pool.engines[0].prompts == [[1, 2, 3], [1, 2, 3, 4, 5, 50], [1, 2, 3, 4, 5, 50, 51, 52, 70]]
    assert pool.engines[1].prompts == [[7, 8, 9], [7, 8, 9, 10, 11, 60]]
    assert pool.served == [3, 2]


def test_new_episodes_go_to_the_least_loaded_replica():
    async def main():
        log, gate = [], asyncio.Event()
        pool = EnginePool([Echo(0, log, gate), Echo(1, log)])
        held = asyncio.create_task(pool.generate([req(1)]))  # replica 0 (tie, first pick), held at the gate
        await settle()
        assert pool.in_flight == [1, 0]
        # Three new episodes, one at a time: replica 1 is idle each time (0 < 1 in flight), whatever the
        # round-robin tie-break would say.
        for x in (10, 20, 30):
            await pool.generate([req(x)])
        gate.set()
        await held
        return pool

    pool = asyncio.run(main())
    assert pool.engines[1].prompts == [[10], [20], [30]] and pool.served == [1, 3]


def test_update_drains_in_flight_requests_and_holds_new_ones():
    async def main():
        log, gate = [], asyncio.Event()
        pool = EnginePool([Echo(0, log, gate), Echo(1, log)])
        old = asyncio.create_task(pool.generate([req(1)]))
        await settle()
        update = asyncio.create_task(pool.update_weights("ckpt/v1"))
        await settle()
        new = asyncio.create_task(pool.generate([req(5)]))
        await settle()
        assert log == [("start", 0)]  # the update waits for the old request; the new one waits for the update
        gate.set()
        (old_result,), _, (new_result,) = await asyncio.gather(old, update, new)
        return log, old_result, new_result, pool

    log, old_result, new_result, pool = asyncio.run(main())
    assert log[:2] == [("start", 0), ("end", 0)]
    assert sorted(log[2:4]) == [("update", 0, "ckpt/v1"), ("update", 1, "ckpt/v1")]
    assert log[4][0] == "start"
    assert (old_result.weight_version, new_result.weight_version, pool.weight_version) == (0, 1, 1)


def test_a_state_dict_is_saved_once_for_every_replica_and_old_files_pruned(tmp_path):
    async def main():
        log = []
        pool = EnginePool([Echo(0, log), Echo(1, log)], save_dir=str(tmp_path), keep_files=1)
        for v in (1.0, 2.0):
            await pool.update_weights({"w": torch.full((2,), v)})
        follower = EnginePool([Echo(0, [])], push_weights=False)
        await follower.update_weights({"w": torch.zeros(2)})
        return log, pool, follower

    log, pool, follower = asyncio.run(main())
    paths = [entry[2] for entry in log]
    # One file per update, the same path to both replicas.
    assert paths[0] == paths[1] and paths[2] == paths[3] and paths[0] != paths[2]
    assert [p.name for p in tmp_path.iterdir()] == ["weights_v000002.pt"]  # keep_files=1
    assert torch.equal(torch.load(paths[2])["w"], torch.full((2,), 2.0))
    assert pool.weight_version == 2
    # A follower (another rank sharing the replicas) sends nothing and saves nothing, but its version follows.
    assert follower.weight_version == 1 and follower.engines[0].log == []


def test_a_replica_that_fails_its_update_leaves_the_rotation():
    async def main():
        log = []
        pool = EnginePool([Echo(0, log, fail_update=True), Echo(1, log)])
        with pytest.warns(RuntimeWarning, match=r"replicas \[0\] failed"):
            await pool.update_weights("ckpt")
        for x in (1, 2, 3):
            await pool.generate([req(x)])
        assert pool.served == [0, 3] and pool.down == {0}
        pool.engines[1].fail_update = True
        with pytest.raises(RuntimeError, match="no replica loaded"):
            await pool.update_weights("ckpt2")
        with pytest.raises(RuntimeError, match="every replica"):
            await pool.generate([req(4)])

    asyncio.run(main())


def test_bad_arguments():
    with pytest.raises(ValueError, match="engines must hold"):
        EnginePool([])
    with pytest.raises(ValueError, match=r"engines\[0\]"):
        EnginePool([object()])
    with pytest.raises(ValueError, match="keep_files"):
        EnginePool([Echo(0, [])], keep_files=0)
    with pytest.raises(ValueError, match="urls"):
        EnginePool.from_urls("http://a")
    with pytest.raises(ValueError, match="save_dir"):
        asyncio.run(EnginePool([Echo(0, [])]).update_weights({"w": torch.zeros(1)}))
    with pytest.raises(ValueError, match="weights"):
        asyncio.run(EnginePool([Echo(0, [])]).update_weights(3))


def test_two_served_replicas_load_the_same_weights(tmp_path, tokenizer):
    from contextlib import ExitStack

    from orchard.rollout.hf_engine import HFEngine
    from orchard.rollout.server import build_app, serve_in_thread
    from orchard.train.tiny import tiny_qwen3

    engines = [HFEngine(tiny_qwen3(tokenizer, seed=0)) for _ in range(2)]
    trained = tiny_qwen3(tokenizer, seed=1)
    weights = {name: p.detach().clone() for name, p in trained.named_parameters()}  # like Trainer.full_state_dict
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=3)

    async def main(urls):
        pool = EnginePool.from_urls(urls, save_dir=str(tmp_path), retries=0)
        try:
            before = await pool.generate([GenerateRequest([1, 2, 3], params), GenerateRequest([4, 5], params)])
            await pool.update_weights(weights)
            after = await pool.generate([GenerateRequest([1, 2, 3], params)])
        finally:
            await pool.close()
        return pool, before, after

    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(build_app(e, tokenizer, allow_weight_updates=True)))
                for e in engines]
        pool, before, after = asyncio.run(main(urls))
    assert pool.served == [2, 1]  # two first turns spread over the replicas, then one more
    assert [r.weight_version for r in before] == [0, 0] and after[0].weight_version == 1
    for engine in engines:
        assert engine.weight_version == 1
        for name, value in weights.items():
            torch.testing.assert_close(engine.model.get_parameter(name), value, rtol=0, atol=0, msg=name)


def test_one_pool_serves_successive_event_loops():
    # A recipe may run evaluation and RL under separate asyncio.run calls with the same pool; each loop here
    # really waits on the pool (an update draining a held request), which binds asyncio primitives to it.
    pool = EnginePool([Echo(0, [])])

    async def update_during_a_request(path):
        pool.engines[0].gate = asyncio.Event()
        held = asyncio.create_task(pool.generate([req(1)]))
        await settle()
        update = asyncio.create_task(pool.update_weights(path))
        await settle()
        pool.engines[0].gate.set()
        await asyncio.gather(held, update)

    asyncio.run(update_during_a_request("v1"))
    asyncio.run(update_during_a_request("v2"))
    assert pool.weight_version == 2
