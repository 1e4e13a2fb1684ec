import asyncio
import inspect

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from orchard.rollout import fast_decode
from orchard.rollout.engine import GenerateRequest, SamplingParams
from orchard.rollout.fast_decode import DecodeForward, unsupported_reason
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.kv_cache import BatchCache, prefill_inputs
from orchard.train.tiny import tiny_qwen3

VOCAB = 300
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _randomized(model, seed):
    """Weights far from the HF init (std 0.02, unit norms, zero biases), so that attention, rotary, norm scales
    and biases all move the logits: a term left out shows up well above the tolerance."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model.float().eval()


def _model(kind, seed=0):
    if kind == "qwen3":
        return _randomized(tiny_qwen3(VOCAB, seed=seed, head_dim=16, **SHAPE), seed)
    if kind == "qwen3_gqa3":  # head_dim 24 != hidden / heads, 3 query heads per KV head, non-default rope theta
        shape = {**SHAPE, "num_attention_heads": 6, "head_dim": 24, "rope_theta": 12345.0}
        return _randomized(tiny_qwen3(VOCAB, seed=seed, **shape), seed)
    if kind == "qwen2":  # q, k, v projections with bias
        return _randomized(Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, **SHAPE)), seed)
    if kind == "llama":  # biases everywhere, untied lm head
        config = LlamaConfig(vocab_size=VOCAB, attention_bias=True, mlp_bias=True, head_dim=16, **SHAPE)
        return _randomized(LlamaForCausalLM(config), seed)
    config = MistralConfig(vocab_size=VOCAB, sliding_window=None, head_dim=16, **SHAPE)
    return _randomized(MistralForCausalLM(config), seed)


def _prefill(model, prompts):
    """Prefill ``prompts`` (left-padded together) on the model's own forward into a `BatchCache`."""
    inputs = prefill_inputs(model.config, [None] * len(prompts), prompts, 0, torch.device("cpu"))
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(
            input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids,
            use_cache=True, **{kwarg: inputs.cache.hf_cache(model.config)},
        )
    inputs.cache.advance(inputs.input_ids.shape[1])
    return inputs.cache


def _step(decode, cache, seqs, tokens):
    """Feed ``tokens`` (one per row) through the fast forward; append them to ``seqs``; return the logits."""
    cache.reserve(1)
    cache.mask[:, cache.length] = 1
    positions = torch.tensor([len(s) for s in seqs])
    with torch.no_grad():
        logits = decode(torch.tensor(tokens), positions, cache)
    cache.advance(1)
    for seq, token in zip(seqs, tokens, strict=True):
        seq.append(token)
    return logits


def _reference(model, seqs):
    """Plain reference: the next-token logits of each sequence alone, one forward, no cache, no padding."""
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([s])).logits[0, -1] for s in seqs])


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_gqa3", "qwen2", "llama", "mistral"])
def test_fast_forward_equals_the_hf_forward_as_rows_join_and_leave(kind):
    torch.manual_seed(0)
    model = _model(kind)
    assert unsupported_reason(model) is None
    decode = DecodeForward(model)
    gen = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    # odd, different prompt lengths: rows are left-padded by 12, 8 and 0 columns
    seqs = [tokens(1), tokens(5), tokens(13)]
    cache = _prefill(model, seqs)
    for _ in range(3):
        logits = _step(decode, cache, seqs, tokens(len(seqs)))
        ref = _reference(model, seqs)
        assert ref.abs().max() > 1  # the logits are not all near 0: the tolerance below means something
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    # the longest row leaves (the columns only it used go), two rows join (one longer than every row in the batch)
    cache.select([1, 0])
    seqs = [seqs[1], seqs[0]]
    joining = [tokens(2), tokens(30)]
    cache.extend(_prefill(model, joining))
    seqs += joining
    for _ in range(3):
        logits = _step(decode, cache, seqs, tokens(len(seqs)))
        torch.testing.assert_close(logits, _reference(model, seqs), atol=1e-5, rtol=1e-5)
    # a row's cache copied out (for the prefix store) is the cache of its 2 + 3 tokens prefilled alone
    alone = _prefill(model, [seqs[2]])
    for (k, v), (k_ref, v_ref) in zip(cache.row_kv(2), alone.row_kv(0), strict=True):
        assert k.shape == (2, 5, 24 if kind == "qwen3_gqa3" else 16)  # [Hkv, T, D]
        torch.testing.assert_close((k, v), (k_ref, v_ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,sdpa_gqa", [("qwen3", True), ("qwen3_gqa3", True), ("qwen3_gqa3", False),
                                           ("qwen2", True), ("llama", True), ("mistral", True)])
def test_fast_prefill_equals_the_hf_prefill_with_and_without_a_reused_prefix(kind, sdpa_gqa, monkeypatch):
    # sdpa_gqa=False: the path of torch < 2.5 (no enable_gqa), the query heads of a KV head along the query axis
    monkeypatch.setattr(fast_decode, "_SDPA_GQA", sdpa_gqa)
    model = _model(kind)
    decode = DecodeForward(model)
    gen = torch.Generator().manual_seed(2)

    def tokens(n):
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    # two stored sequences of 4 and 9 tokens; rows: 4 reused + 3 new, 6 new, 9 reused + 1 new, 1 new. The layout is
    # 9 prefix columns then 6 new ones, so row 0 has 5 padding columns between its prefix and its new tokens
    firsts = [tokens(4), tokens(9)]
    stored = [_prefill(model, [seq]).row_kv(0) for seq in firsts]
    prefixes, suffixes = [stored[0], None, stored[1], None], [tokens(3), tokens(6), tokens(1), tokens(1)]
    seqs = [firsts[0] + suffixes[0], suffixes[1], firsts[1] + suffixes[2], suffixes[3]]
    both = [prefill_inputs(model.config, prefixes, suffixes, 0, torch.device("cpu")) for _ in range(2)]
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        hf = both[0]
        hf_logits = model(
            input_ids=hf.input_ids, attention_mask=hf.attention_mask, position_ids=hf.position_ids,
            use_cache=True, **{kwarg: hf.cache.hf_cache(model.config)},
        ).logits[:, -1]
        fast = both[1]
        logits = decode.prefill(fast.input_ids, fast.attention_mask, fast.position_ids, fast.cache)
    for inputs in both:
        inputs.cache.advance(6)
    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, _reference(model, seqs), atol=1e-5, rtol=1e-5)
    for b in range(4):  # every real column holds the HF prefill's keys and values
        torch.testing.assert_close(fast.cache.row_kv(b), hf.cache.row_kv(b), atol=1e-5, rtol=1e-5)
    # the padding columns hold finite keys and values, which the next decode step masks
    assert all(t.isfinite().all() for t in (*fast.cache.keys, *fast.cache.values))
    logits = _step(decode, fast.cache, seqs, tokens(4))
    torch.testing.assert_close(logits, _reference(model, seqs), atol=1e-5, rtol=1e-5)


def test_buffers_grow_past_their_first_capacity():
    model = _model("qwen3")
    decode = DecodeForward(model)
    seqs = [[5, 6, 7], [9]]
    cache = _prefill(model, seqs)
    first = cache.capacity  # 3 prompt columns + 64 spare = 67
    assert first == 67
    for t in range(70):  # 3 + 70 = 73 columns: the buffers grow once, at the 65th step
        logits = _step(decode, cache, seqs, [t % 50 + 1, t % 7 + 1])
        if t % 23 == 0 or t == 69:
            torch.testing.assert_close(logits, _reference(model, seqs), atol=1e-5, rtol=1e-5)
    assert cache.length == 73 and cache.capacity > first


def test_batch_cache_keeps_its_columns_when_it_grows_and_rows_move():
    # one layer, one head, head dim 1; the key of column c of row b is 10 * b + c (values: its negative)
    def written(rows, columns):
        cache = BatchCache(torch.zeros(rows, columns, dtype=torch.long), 0, [None], [None])
        for c in range(columns):
            k = torch.tensor([[[[10.0 * b + c]]] for b in range(rows)])  # [B, 1, 1, 1]
            cache.write(0, k, -k)
            cache.advance(1)
        cache.mask[:] = 1
        return cache

    cache = written(rows=2, columns=3)  # capacity 3, full
    cache.reserve(1)  # grows to 3 + 1 + 64 spare = 68 columns; the 3 written ones stay
    assert cache.capacity == 68 and cache.length == 3
    assert cache.row_kv(1)[0][0].flatten().tolist() == [10.0, 11.0, 12.0]
    other = written(rows=1, columns=1)
    cache.extend(other)  # its 1 column is padded on the left to 3
    assert cache.mask.tolist()[2][:3] == [0, 0, 1] and cache.row_kv(2)[0][1].flatten().tolist() == [-0.0]
    cache.select([2])  # only the joined row stays: its 2 padding columns go
    assert cache.length == 1 and cache.row_kv(0)[0][0].flatten().tolist() == [0.0]
    with pytest.raises(ValueError, match="reserved"):
        cache.write(0, torch.zeros(1, 1, 70, 1), torch.zeros(1, 1, 70, 1))


def _generate(engine, requests):
    async def main():
        out = await engine.generate(requests)
        await engine.close()
        return [c for r in out for c in r.completions]

    return asyncio.run(main())


_REQUESTS = [
    GenerateRequest([3, 1, 4], SamplingParams(temperature=1.0, max_tokens=12, seed=1)),
    GenerateRequest([2, 7, 1, 8, 2, 8, 1], SamplingParams(temperature=0.7, max_tokens=9, seed=2, n=2)),
    GenerateRequest([9], SamplingParams(temperature=0.0, max_tokens=11)),
]


def test_engine_samples_the_same_with_and_without_fast_decode(tiny_model):
    fast = _generate(HFEngine(tiny_model, fast_decode=True), _REQUESTS)
    plain = _generate(HFEngine(tiny_model, fast_decode=False), _REQUESTS)
    for a, b in zip(fast, plain, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_engine_prefills_and_decodes_without_the_model_forward(tiny_model):
    calls = []
    handle = tiny_model.register_forward_pre_hook(lambda module, args: calls.append(module))
    try:
        completions = _generate(HFEngine(tiny_model), _REQUESTS)
    finally:
        handle.remove()
    # 4 rows prefilled, 12 + 9 + 9 + 11 tokens sampled, and not one call of the HF forward
    assert [len(c.token_ids) for c in completions] == [12, 9, 9, 11] and calls == []


def _before_and_after_update(engine, requests, other):
    """The engine's completions of ``requests``, then again after `update_weights` to ``other``'s weights."""

    async def main():
        before = await engine.generate(requests)
        await engine.update_weights(other)
        after = await engine.generate(requests)
        await engine.close()
        return [[c for r in out for c in r.completions] for out in (before, after)]

    return asyncio.run(main())


def test_update_weights_changes_what_the_fast_forward_computes():
    model, other = _model("qwen3", seed=0), _model("qwen3", seed=1)
    before, after = _before_and_after_update(HFEngine(model, fast_decode=True), _REQUESTS, other)
    want = _generate(HFEngine(other, fast_decode=False), _REQUESTS)
    assert [c.token_ids for c in before] != [c.token_ids for c in want]
    for a, b in zip(after, want, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_unsupported_models_decode_on_the_hf_forward(overrides, reason):
    model = _randomized(tiny_qwen3(VOCAB, seed=0, head_dim=16, **SHAPE, **overrides), 0)
    assert reason in unsupported_reason(model)
    with pytest.raises(ValueError, match=f"fast_decode.*{reason}"):
        HFEngine(model, fast_decode=True)
    shapes = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        auto = _generate(HFEngine(model), _REQUESTS[:1])
    finally:
        handle.remove()
    # the prefill [1, 3] and 11 decode steps [1, 1] all ran the model's own forward
    assert shapes == [(1, 3)] + [(1, 1)] * 11
    assert [c.token_ids for c in auto] == [c.token_ids for c in _generate(HFEngine(model, fast_decode=False),
                                                                         _REQUESTS[:1])]


def test_fast_decode_argument_is_validated(tiny_model):
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="fast_decode"):
            HFEngine(tiny_model, fast_decode=bad)
    with pytest.raises(ValueError, match="not supported"):
        DecodeForward(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="compiled"):
        DecodeForward(tiny_model, compiled=1)
    with pytest.raises(ValueError, match="compile_decode"):
        HFEngine(tiny_model, compile_decode="yes")
    with pytest.raises(ValueError, match="compile_decode=True needs the fast decode forward: fast_decode is False"):
        HFEngine(tiny_model, fast_decode=False, compile_decode=True)
    gelu = _randomized(tiny_qwen3(VOCAB, seed=0, head_dim=16, **SHAPE, hidden_act="gelu"), 0)
    with pytest.raises(ValueError, match="compile_decode=True needs the fast decode forward: hidden_act"):
        HFEngine(gelu, compile_decode=True)


def _graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_step_equals_the_eager_step_without_a_compile_per_step():
    # the compiled graph of this model's structure may exist already (another test compiled it): at most one more
    model, other = _model("qwen3"), _model("qwen3", seed=1)
    eager, compiled = DecodeForward(model), DecodeForward(model, compiled=True)
    graphs = _graphs()
    gen = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    seqs = [tokens(1), tokens(5), tokens(13)]
    caches = [_prefill(model, seqs), _prefill(model, seqs)]

    def both_steps(new):
        eager_logits = _step(eager, caches[0], [list(s) for s in seqs], new)
        return eager_logits, _step(compiled, caches[1], seqs, new)

    # The batch shrinks to 2 rows (select), grows to 4 (extend) and the buffers grow, all without a new graph:
    # 13 prompt columns + 20 steps = 33; select keeps all 33 (row 2 has no padding) in 33 + 64 = 97; extend lays
    # out 43 + 64 = 107 columns at step 30; 100 steps end at 13 + 100 = 113 columns, so `reserve` grew them once.
    for t in range(100):
        if t == 20:
            for cache in caches:
                cache.select([2, 0])
            seqs = [seqs[2], seqs[0]]
        if t == 30:
            joining = [tokens(2), tokens(30)]
            for cache in caches:
                cache.extend(_prefill(model, joining))
            seqs += joining
        eager_logits, compiled_logits = both_steps(tokens(len(seqs)))
        assert eager_logits.abs().max() > 1
        torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert caches[1].length == 113 and caches[1].capacity > 107
    # every key and value the compiled step wrote (it writes them after its graph) is the eager step's
    for layer in range(2):
        for mine, theirs in ((caches[1].keys, caches[0].keys), (caches[1].values, caches[0].values)):
            torch.testing.assert_close(mine[layer], theirs[layer], atol=1e-5, rtol=1e-5)
    # new weights copied into the model's parameters (as `update_weights` does) reach the compiled step; also with
    # one row of one cached token (sizes of 1, which dynamo would specialize unless told not to)
    model.load_state_dict(other.state_dict())
    for rows in (seqs, [tokens(1)]):
        logits = _step(compiled, _prefill(model, rows), rows, tokens(len(rows)))
        torch.testing.assert_close(logits, _reference(other, rows), atol=1e-4, rtol=1e-4)
    assert _graphs() - graphs <= 1
    assert _graphs() >= 1  # a graph exists: the compiled step did not silently run eager


def test_engine_with_compile_decode_samples_as_the_eager_engine_and_follows_weight_updates():
    model, other = _model("qwen3", seed=0), _model("qwen3", seed=1)
    # greedy rows of 40 and 25 tokens: the batch shrinks to one row after 25 steps
    greedy = [GenerateRequest([3, 1, 4], SamplingParams(temperature=0.0, max_tokens=40)),
              GenerateRequest([2, 7, 1, 8], SamplingParams(temperature=0.0, max_tokens=25))]
    engine = HFEngine(model, compile_decode=True)
    assert _graphs() >= 1  # compiled when built (warm_up), before any request
    before, after = _before_and_after_update(engine, greedy, other)
    for got, weights in ((before, _model("qwen3", seed=0)), (after, other)):
        want = _generate(HFEngine(weights), greedy)
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    assert [len(c.token_ids) for c in after] == [40, 25]
    assert [c.token_ids for c in before] != [c.token_ids for c in after]
