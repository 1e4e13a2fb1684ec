"""The model server as a server: real uvicorn on loopback, the real `openai` client."""

import json

import httpx
import openai
import pytest
import torch

from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.scripted import ScriptedEngine
from orchard.rollout.server import build_app, serve_in_thread

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "exec",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "List files."},
]


@pytest.fixture(scope="module")
def hf_server(tokenizer, tiny_model):
    app = build_app(HFEngine(tiny_model), tokenizer, model_name="tiny", allow_weight_updates=True)
    with serve_in_thread(app) as url:
        yield url


def _recomputed(model, prompt, sampled, temperature):
    ids = torch.tensor([list(prompt) + list(sampled)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(sampled)[:, None])[:, 0]


def test_openai_client_chat_with_tools_and_logprobs(hf_server, tokenizer, tiny_model):
    client = openai.OpenAI(base_url=f"{hf_server}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    resp = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        logprobs=True,
        max_tokens=10,
        temperature=0.8,
        seed=4,
        n=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    text = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert resp.model_extra["prompt_token_ids"] == prompt
    assert resp.usage.prompt_tokens == len(prompt)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        ids = choice.model_extra["token_ids"]
        assert [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content] == ids
        lps = torch.tensor([t.logprob for t in choice.logprobs.content])
        torch.testing.assert_close(lps, _recomputed(tiny_model, prompt, ids, 0.8), atol=3e-5, rtol=1e-5)
        assert choice.finish_reason in ("stop", "length")
        assert (choice.finish_reason == "stop") == (ids[-1] == tokenizer.eos_token_id)


def test_scripted_tool_call_reaches_client_as_tool_calls(tokenizer):
    answer = 'Let me see.\n<tool_call>\n{"name": "exec", "arguments": {"command": "ls -la"}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [answer, "All done.", "<tool_call>{oops</tool_call>"], logprob=-0.25)
    with serve_in_thread(build_app(engine, tokenizer)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        resp = client.chat.completions.create(model="orchard", messages=MESSAGES, tools=TOOLS, logprobs=True)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me see."
        (call,) = choice.message.tool_calls
        assert call.function.name == "exec" and json.loads(call.function.arguments) == {"command": "ls -la"}
        expected_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert choice.model_extra["token_ids"] == expected_ids
        assert [t.logprob for t in choice.logprobs.content] == [-0.25] * len(expected_ids)
        # the conversation continues with the tool result, as a harness would send it
        follow = [
            *MESSAGES,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "a.txt"},
        ]
        resp2 = client.chat.completions.create(model="orchard", messages=follow, tools=TOOLS)
        assert resp2.choices[0].message.content == "All done." and resp2.choices[0].finish_reason == "stop"
        # a malformed call stays text: the client gets no tool_calls, and nothing raises
        resp3 = client.chat.completions.create(model="orchard", messages=MESSAGES, tools=TOOLS)
        assert resp3.choices[0].message.tool_calls is None
        assert resp3.choices[0].message.content == "<tool_call>{oops</tool_call>"


def test_completions_with_token_ids_stop_strings_and_errors(hf_server, tokenizer, tiny_model):
    client = openai.OpenAI(base_url=f"{hf_server}/v1", api_key="unused", max_retries=0)
    prompt = [5, 6, 7, 8, 9]
    resp = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    choice = resp.choices[0]
    ids = choice.model_extra["token_ids"]
    assert [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens] == ids and len(ids) == 6
    torch.testing.assert_close(
        torch.tensor(choice.logprobs.token_logprobs),
        _recomputed(tiny_model, prompt, ids, 1.0),
        atol=3e-5,
        rtol=1e-5,
    )
    # a stop string taken from the greedy text cuts the sample right after the token completing it
    text = choice.text
    assert len(text) >= 4  # the tiny model's greedy output for this prompt (decoded bytes)
    stop = text[len(text) // 2 :][:2]
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stop=[stop])
    c = cut.choices[0]
    assert c.finish_reason == "stop" and c.text == text[: text.find(stop)]
    assert c.model_extra["token_ids"] == ids[: len(c.model_extra["token_ids"])]
    assert stop in tokenizer.decode(c.model_extra["token_ids"], skip_special_tokens=True)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="hi", temperature=-1)
    r = httpx.post(f"{hf_server}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(f"{hf_server}/health").json() == {"status": "ok"}


def test_update_weights_endpoint(tmp_path, tokenizer):
    from safetensors.torch import save_file

    from orchard.train.tiny import tiny_qwen3

    engine = HFEngine(tiny_qwen3(tokenizer, seed=0))
    other = tiny_qwen3(tokenizer, seed=1)
    save_file(
        {k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"},
        tmp_path / "w.safetensors",
    )
    with serve_in_thread(build_app(engine, tokenizer, allow_weight_updates=True)) as url:
        r = httpx.post(f"{url}/update_weights", json={"path": str(tmp_path / "w.safetensors")})
        assert r.status_code == 200 and r.json()["weight_version"] == 1
        torch.testing.assert_close(engine.model.model.norm.weight, other.model.norm.weight)
        assert (
            httpx.post(f"{url}/update_weights", json={"path": str(tmp_path / "nope.txt")}).status_code == 400
        )
    with serve_in_thread(build_app(engine, tokenizer)) as url:
        assert httpx.post(f"{url}/update_weights", json={"path": "x"}).status_code == 403


def test_one_engine_serves_a_server_thread_and_the_callers_loop(tokenizer, tiny_model):
    import asyncio
    import threading

    from orchard.rollout.engine import GenerateRequest, SamplingParams

    engine = HFEngine(tiny_model)
    request = GenerateRequest([5, 6, 7], SamplingParams(max_tokens=6, seed=9))  # no stop token, as ignore_eos
    with serve_in_thread(build_app(engine, tokenizer)) as url:
        remote = {}

        def call():
            body = {"model": "orchard", "prompt": [5, 6, 7], "max_tokens": 6, "seed": 9, "logprobs": 0,
                    "ignore_eos": True}
            remote["r"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()

        thread = threading.Thread(target=call)
        thread.start()
        local = asyncio.run(engine.generate([request]))[0].completions[
            0
        ]  # this loop, while the server's runs
        thread.join()
    assert remote["r"]["choices"][0]["token_ids"] == local.token_ids  # same seed: same sample on either loop
