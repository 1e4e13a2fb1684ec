import asyncio
import threading

import pytest
import torch

from orchard.rollout.engine import GenerateRequest, SamplingParams, ScoreRequest
from orchard.rollout.hf_engine import HFEngine, nucleus_logprobs
from orchard.rollout.kv_cache import PrefixStore


def _recomputed_logprobs(model, prompt, sampled, temperature):
    """Plain reference: one forward pass over prompt + sampled (no padding, no cache)."""
    ids = torch.tensor([list(prompt) + list(sampled)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [T, V]
    targets = ids[0, len(prompt) :]
    positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    logp = torch.log_softmax(logits[positions] / temperature, dim=-1)
    return logp.gather(1, targets[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
def test_logprobs_equal_forward_pass_under_left_padding(tiny_model, temperature):
    engine = HFEngine(tiny_model, max_batch_size=8)
    gen = torch.Generator().manual_seed(int(temperature * 10))
    # odd, different prompt lengths so rows are left-padded by different amounts
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 5, 13)]
    params = SamplingParams(temperature=temperature, max_tokens=9, seed=3)
    results = asyncio.run(engine.generate([GenerateRequest(p, params) for p in prompts]))
    assert [len(r.completions) for r in results] == [1, 1, 1]
    for prompt, result in zip(prompts, results, strict=True):
        c = result.completions[0]
        assert len(c.token_ids) == len(c.logprobs) == 9 and c.finish_reason == "length"
        ref = _recomputed_logprobs(tiny_model, prompt, c.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-5, rtol=1e-5)


def test_nucleus_logprobs_hand_computed():
    # probabilities 0.5, 0.3, 0.2 (T = 1). Mass strictly above each sorted token: 0, 0.5, 0.8.
    # top_p 0.6 keeps tokens whose mass-above < 0.6 -> {0, 1}; renormalised 0.5/0.8 = 0.625, 0.3/0.8 = 0.375.
    # top_p 0.45 keeps only token 0 (0.5 already reaches 0.45) -> log 1 = 0.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().repeat(3, 1)
    out = nucleus_logprobs(logits, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 0.6, 0.45])).exp()
    torch.testing.assert_close(out[0], torch.tensor([0.5, 0.3, 0.2]))
    torch.testing.assert_close(out[1], torch.tensor([0.625, 0.375, 0.0]))
    torch.testing.assert_close(out[2], torch.tensor([1.0, 0.0, 0.0]))
    # T = 2 on probabilities (0.8, 0.2): tempered ∝ sqrt -> 0.8944/(0.8944+0.4472) = 2/3, 1/3
    tempered = nucleus_logprobs(
        torch.tensor([[0.8, 0.2]]).log(), torch.tensor([2.0]), torch.tensor([1.0])
    ).exp()
    torch.testing.assert_close(tempered[0], torch.tensor([2 / 3, 1 / 3]))


def test_top_p_samples_stay_in_nucleus_and_logprobs_are_renormalised(tiny_model):
    engine = HFEngine(tiny_model)
    prompt = [5, 17, 42, 7]
    params = SamplingParams(temperature=1.3, top_p=0.3, max_tokens=6, seed=11)
    c = asyncio.run(engine.generate([GenerateRequest(prompt, params)]))[0].completions[0]
    full = _recomputed_logprobs(tiny_model, prompt, c.token_ids, 1.3)
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = tiny_model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    ref = nucleus_logprobs(logits, torch.full((6,), 1.3), torch.full((6,), 0.3))
    expected = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.isfinite(expected).all()  # every sampled token lies inside its nucleus
    torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=2e-5, rtol=1e-5)
    assert (
        torch.tensor(c.logprobs) >= full - 1e-6
    ).all()  # renormalising over a subset only raises log-probs


def test_greedy_matches_argmax_and_is_deterministic(tiny_model):
    engine = HFEngine(tiny_model)
    prompt = [9, 8, 7, 6, 5]
    params = SamplingParams(temperature=0.0, max_tokens=7)
    a, b = asyncio.run(engine.generate([GenerateRequest(prompt, params), GenerateRequest(prompt, params)]))
    assert a.completions[0].token_ids == b.completions[0].token_ids
    ids = list(prompt)
    for _ in range(7):  # plain greedy reference without a cache
        with torch.no_grad():
            ids.append(int(tiny_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert a.completions[0].token_ids == ids[len(prompt) :]
    ref = _recomputed_logprobs(tiny_model, prompt, ids[len(prompt) :], 1.0)
    torch.testing.assert_close(torch.tensor(a.completions[0].logprobs), ref, atol=2e-5, rtol=1e-5)


def test_stop_token_ends_sample_and_is_kept(tiny_model):
    engine = HFEngine(tiny_model)
    prompt = [3, 4, 5]
    free = asyncio.run(
        engine.generate([GenerateRequest(prompt, SamplingParams(temperature=0, max_tokens=6))])
    )
    greedy_ids = free[0].completions[0].token_ids
    stop = greedy_ids[2]
    first = greedy_ids.index(stop)
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(stop,))
    c = asyncio.run(engine.generate([GenerateRequest(prompt, params)]))[0].completions[0]
    assert c.token_ids == greedy_ids[: first + 1] and c.finish_reason == "stop"
    assert len(c.logprobs) == len(c.token_ids)


def test_seeds_reproduce_and_n_samples_differ(tiny_model):
    engine = HFEngine(tiny_model)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5, n=3)
    one = asyncio.run(engine.generate([GenerateRequest([1, 2, 3], params)]))[0]
    # same request inside a bigger batch with other rows: same samples (per-row generators)
    other = GenerateRequest([4, 4, 4, 4, 4, 4], SamplingParams(max_tokens=3))
    two = asyncio.run(engine.generate([other, GenerateRequest([1, 2, 3], params)]))[1]
    assert [c.token_ids for c in one.completions] == [c.token_ids for c in two.completions]
    assert len({tuple(c.token_ids) for c in one.completions}) > 1


def _on_every_forward(model, hook):
    """Call ``hook(input_ids)`` at every forward of ``model``, the HF one and the engine's fast decode forward
    alike (both embed through ``model.model.embed_tokens``); returns the hook handle."""
    return model.model.embed_tokens.register_forward_pre_hook(lambda module, args: hook(args[0]))


def _count_forwards(model):
    """Record the ``input_ids`` shape of every forward of ``model``; returns the list and the hook handle."""
    shapes = []
    handle = _on_every_forward(model, lambda ids: shapes.append(tuple(ids.shape)))
    return shapes, handle


def test_concurrent_calls_are_batched(tiny_model):
    engine = HFEngine(tiny_model, max_batch_size=16, batch_wait_s=0.05)
    shapes, handle = _count_forwards(tiny_model)

    async def main():
        calls = [
            engine.generate([GenerateRequest([i + 3, 7], SamplingParams(max_tokens=3, seed=i))])
            for i in range(5)
        ]
        out = await asyncio.gather(*calls)
        await engine.close()
        return out

    try:
        out = asyncio.run(main())
    finally:
        handle.remove()
    # 5 rows of 2-token prompts, 3 tokens each: one prefill [5, 2] samples token 1, two decode steps [5, 1]
    assert shapes == [(5, 2), (5, 1), (5, 1)]
    assert all(len(r[0].completions[0].token_ids) == 3 for r in out)


def test_request_joins_running_batch_and_gets_its_solo_result(tiny_model):
    long_req = GenerateRequest([5, 6, 7, 8, 9], SamplingParams(temperature=1.0, max_tokens=12, seed=1))
    late_req = GenerateRequest([11, 12, 13], SamplingParams(temperature=0.8, max_tokens=4, seed=2))
    solo = [asyncio.run(HFEngine(tiny_model).generate([r]))[0].completions[0] for r in (long_req, late_req)]
    engine = HFEngine(tiny_model, batch_wait_s=0.0)
    release = threading.Event()
    shapes = []

    def hold(ids):
        shapes.append(tuple(ids.shape))
        if len(shapes) == 3:  # the long row's 2nd decode step waits until the late request is queued
            release.wait(timeout=30)

    handle = _on_every_forward(tiny_model, hold)

    async def main():
        first = asyncio.create_task(engine.generate([long_req]))
        while len(shapes) < 3:
            await asyncio.sleep(0.001)
        second = asyncio.create_task(engine.generate([late_req]))
        await asyncio.sleep(0)  # the late call queues its row before its first await
        release.set()
        out = await asyncio.gather(first, second)
        await engine.close()
        return [r[0].completions[0] for r in out]

    try:
        long_c, late_c = asyncio.run(main())
    finally:
        handle.remove()
    # forwards: long prefill [1, 5], decodes [1, 1] x 2 (the 2nd held); then the late prefill [1, 3] joins and the
    # late row's 3 remaining tokens decode alongside the long row ([2, 1] x 3); the long row ends alone:
    # 12 tokens = 1 (prefill) + 2 + 3 + 6 decode steps.
    assert shapes == [(1, 5), (1, 1), (1, 1), (1, 3)] + [(2, 1)] * 3 + [(1, 1)] * 6
    for got, alone, req in zip((long_c, late_c), solo, (long_req, late_req), strict=True):
        assert got.token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0
        )
        ref = _recomputed_logprobs(tiny_model, req.prompt_ids, got.token_ids, req.params.temperature)
        torch.testing.assert_close(torch.tensor(got.logprobs), ref, atol=2e-5, rtol=1e-5)


def test_failed_prefill_fails_its_request_and_spares_the_running_rows(tiny_model):
    engine = HFEngine(tiny_model, batch_wait_s=0.0)
    calls = []

    def fail_on_marker(ids):
        calls.append(tuple(ids.shape))
        if 3 in ids[:, 0].tolist() and ids.shape[1] > 1:
            raise RuntimeError("injected prefill failure")

    good = GenerateRequest([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=10))
    bad = GenerateRequest([3, 9, 9], SamplingParams(temperature=0, max_tokens=4))
    alone = asyncio.run(HFEngine(tiny_model).generate([good]))[0].completions[0]
    handle = _on_every_forward(tiny_model, fail_on_marker)

    async def main():
        first = asyncio.create_task(engine.generate([good]))
        while len(calls) < 2:  # the good row is decoding
            await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError, match="injected"):
            await engine.generate([bad])
        out = await first
        await engine.close()
        return out[0].completions[0]

    try:
        survived = asyncio.run(main())
    finally:
        handle.remove()
    assert survived.token_ids == alone.token_ids and survived.finish_reason == "length"


_TURN_PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=7)


def _two_turns(engine, model, observation, between=None):
    """Turn 1 samples a completion; turn 2's prompt is turn 1's prompt + completion + ``observation``."""
    prompt = [4, 8, 15, 16, 23]
    first = asyncio.run(engine.generate([GenerateRequest(prompt, _TURN_PARAMS)]))[0].completions[0]
    if between is not None:
        between()
    second_prompt = prompt + first.token_ids + observation
    shapes, handle = _count_forwards(model)
    try:
        second = asyncio.run(engine.generate([GenerateRequest(second_prompt, _TURN_PARAMS)]))[0]
    finally:
        handle.remove()
    return second_prompt, second, shapes


def test_prefix_from_previous_turn_is_reused_and_changes_nothing(tiny_model):
    observation = [42, 43, 44, 45]
    prompt, cached, shapes = _two_turns(HFEngine(tiny_model), tiny_model, observation)
    _, uncached, shapes_off = _two_turns(HFEngine(tiny_model, prefix_cache_tokens=0), tiny_model, observation)
    # with the store, turn 1's prompt (5) + its first 5 sampled tokens are cached; turn 2 prefills the 6th sampled
    # token + the 4 observation tokens = 5 columns. Without it the whole 5 + 6 + 4 = 15-token prompt.
    assert len(prompt) == 15 and shapes[0] == (1, 5) and shapes_off[0] == (1, 15)
    got, ref = cached.completions[0], uncached.completions[0]
    assert got.token_ids == ref.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
    forward = _recomputed_logprobs(tiny_model, prompt, got.token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(got.logprobs), forward, atol=2e-5, rtol=1e-5)


def test_update_weights_drops_cached_prefixes(tokenizer):
    from orchard.train.tiny import tiny_qwen3

    model, other = tiny_qwen3(tokenizer, seed=0), tiny_qwen3(tokenizer, seed=1)
    engine = HFEngine(model)

    def update():
        asyncio.run(engine.update_weights(other))

    prompt, after, shapes = _two_turns(engine, model, [42, 43], between=update)
    # the prefix cached under the old weights is not reused: the whole 5 + 6 + 2 = 13-token prompt is prefilled
    assert after.weight_version == 1 and shapes[0] == (1, 13)
    fresh = asyncio.run(HFEngine(other).generate([GenerateRequest(prompt, _TURN_PARAMS)]))[0]
    assert after.completions[0].token_ids == fresh.completions[0].token_ids


def _kv(ids):
    """One layer, one head, head dim 1; the key of a token is its id (enough to see which entry answered)."""
    t = torch.tensor(ids, dtype=torch.float32).reshape(1, len(ids), 1)
    return [(t, t)]


def test_prefix_store_reuses_longest_prefix_within_budget():
    store = PrefixStore(max_tokens=8)
    store.add([1, 2, 3, 4], _kv([1, 2, 3, 4]))
    # [1, 2, 3, 9, 9] shares 3 tokens; [1, 2, 3, 4] shares 4 but its last token must be prefilled -> 3
    assert store.lookup([1, 2, 3, 9, 9])[0] == 3 and store.lookup([1, 2, 3, 4])[0] == 3
    assert store.lookup([7, 1, 2])[0] == 0 and store.lookup([1])[0] == 0
    n, found, key = store.lookup([1, 2, 9])
    assert n == 2 and found[0][0].flatten().tolist() == [1.0, 2.0]
    # the next turn reused [1, 2, 3, 4] and starts with all of it: it replaces it, 6 tokens held, not 4 + 6
    store.add([1, 2, 3, 4, 5, 6], _kv([1, 2, 3, 4, 5, 6]), extends=key)
    assert store.tokens == 6 and store.lookup([1, 2, 3, 4, 5, 6, 7])[0] == 6
    store.add([8, 9, 10], _kv([8, 9, 10]))  # 6 + 3 > 8: the least recently used entry goes
    assert store.tokens == 3 and store.lookup([1, 2, 3, 4])[0] == 0
    store.add(list(range(20, 29)), _kv(list(range(20, 29))))  # alone over the budget: not stored
    assert store.tokens == 3
    store.clear()
    assert store.tokens == 0 and store.lookup([8, 9, 10, 11])[0] == 0


def test_prefix_store_index_finds_the_shared_blocks_among_many_entries():
    gen = torch.Generator().manual_seed(0)
    store = PrefixStore(max_tokens=100_000)
    for _ in range(40):  # 40 unrelated 70-token sequences (ids >= 1000)
        ids = torch.randint(1000, 5000, (70,), generator=gen).tolist()
        store.add(ids, _kv(ids))
    target = list(range(100, 170))
    store.add(target, _kv(target))
    # shares 2 whole 32-token blocks + 5 tokens = 69 tokens with the target, then differs
    prompt = [*target[:69], 7, 7, 7]
    n, found, _ = store.lookup(prompt)
    assert n == 69 and found[0][0].flatten().tolist() == [float(t) for t in target[:69]]


def test_bad_inputs_raise_value_error(tiny_model):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        GenerateRequest([])
    with pytest.raises(ValueError, match="requests"):
        asyncio.run(HFEngine(tiny_model).generate("abc"))
    with pytest.raises(ValueError, match="model"):
        HFEngine("gpt2")
    assert asyncio.run(HFEngine(tiny_model).generate([])) == []


def test_mixed_sampling_params_share_one_batch(tiny_model):
    # one batch holding a greedy row, two tempered rows and an n=2 request, odd prompt lengths, different lengths
    engine = HFEngine(tiny_model, max_batch_size=16)
    specs = [
        ([3, 1, 4], 0.0, 5),
        ([1, 5, 9, 2, 6, 5, 3], 0.5, 7),
        ([5, 8], 1.7, 3),
        ([9, 7, 9, 3, 2], 1.0, 6),
    ]
    requests = [
        GenerateRequest(p, SamplingParams(temperature=t, max_tokens=m, seed=i, n=2 if i == 3 else 1))
        for i, (p, t, m) in enumerate(specs)
    ]
    results = asyncio.run(engine.generate(requests))
    for (prompt, temperature, max_tokens), result in zip(specs, results, strict=True):
        for c in result.completions:
            assert len(c.token_ids) == max_tokens
            ref = _recomputed_logprobs(tiny_model, prompt, c.token_ids, temperature or 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-5, rtol=1e-5)
    greedy = asyncio.run(
        engine.generate([GenerateRequest(specs[0][0], SamplingParams(temperature=0, max_tokens=5))])
    )
    assert results[0].completions[0].token_ids == greedy[0].completions[0].token_ids
    assert len(results[3].completions) == 2


def _forward_logprobs(model, prompt, completion):
    """log_softmax of one plain forward over prompt + completion, at the completion tokens."""
    ids = torch.tensor([[*prompt, *completion]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [len(completion), V]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_score_equals_a_forward_pass_per_sequence(tiny_model):
    # odd prompt and completion lengths, left-padded together; max_batch_size 2 splits 3 requests into 2 passes
    requests = [
        ScoreRequest([5, 6, 7], [8, 9]),
        ScoreRequest([3], [4, 5, 6, 7, 8]),
        ScoreRequest([1, 2, 3, 4, 5, 6, 7], [9]),
    ]
    engine = HFEngine(tiny_model, max_batch_size=2)
    scores = asyncio.run(engine.score(requests))
    for request, got in zip(requests, scores, strict=True):
        want = _forward_logprobs(tiny_model, request.prompt_ids, request.completion_ids)
        assert got == pytest.approx(want, abs=1e-5)
    assert asyncio.run(engine.score([])) == []


def test_score_waits_for_an_earlier_weight_update(tokenizer):
    from orchard.train.tiny import tiny_qwen3

    engine = HFEngine(tiny_qwen3(tokenizer, seed=0))
    other = tiny_qwen3(tokenizer, seed=5)

    async def main():
        update = asyncio.ensure_future(engine.update_weights(other.state_dict()))
        await asyncio.sleep(0)  # the update is queued before the score
        got = await engine.score([ScoreRequest([4, 2], [7, 1, 3])])
        await update
        return got

    [got] = asyncio.run(main())
    assert got == pytest.approx(_forward_logprobs(other, [4, 2], [7, 1, 3]), abs=1e-5)


def test_score_bad_inputs_raise_value_error(tiny_model):
    with pytest.raises(ValueError, match="completion_ids"):
        ScoreRequest([1], [])
    with pytest.raises(ValueError, match="prompt_ids"):
        ScoreRequest([], [1])
    with pytest.raises(ValueError, match="prompt_ids"):
        ScoreRequest([-1], [1])
    with pytest.raises(ValueError, match=r"requests\[0\]"):
        asyncio.run(HFEngine(tiny_model).score([([1], [2])]))
