import asyncio
import importlib.util

import pytest

from orchard.rollout.engine import GenerateRequest, SamplingParams
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.openai_engine import OpenAIEngine, parse_completion_choice
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

    with pytest.raises(ImportError, match=r"orchard\[gpu\]"):
        VLLMEngine("some/model")
