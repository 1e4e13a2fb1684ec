"""The recording proxy as a server: a harness we did not write (plain `openai` client code) talks to it."""

import threading

import httpx
import openai
import torch

from orchard.data import Message, ToolCall, Trajectory, render_turns
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.proxy import RecordingProxy
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


def _call(command):
    return f'<tool_call>\n{{"name": "exec", "arguments": {{"command": "{command}"}}}}\n</tool_call>'


def _harness(base_url, headers=None, user=None):
    """A toy agent harness written against the OpenAI API only: call, run tools (fake), repeat."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, default_headers=headers or {})
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Fix it."},
    ]
    extra = {"user": user} if user else {}
    for _ in range(5):
        resp = client.chat.completions.create(
            model="orchard", messages=messages, tools=TOOLS, temperature=1.0, **extra
        )
        msg = resp.choices[0].message
        assistant = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            assistant["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in msg.tool_calls
            ]
        messages.append(assistant)
        if not msg.tool_calls:
            return messages
        for c in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": f"ran {c.function.arguments}"})
    return messages


def test_recorded_session_equals_rendering_the_conversation(tokenizer):
    def script(prompt):
        n_tools = prompt.count("<|im_start|>tool")
        return ["Looking.\n" + _call("ls"), _call("cat a.py"), "Done: fixed."][min(n_tools, 2)]

    proxy = RecordingProxy(ScriptedEngine(tokenizer, script, logprob=-0.5), tokenizer)
    with serve_in_thread(proxy.app) as url:
        results = {}
        # three sessions at once, keyed three ways: path prefix, header, `user` field
        runs = {
            "by-path": lambda: _harness(f"{url}/sessions/by-path/v1"),
            "by-header": lambda: _harness(f"{url}/v1", headers={"X-Session-Id": "by-header"}),
            "by-user": lambda: _harness(f"{url}/v1", user="by-user"),
        }
        threads = [
            threading.Thread(target=lambda k=k, f=f: results.__setitem__(k, f())) for k, f in runs.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(proxy.sessions()) == ["by-header", "by-path", "by-user"]
    for session, conversation in results.items():
        records = proxy.calls(session)
        assert len(records) == 3 and [r.choices[0].finish_reason for r in records] == [
            "tool_calls",
            "tool_calls",
            "stop",
        ]
        # the same conversation as a Trajectory, each assistant turn carrying the ids the proxy recorded
        messages, k = [], 0
        for m in conversation:
            if m["role"] == "assistant":
                ids = records[k].choices[0].token_ids
                calls = [ToolCall.from_dict(c) for c in m.get("tool_calls", [])]
                messages.append(
                    Message("assistant", m["content"], calls, token_ids=ids, logprobs=[-0.5] * len(ids))
                )
                k += 1
            else:
                messages.append(Message.from_dict(m))
        direct = render_turns(Trajectory(messages=messages, tools=TOOLS), tokenizer)
        recorded = proxy.samples(session)
        assert len(direct) == len(recorded) == 3
        for a, b in zip(direct, recorded, strict=True):
            assert a.report.ok
            for name in ("input_ids", "action_mask", "turn_index", "old_logprobs", "logprob_mask"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (session, name)
        assert proxy.pop_session(session) and proxy.calls(session) == []


def test_proxy_in_front_of_a_real_server_keeps_the_client_view(tokenizer, tiny_model):
    with serve_in_thread(build_app(HFEngine(tiny_model), tokenizer)) as upstream:
        proxy = RecordingProxy(upstream, tokenizer)
        with serve_in_thread(proxy.app) as url:
            client = openai.OpenAI(base_url=f"{url}/sessions/s/v1", api_key="unused", max_retries=0)
            plain = client.chat.completions.create(
                model="orchard", messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )
            assert plain.choices[0].logprobs is None  # the client did not ask
            asked = client.chat.completions.create(
                model="orchard", messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True, seed=1
            )
            labels = [t.token for t in asked.choices[0].logprobs.content]
            ids = asked.choices[0].model_extra["token_ids"]
            assert labels == [tokenizer.decode([t]) for t in ids]  # text labels, as OpenAI returns them
            comp = client.completions.create(model="orchard", prompt=[4, 5, 6], max_tokens=4)
            assert comp.choices[0].logprobs is None
            assert (
                httpx.post(f"{url}/v1/chat/completions", json={"messages": [], "stream": True}).status_code
                == 400
            )
            assert httpx.post(f"{url}/v1/embeddings", json={}).status_code == 404
            assert (
                httpx.post(f"{url}/v1/chat/completions", json={"messages": []}).status_code == 400
            )  # upstream's
        samples = proxy.samples("s")
        assert len(samples) == 3 and all(bool(s.logprob_mask[s.action_mask].all()) for s in samples)
        # the recorded log-probs are the engine's: recompute the second call's with a forward pass
        s = samples[1]
        with torch.no_grad():
            logits = tiny_model(input_ids=s.input_ids[None]).logits[0, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, s.input_ids[1:, None])[:, 0]
        torch.testing.assert_close(
            s.old_logprobs[1:][s.action_mask[1:]], ref[s.action_mask[1:]], atol=3e-5, rtol=1e-5
        )
        assert samples[2].input_ids[:3].tolist() == [4, 5, 6]
