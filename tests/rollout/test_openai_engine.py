import asyncio
import importlib.util

import pytest

from orchard.rollout.engine import GenerateRequest, SamplingParams, ScoreRequest
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.openai_engine import OpenAIEngine, parse_completion_choice, parse_prompt_logprobs
from orchard.rollout.server import build_app, serve_in_thread


@pytest.mark.slow
def test_openai_engine_over_our_server_equals_the_engine_itself(tmp_path, tokenizer):
    from safetensors.torch import save_file

    from orchard.train.tiny import tiny_qwen3

    model = tiny_qwen3(tokenizer, seed=0)
    requests = [
        GenerateRequest([5, 6, 7], SamplingParams(temperature=0.9, max_tokens=7, seed=1, n=2)),
        GenerateRequest([9, 9, 9, 9, 9], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(2,))),
    ]
    direct = asyncio.run(HFEngine(tiny_qwen3(tokenizer, seed=0)).generate(requests))
    with serve_in_thread(build_app(HFEngine(model), tokenizer, allow_weight_updates=True)) as url:

        async def main():
            engine = OpenAIEngine(url + "/v1", retries=0)
            remote = await engine.generate(requests)
            other = tiny_qwen3(tokenizer, seed=3)
            save_file(
                {k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"},
                tmp_path / "w.safetensors",
            )
            await engine.update_weights(str(tmp_path / "w.safetensors"))
            with pytest.raises(ValueError, match="path"):
                await engine.update_weights(other.state_dict())
            after = await engine.generate(requests[1:])
            await engine.close()
            return remote, after, engine.weight_version

        remote, after, version = asyncio.run(main())
    for a, b in zip(direct, remote, strict=True):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        assert [c.finish_reason for c in a.completions] == [c.finish_reason for c in b.completions]
        for ca, cb in zip(a.completions, b.completions, strict=True):
            assert cb.logprobs == pytest.approx(ca.logprobs, abs=1e-5)
    expected = asyncio.run(HFEngine(tiny_qwen3(tokenizer, seed=3)).generate(requests[1:]))
    assert version == 1 and after[0].completions[0].token_ids == expected[0].completions[0].token_ids


def test_parse_choice_from_token_id_labels_and_errors():
    # older vLLM: no `token_ids`, ids only in the labels
    choice = {
        "logprobs": {"tokens": ["token_id:7", "token_id:2"], "token_logprobs": [-0.5, -1.25]},
        "finish_reason": "stop",
    }
    c = parse_completion_choice(choice)
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([7, 2], [-0.5, -1.25], "stop")
    with pytest.raises(ValueError, match="token ids"):
        parse_completion_choice({"logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]}})
    with pytest.raises(ValueError, match="log-probs"):
        parse_completion_choice({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}})
    with pytest.raises(ValueError, match="base_url"):
        OpenAIEngine("localhost:8000")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_engine_says_how_to_install():
    from orchard.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ImportError, match=r"orchard-rl\[gpu\]"):
        VLLMEngine("some/model")


def test_score_over_our_server_equals_the_engine_and_vllms_request_shape(tokenizer, tiny_model):
    import httpx

    requests = [ScoreRequest([5, 6, 7], [8, 9]), ScoreRequest([3], [4, 5, 6, 7])]
    direct = asyncio.run(HFEngine(tiny_model).score(requests))
    with serve_in_thread(build_app(HFEngine(tiny_model), tokenizer)) as url:

        async def main():
            engine = OpenAIEngine(url, retries=0)
            try:
                return await engine.score(requests)
            finally:
                await engine.close()

        remote = asyncio.run(main())
        # vLLM's scoring request, answered as vLLM answers it: echo without generation, one entry per prompt token
        body = {"model": "orchard", "prompt": [3, 4, 5], "max_tokens": 0, "echo": True, "logprobs": 0,
                "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
        choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
        refused = [httpx.post(f"{url}/v1/completions", json={**body, **extra}).json()["error"]["param"]
                   for extra in ({"prompt_logprobs": 2}, {"logprobs": 1}, {"stream": True})]
    for a, b in zip(direct, remote, strict=True):
        assert b == pytest.approx(a, abs=1e-5)
    [[lp4, lp5]] = asyncio.run(HFEngine(tiny_model).score([ScoreRequest([3], [4, 5])]))
    assert choice["token_ids"] == [] and choice["logprobs"]["tokens"] == ["token_id:3", "token_id:4", "token_id:5"]
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([lp4, lp5], abs=1e-6)
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][2]["5"]["logprob"] == pytest.approx(lp5, abs=1e-6)
    assert refused == ["prompt_logprobs", "logprobs", "stream"]


def test_parse_prompt_logprobs_from_vllm_fields_and_echo():
    ids = [11, 12, 13]
    # vLLM: `prompt_logprobs` keyed by the token id as a string (top-0 may still list a more likely token)
    vllm_choice = {
        "prompt_logprobs": [None, {"12": {"logprob": -0.5, "rank": 2}, "99": {"logprob": -0.1, "rank": 1}},
                            {"13": {"logprob": -2.0, "rank": 1}}],
        "logprobs": {"tokens": ["token_id:11", "token_id:12", "token_id:13", "token_id:7"],
                     "token_logprobs": [None, -9.0, -9.0, -0.3]},
    }
    assert parse_prompt_logprobs(vllm_choice, ids) == [-0.5, -2.0]
    # a server without `prompt_logprobs`: the echoed log-probs (the sampled token after them is ignored)
    assert parse_prompt_logprobs({"logprobs": vllm_choice["logprobs"]}, ids) == [-9.0, -9.0]
    with pytest.raises(ValueError, match="no log-prob for token 13"):
        parse_prompt_logprobs({"prompt_logprobs": [None, {"12": {"logprob": -0.5}}, {"14": {"logprob": -1}}]}, ids)
    with pytest.raises(ValueError, match="position 1"):
        parse_prompt_logprobs({"logprobs": {"tokens": ["token_id:11", "token_id:99", "token_id:13"],
                                            "token_logprobs": [None, -1.0, -1.0]}}, ids)
    with pytest.raises(ValueError, match="echo"):
        parse_prompt_logprobs({"logprobs": {"token_logprobs": [-1.0]}}, ids)
