"""The model server against what an OpenAI / vLLM client expects: validation, seeds, end of text, streaming.

Real uvicorn on loopback, the official `openai` client.
"""

import asyncio
import json

import httpx
import openai
import pytest

from orchard.rollout.engine import Completion, GenerateRequest, GenerateResult, SamplingParams, choice_seed
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.scripted import ScriptedEngine
from orchard.rollout.server import build_app, serve_in_thread

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "exec",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
USER = [{"role": "user", "content": "List files."}]
CALL_TEXT = 'Let me see.\n<tool_call>\n{"name": "exec", "arguments": {"command": "ls -la"}}\n</tool_call>'


class ListEngine:
    """Answers every request with the same token list, honouring ``stop_token_ids`` and ``max_tokens`` as a real
    engine does (log-prob of token ``k``: ``-0.1 * (k + 1)``); records the requests; streams with
    ``generate_stream`` when ``streams``."""

    def __init__(self, tokens, streams=False):
        self.tokens = list(tokens)
        self.requests = []
        if streams:
            self.generate_stream = self._stream

    def _sample(self, params):
        ids = []
        for t in self.tokens[: params.max_tokens]:
            ids.append(t)
            if t in params.stop_token_ids:
                return Completion(ids, [-0.1 * (k + 1) for k in range(len(ids))], "stop")
        return Completion(ids, [-0.1 * (k + 1) for k in range(len(ids))], "length")

    async def generate(self, requests):
        self.requests += list(requests)
        return [GenerateResult(tuple(r.prompt_ids), [self._sample(r.params)] * r.params.n) for r in requests]

    async def _stream(self, request):
        self.requests.append(request)
        completion = self._sample(request.params)
        for t, lp in zip(completion.token_ids, completion.logprobs, strict=True):
            await asyncio.sleep(0)
            yield t, lp

    async def update_weights(self, weights):
        pass

    async def close(self):
        pass


@pytest.fixture(scope="module")
def tiny_server(tokenizer, tiny_model):
    with serve_in_thread(build_app(HFEngine(tiny_model), tokenizer, model_name="tiny")) as url:
        yield url


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_model_must_be_the_served_one(tiny_server):
    client = _client(tiny_server)
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    r = httpx.post(f"{tiny_server}/v1/completions", json={"prompt": "hi", "max_tokens": 2})  # no model at all
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_context_length_and_seed_range_are_400(tiny_server, tiny_model):
    client = _client(tiny_server)
    assert tiny_model.config.max_position_embeddings == 4096
    with pytest.raises(openai.BadRequestError, match="context length is 4096"):  # 21000 + 16 > 4096
        client.completions.create(model="tiny", prompt=[5] * 21000)
    with pytest.raises(openai.BadRequestError, match="context length is 4096"):  # a 21K-token message
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a " * 21000}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=[5, 6], max_tokens=10**9)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # 4090 + 7 = 4097 > 4096
        client.completions.create(model="tiny", prompt=[5] * 4090, max_tokens=7)
    # exactly full: 4090 + 6 = 4096 fits; without max_tokens the default 16 is cut to the 6 tokens left
    assert client.completions.create(model="tiny", prompt=[5] * 4090, max_tokens=6).choices[0].finish_reason
    out = client.completions.create(model="tiny", prompt=[5] * 4090, temperature=0, extra_body={"ignore_eos": True})
    assert len(out.choices[0].model_extra["token_ids"]) == 6
    with pytest.raises(openai.BadRequestError, match="seed") as err:
        client.completions.create(model="tiny", prompt=[5, 6], max_tokens=2, seed=2**70)
    assert err.value.status_code == 400
    # the edge of the range is a valid seed, also for the derived seeds of later choices
    top = client.completions.create(model="tiny", prompt=[5, 6], max_tokens=2, seed=2**63 - 1, n=2)
    assert len(top.choices) == 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("response_format", {"type": "json_object"}),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "exec"}}),
        ("logit_bias", {"5": 100}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1.0),
        ("top_logprobs", 2),
        ("top_k", 5),
    ],
)
def test_unhonoured_parameters_are_refused(tokenizer, field, value):
    engine = ListEngine([5, tokenizer.eos_token_id])
    with serve_in_thread(build_app(engine, tokenizer)) as url:
        body = {"model": "orchard", "messages": USER, "tools": TOOLS, "logprobs": True, field: value}
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        # the neutral values ask for nothing and are accepted
        neutral = {"response_format": {"type": "text"}, "tool_choice": "auto", "logit_bias": {},
                   "presence_penalty": 0, "frequency_penalty": 0.0, "top_logprobs": 0, "top_k": -1}[field]
        assert httpx.post(f"{url}/v1/chat/completions", json={**body, field: neutral}).status_code == 200
    assert len(engine.requests) == 1  # the refused request never reached the engine


def test_tool_calls_are_parsed_only_when_tools_were_offered(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL_TEXT, CALL_TEXT])
    with serve_in_thread(build_app(engine, tokenizer)) as url:
        client = _client(url)
        plain = client.chat.completions.create(model="orchard", messages=USER).choices[0]
        assert plain.message.tool_calls is None and plain.message.content == CALL_TEXT
        assert plain.finish_reason == "stop"
        offered = client.chat.completions.create(model="orchard", messages=USER, tools=TOOLS).choices[0]
        assert offered.finish_reason == "tool_calls" and offered.message.content == "Let me see."


def test_completions_stop_at_end_of_turn_unless_ignore_eos(tokenizer):
    eos = tokenizer.eos_token_id
    engine = ListEngine([5, 6, eos, 0, 0, 0])  # a model that pads after its end of turn
    with serve_in_thread(build_app(engine, tokenizer)) as url:
        client = _client(url)
        out = client.completions.create(model="orchard", prompt=[9, 9], max_tokens=6).choices[0]
        assert out.model_extra["token_ids"] == [5, 6, eos] and out.finish_reason == "stop"
        assert out.text == tokenizer.decode([5, 6])
        raw = client.completions.create(
            model="orchard", prompt=[9, 9], max_tokens=6, extra_body={"ignore_eos": True}
        ).choices[0]
        assert raw.model_extra["token_ids"] == [5, 6, eos, 0, 0, 0] and raw.finish_reason == "length"


def test_choice_seeds_do_not_alias(tiny_server, tiny_model):
    client = _client(tiny_server)

    def sample(seed, n):
        out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=1.0, seed=seed,
                                        n=n, extra_body={"ignore_eos": True})
        return [c.model_extra["token_ids"] for c in out.choices]

    three, four = sample(3, 2), sample(4, 1)
    assert three[1] != four[0]  # before: choice i drew from seed + i, so seed 3's second was seed 4's first
    assert three[0] == sample(3, 1)[0]  # the first choice keeps the request's seed
    assert choice_seed(3, 0) == 3 and choice_seed(3, 1) != 4 and 0 <= choice_seed(-(2**63), 5) < 2**63
    # the engine in process seeds its samples alike: the same samples as served
    params = dict(max_tokens=8, temperature=1.0)
    direct = asyncio.run(HFEngine(tiny_model).generate([GenerateRequest([5, 6, 7], SamplingParams(seed=3, n=2, **params))]))
    assert [c.token_ids for c in direct[0].completions] == three


def _collect_chat(stream):
    """Join a chat stream's chunks: per choice the content, tool calls, token ids, log-probs, finish reason."""
    out, usage, prompt_ids = {}, None, None
    for chunk in stream:
        prompt_ids = prompt_ids or (chunk.model_extra or {}).get("prompt_token_ids")
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "calls": [], "ids": [], "lps": [], "finish": None})
            o["content"] += c.delta.content or ""
            o["calls"] += c.delta.tool_calls or []
            o["ids"] += c.model_extra.get("token_ids") or []
            o["lps"] += [t.logprob for t in (c.logprobs.content if c.logprobs else None) or []]
            o["finish"] = c.finish_reason or o["finish"]
    return out, usage, prompt_ids


@pytest.mark.parametrize("streams", [True, False], ids=["generate_stream", "fallback"])
def test_streamed_tool_call_equals_the_whole_answer(tokenizer, streams):
    ids = tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    with serve_in_thread(build_app(ListEngine(ids, streams=streams), tokenizer)) as url:
        client = _client(url)
        whole = client.chat.completions.create(model="orchard", messages=USER, tools=TOOLS, logprobs=True)
        stream = client.chat.completions.create(
            model="orchard", messages=USER, tools=TOOLS, logprobs=True, stream=True,
            stream_options={"include_usage": True},
        )
        (got,), usage, prompt_ids = (lambda o, u, p: (list(o.values()), u, p))(*_collect_chat(stream))
    choice = whole.choices[0]
    assert got["content"] == choice.message.content == "Let me see."  # the newline before the call is held back
    (call,) = got["calls"]
    assert call.index == 0 and call.function.name == "exec"
    assert json.loads(call.function.arguments) == {"command": "ls -la"}
    assert got["finish"] == choice.finish_reason == "tool_calls"
    assert got["ids"] == choice.model_extra["token_ids"] == ids
    assert got["lps"] == pytest.approx([-0.1 * (k + 1) for k in range(len(ids))])
    assert prompt_ids == whole.model_extra["prompt_token_ids"]
    assert usage.completion_tokens == len(ids) and usage.prompt_tokens == len(prompt_ids)


def test_hf_stream_equals_the_whole_answer_and_stops_at_stop_strings(tiny_server):
    client = _client(tiny_server)
    kwargs = dict(model="tiny", messages=USER, max_tokens=12, temperature=1.0, seed=5, n=2, logprobs=True)
    whole = client.chat.completions.create(**kwargs)
    got, usage, _ = _collect_chat(client.chat.completions.create(**kwargs, stream=True))
    assert usage is None  # not asked for
    for c in whole.choices:
        assert got[c.index]["ids"] == c.model_extra["token_ids"]
        # the stream's prompt came from the prefix store, the first call's was prefilled: float noise only
        assert got[c.index]["lps"] == pytest.approx([t.logprob for t in c.logprobs.content], abs=1e-4)
        assert got[c.index]["content"] == c.message.content and got[c.index]["finish"] == c.finish_reason
    # completions: a stop string taken from the greedy text cuts the stream where it cuts the whole answer
    base = dict(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    stop = text[len(text) // 2 :][:2]
    whole_cut = client.completions.create(**base, stop=[stop]).choices[0]
    chunks = list(client.completions.create(**base, stop=[stop], stream=True, logprobs=0))
    assert "".join(c.choices[0].text for c in chunks) == whole_cut.text == text[: text.find(stop)]
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == whole_cut.model_extra["token_ids"]
    assert chunks[-1].choices[0].finish_reason == whole_cut.finish_reason == "stop"
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == [5, 6, 7, 8, 9]


def test_hf_generate_stream_yields_the_generate_tokens(tiny_model):
    async def main():
        engine = HFEngine(tiny_model)
        request = GenerateRequest([5, 6, 7], SamplingParams(max_tokens=7, seed=11))
        [whole] = await engine.generate([request])
        streamed = [pair async for pair in engine.generate_stream(request)]
        # leaving a stream early frees its row: the engine goes on serving
        async for _ in engine.generate_stream(GenerateRequest([5, 6], SamplingParams(max_tokens=50))):
            break
        [again] = await engine.generate([request])
        with pytest.raises(ValueError, match="n must be 1"):
            await anext(engine.generate_stream(GenerateRequest([5], SamplingParams(n=2))))
        await engine.close()
        return whole.completions[0], streamed, again.completions[0]

    whole, streamed, again = asyncio.run(main())
    assert [t for t, _ in streamed] == whole.token_ids == again.token_ids
    # the stream's prompt came from the prefix store (its last token prefilled alone), the first call's was
    # prefilled whole: the same tokens, log-probs equal up to float rounding (seen: 4.8e-7)
    assert [lp for _, lp in streamed] == pytest.approx(whole.logprobs, abs=1e-5)


def test_top_logprobs_are_the_sampling_distributions_best(tiny_server, tokenizer):
    client = _client(tiny_server)
    resp = client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"return_tokens_as_token_ids": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == len(resp.choices[0].model_extra["token_ids"])
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        # greedy: the sampled token is the most likely one, scored alike by the engine and the forward pass
        assert top[0].token == entry.token and top[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert sum(2.718281828 ** t.logprob for t in top) <= 1 + 1e-5
    comp = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=2)
    for label, lp, top in zip(comp.choices[0].logprobs.tokens, comp.choices[0].logprobs.token_logprobs,
                              comp.choices[0].logprobs.top_logprobs, strict=True):
        assert len(top) == 2 and max(top, key=top.get) == label and top[label] == lp
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=USER, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model="tiny", messages=USER, logprobs=True, top_logprobs=2, stream=True)
