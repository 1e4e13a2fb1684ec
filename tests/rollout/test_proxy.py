"""The recording proxy as a server: a harness we did not write (plain `openai` client code) talks to it."""

import json
import logging
import threading

import httpx
import openai
import pytest
import torch

from orchard.data import Message, ToolCall, Trajectory, render_turns
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.proxy import RecordingProxy, fetch_trajectory
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
                httpx.post(f"{url}/v1/chat/completions", json={"model": "orchard", "messages": [], "stream": True})
                .status_code == 400
            )  # upstream's, streamed or not
            assert httpx.post(f"{url}/v1/embeddings", json={}).status_code == 404
            assert (
                httpx.post(f"{url}/v1/chat/completions", json={"model": "orchard", "messages": []}).status_code
                == 400
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


class GatedStreamEngine:
    """Streams ``tokens`` (log-prob of token k: -0.1 * (k + 1)), pausing after the first until the test opens
    ``gate`` (at most 10 s): ``gate_was_open`` tells whether the client saw the first token while the engine was
    still generating, i.e. whether everything between them forwards chunks as they arrive."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.gate = threading.Event()
        self.gate_was_open = None

    async def generate_stream(self, request):
        import asyncio

        for k, t in enumerate(self.tokens):
            yield t, -0.1 * (k + 1)
            if k == 0:
                self.gate_was_open = await asyncio.to_thread(self.gate.wait, 10)

    async def generate(self, requests):
        raise AssertionError("this engine only streams")

    async def update_weights(self, weights):
        pass

    async def close(self):
        pass


def test_streamed_tool_call_through_the_proxy_is_forwarded_live_and_recorded(tokenizer):
    text = "Looking.\n" + _call("ls")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    engine = GatedStreamEngine(ids)
    with serve_in_thread(build_app(engine, tokenizer)) as upstream:
        proxy = RecordingProxy(f"{upstream}/v1")  # the OpenAI base-URL habit; no tokenizer: text labels
        with serve_in_thread(proxy.app) as url:
            client = openai.OpenAI(base_url=f"{url}/sessions/s/v1", api_key="unused", max_retries=0)
            stream = client.chat.completions.create(
                model="orchard", messages=[{"role": "user", "content": "Fix it."}], tools=TOOLS, stream=True
            )
            content, calls, finish, streamed_ids = "", [], None, []
            for chunk in stream:
                for c in chunk.choices:
                    assert c.logprobs is None  # the client did not ask
                    streamed_ids += c.model_extra.get("token_ids") or []
                    if streamed_ids:
                        engine.gate.set()
                    content += c.delta.content or ""
                    calls += c.delta.tool_calls or []
                    finish = c.finish_reason or finish
            assert engine.gate_was_open is True  # the first token reached the client before the second was made
            assert content == "Looking." and finish == "tool_calls" and streamed_ids == ids
            (call,) = calls
            assert call.function.name == "exec" and call.function.arguments == '{"command": "ls"}'
            fetched = fetch_trajectory(url, "s")
        (record,) = proxy.calls("s")
        assert record.choices[0].token_ids == ids and record.choices[0].finish_reason == "tool_calls"
        assert record.choices[0].logprobs == pytest.approx([-0.1 * (k + 1) for k in range(len(ids))])
        # the recorded prompt is the one the engine sampled from: the chat template of the request
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Fix it."}], tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        assert record.prompt_ids == [tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    # the same session, read back over HTTP as a Trajectory with its training samples
    (sample,) = proxy.samples("s")
    (got,) = fetched.samples
    for name in ("input_ids", "action_mask", "turn_index", "old_logprobs", "logprob_mask"):
        assert torch.equal(getattr(sample, name), getattr(got, name)), name
    assert [m.role for m in fetched.messages] == ["user", "assistant"] and fetched.tools == TOOLS
    answer = fetched.messages[-1]
    assert answer.token_ids == ids and answer.tool_calls[0].name == "exec" and answer.content == "Looking."
    assert fetched.metadata == {"session_id": "s", "calls": 1}


def test_without_a_tokenizer_labels_are_text_and_ids_still_recorded(tokenizer, tiny_model):
    with serve_in_thread(build_app(HFEngine(tiny_model), tokenizer)) as upstream:
        proxy = RecordingProxy(upstream)
        with serve_in_thread(proxy.app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            asked = client.chat.completions.create(
                model="orchard", messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True
            )
            ids = asked.choices[0].model_extra["token_ids"]
            assert [t.token for t in asked.choices[0].logprobs.content] == [tokenizer.decode([t]) for t in ids]
            as_ids = client.chat.completions.create(
                model="orchard", messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True,
                extra_body={"return_tokens_as_token_ids": True},
            )
            ids2 = as_ids.choices[0].model_extra["token_ids"]
            assert [t.token for t in as_ids.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids2]
    assert [r.choices[0].token_ids for r in proxy.calls("default")] == [ids, ids2]
    assert all(len(r.choices[0].logprobs) == len(r.choices[0].token_ids) for r in proxy.calls("default"))


def test_a_dead_upstream_is_one_clear_502():
    proxy = RecordingProxy("http://127.0.0.1:9/v1")  # port 9 (discard): nothing listens on loopback
    with serve_in_thread(proxy.app) as url:
        body = {"model": "orchard", "messages": [{"role": "user", "content": "hi"}]}
        for r in (
            httpx.get(f"{url}/v1/models"),
            httpx.post(f"{url}/v1/chat/completions", json=body),
            httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}),
        ):
            assert r.status_code == 502, r.text
            assert r.json()["error"]["message"].startswith("upstream http://127.0.0.1:9 failed: ConnectError")


# ---- record_dir: sessions on disk, ended sessions -----------------------------------------------------------------


def _scripted_proxy(tokenizer, record_dir=None):
    def script(prompt):
        n_tools = prompt.count("<|im_start|>tool")
        return ["Looking.\n" + _call("ls"), _call("cat a.py"), "Done: fixed."][min(n_tools, 2)]

    engine = ScriptedEngine(tokenizer, script, logprob=-0.5)
    return engine, RecordingProxy(engine, tokenizer, record_dir=record_dir)


def _same_samples(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in ("input_ids", "action_mask", "turn_index", "old_logprobs", "logprob_mask"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name


def _record_two_sessions(tokenizer, record_dir):
    """Session ``b/1`` (a '/' in its id: the file name is quoted) by path prefix with three chat calls, then
    ``plain`` by header with one streamed chat call and one completions call."""
    _, proxy = _scripted_proxy(tokenizer, record_dir)
    with serve_in_thread(proxy.app) as url:
        _harness(f"{url}/v1", headers={"X-Session-Id": "b/1"})
        client = openai.OpenAI(base_url=f"{url}/sessions/plain/v1", api_key="unused", max_retries=0)
        list(client.chat.completions.create(model="orchard", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, logprobs=True))
        client.completions.create(model="orchard", prompt=[4, 5, 6], max_tokens=3)
    return proxy


def test_records_survive_a_restart_on_the_same_record_dir(tokenizer, tmp_path):
    first = _record_two_sessions(tokenizer, tmp_path / "records")  # made: it does not exist yet
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["b%2F1.jsonl", "plain.jsonl"]
    assert [len(first.calls(s)) for s in first.sessions()] == [3, 2]
    engine, second = _scripted_proxy(tokenizer, tmp_path / "records")
    assert second.sessions() == first.sessions() == ["b/1", "plain"]  # first-seen order kept
    for session in first.sessions():
        assert second.calls(session) == first.calls(session)  # every field, request and response included
        _same_samples(second.samples(session), first.samples(session))
        a, b = first.trajectory(session), second.trajectory(session)
        assert a.to_dict() == b.to_dict() and a.messages
        _same_samples(a.samples, b.samples)
    assert engine.prompts == []  # loaded, not re-asked
    # the loaded proxy keeps appending to the same files, and serves what it loaded over HTTP
    with serve_in_thread(second.app) as url:
        over_http = httpx.get(f"{url}/sessions/plain/calls").json()["calls"]
        httpx.post(f"{url}/sessions/plain/v1/completions", json={"model": "orchard", "prompt": [7], "max_tokens": 2})
    assert over_http == [c.to_dict() for c in first.calls("plain")]
    _, third = _scripted_proxy(tokenizer, tmp_path / "records")
    assert third.calls("plain") == second.calls("plain") and len(third.calls("plain")) == 3


def test_call_record_round_trips_through_its_dict(tokenizer, tmp_path):
    from orchard.rollout.proxy import CallRecord, RecordedChoice

    proxy = _record_two_sessions(tokenizer, tmp_path)
    for record in proxy.calls("b/1") + proxy.calls("plain"):
        back = CallRecord.from_dict(json.loads(json.dumps(record.to_dict())))
        assert back == record and isinstance(back.choices[0], RecordedChoice)
    with pytest.raises(ValueError, match="missing choices, endpoint"):
        CallRecord.from_dict({k: v for k, v in record.to_dict().items() if k not in ("choices", "endpoint")})


def test_a_truncated_last_line_is_skipped_with_a_warning_and_cut_off(tokenizer, tmp_path, caplog):
    first = _record_two_sessions(tokenizer, tmp_path)
    path = tmp_path / "plain.jsonl"
    whole = path.read_bytes()
    with open(path, "ab") as f:  # a crash in the middle of writing a third call
        f.write(json.dumps(first.calls("plain")[0].to_dict()).encode()[:200])
    with caplog.at_level(logging.WARNING, logger="orchard.rollout.proxy_records"):
        _, second = _scripted_proxy(tokenizer, tmp_path)
    assert "plain.jsonl: skipping its last line, cut short" in caplog.text
    assert second.calls("plain") == first.calls("plain") and second.calls("b/1") == first.calls("b/1")
    assert path.read_bytes() == whole  # cut off, so that the next call starts its own line
    with serve_in_thread(second.app) as url:
        httpx.post(f"{url}/sessions/plain/v1/completions", json={"model": "orchard", "prompt": [7], "max_tokens": 2})
    caplog.clear()
    _, third = _scripted_proxy(tokenizer, tmp_path)
    assert len(third.calls("plain")) == 3 and not caplog.text
    # a bad line that is not the last is no crash's work: loading refuses, naming the file and line
    path.write_bytes(b"{not json\n" + whole)
    with pytest.raises(ValueError, match=r"plain\.jsonl: line 1 is not a call record"):
        _scripted_proxy(tokenizer, tmp_path)


def test_an_ended_session_refuses_calls_with_409_and_forwards_nothing_even_after_a_restart(tokenizer, tmp_path):
    engine, proxy = _scripted_proxy(tokenizer, tmp_path)
    body = {"model": "orchard", "messages": [{"role": "user", "content": "hi"}]}
    with serve_in_thread(proxy.app) as url:
        assert httpx.post(f"{url}/sessions/s/v1/chat/completions", json=body).status_code == 200
        assert not proxy.ended("s")
        ended = httpx.post(f"{url}/sessions/s/end")
        assert ended.json() == {"session_id": "s", "ended": True, "calls": 1}
        assert proxy.ended("s") and not proxy.ended("other")
        asked = len(engine.prompts)
        for r in (
            httpx.post(f"{url}/sessions/s/v1/chat/completions", json=body),
            httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": "s"}),
            httpx.post(f"{url}/v1/chat/completions", json={**body, "user": "s", "stream": True}),
            httpx.post(f"{url}/sessions/s/v1/completions", json={"model": "orchard", "prompt": [4]}),
        ):
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "session_ended"
        assert len(engine.prompts) == asked  # the upstream saw none of them
        assert httpx.post(f"{url}/sessions/t/v1/chat/completions", json=body).status_code == 200  # a new id works
    assert len(proxy.calls("s")) == 1  # the calls before the end stay readable
    assert json.loads((tmp_path / "s.jsonl").read_text().splitlines()[-1]) == {"ended": True}
    engine, restarted = _scripted_proxy(tokenizer, tmp_path)
    assert restarted.ended("s") and not restarted.ended("t") and restarted.calls("s") == proxy.calls("s")
    with serve_in_thread(restarted.app) as url:
        r = httpx.post(f"{url}/sessions/s/v1/chat/completions", json=body)
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_ended"
    assert engine.prompts == []
    # popping frees the id: its file and its end go
    restarted.pop_session("s")
    assert not restarted.ended("s") and not (tmp_path / "s.jsonl").exists()


def test_pop_and_delete_remove_the_session_file(tokenizer, tmp_path):
    proxy = _record_two_sessions(tokenizer, tmp_path)
    assert len(proxy.pop_session("b/1")) == 3 and not (tmp_path / "b%2F1.jsonl").exists()
    with serve_in_thread(proxy.app) as url:
        assert httpx.delete(f"{url}/sessions/plain").json() == {"session_id": "plain", "calls": 2}
    assert list(tmp_path.iterdir()) == []
    _, restarted = _scripted_proxy(tokenizer, tmp_path)
    assert restarted.sessions() == []


def test_without_record_dir_nothing_is_written(tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proxy = _record_two_sessions(tokenizer, None)
    proxy.end_session("plain")
    assert len(proxy.calls("b/1")) == 3 and proxy.ended("plain")
    assert list(tmp_path.iterdir()) == []


def test_bad_record_dir_is_named(tokenizer, tmp_path):
    engine = ScriptedEngine(tokenizer, ["x"])
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"record_dir .*file' exists and is not a directory"):
        RecordingProxy(engine, tokenizer, record_dir=tmp_path / "file")
    with pytest.raises(ValueError, match=r"record_dir .* cannot be made"):
        RecordingProxy(engine, tokenizer, record_dir=tmp_path / "file" / "sub")
    with pytest.raises(ValueError, match="record_dir must be a directory path, got 3"):
        RecordingProxy(engine, tokenizer, record_dir=3)
    with pytest.raises(ValueError, match="session_id must be a non-empty string"):
        RecordingProxy(engine, tokenizer).end_session("")


def test_the_session_key_is_the_path_then_the_header_then_the_user_field(tokenizer):
    # the module's precedence: /sessions/{id}/v1 over X-Session-Id over the body's `user` over "default"
    proxy = RecordingProxy(ScriptedEngine(tokenizer, lambda prompt: "ok"), tokenizer)
    body = {"model": "orchard", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    with serve_in_thread(proxy.app) as url:
        for path, headers, user in [
            ("/sessions/p/v1", {"X-Session-Id": "h"}, "u"),  # -> p
            ("/v1", {"X-Session-Id": "h"}, "u"),  # -> h
            ("/v1", {"X-Session-Id": "h"}, None),  # -> h
            ("/v1", {}, "u"),  # -> u
            ("/v1", {}, None),  # -> default
        ]:
            sent = {**body, "user": user} if user else body
            assert httpx.post(f"{url}{path}/chat/completions", json=sent, headers=headers).status_code == 200
    assert {s: len(proxy.calls(s)) for s in sorted(proxy.sessions())} == {"default": 1, "h": 2, "p": 1, "u": 1}
