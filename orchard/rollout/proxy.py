"""The recording proxy: an OpenAI-compatible endpoint in front of any engine or server that records every call.

Point any harness that speaks the OpenAI API at the proxy (``base_url=http://proxy/v1``, or
``http://proxy/sessions/{id}/v1``). Each call is forwarded upstream with token ids and log-probs switched on,
recorded under its session, and answered as the upstream answered (minus the log-probs the client did not ask for).
The calls of one session then become training samples: per call and choice, the prompt ids (context, masked) then
the sampled ids (actions, supervised, with their sampling log-probs) — so a harness we did not write can be trained.

Session key, first that applies: the path prefix ``/sessions/{id}/v1/...``; the header ``X-Session-Id``; the
request's ``user`` field; else ``"default"``.

Out of process (``orchard serve-proxy``): ``GET /sessions`` lists sessions, ``GET /sessions/{id}/calls`` returns a
session's `CallRecord`s as JSON, ``GET /sessions/{id}/samples`` its training samples and
``GET /sessions/{id}/trajectory`` its conversation as a `Trajectory` with them (`fetch_trajectory` reads it back),
``POST /sessions/{id}/end`` ends a session (a later call under its id is refused with 409 ``session_ended``,
nothing forwarded), ``DELETE /sessions/{id}`` drops it.

Records live in memory, and with ``record_dir`` also on disk, one JSON-lines file per session that a restarted
proxy loads again (`orchard.rollout.proxy_records`).

Streaming (``stream: true``): each upstream chunk is forwarded to the client as it arrives (in the client's view),
while the proxy accumulates the chunks' token ids and log-probs; the call is recorded, like a whole answer, before
the final ``[DONE]`` is forwarded. A stream the client or the upstream broke off is not recorded.

Upstream: a base URL of an OpenAI-compatible server that returns token ids (our ``orchard serve-model``, or vLLM
>= 0.10.2 with ``return_token_ids``; a trailing ``/v1`` is accepted), or an in-process `Engine` plus tokenizer
(served by `build_app` through an ASGI transport, no socket).
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from orchard._extras import requires_extra

with requires_extra("rollout"):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

from orchard.data import Message, RenderedSample, RenderReport, Trajectory
from orchard.rollout.engine import Engine, derive_seed
from orchard.rollout.proxy_records import CallRecord, RecordedChoice, SessionFiles
from orchard.rollout.server import build_app, normalize_messages
from orchard.rollout.session import DEFAULT_SESSION, SESSION_HEADER

__all__ = ["CallRecord", "RecordedChoice", "RecordingProxy", "fetch_trajectory", "sample_from_json", "sample_to_json"]


def _choice_token_ids(choice: Mapping[str, Any]) -> list[int] | None:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(t) for t in ids]
    logprobs = choice.get("logprobs") or {}
    labels = (
        [e.get("token") for e in logprobs.get("content") or []]
        if "content" in logprobs
        else logprobs.get("tokens")
    )
    if labels and all(isinstance(t, str) and t.startswith("token_id:") for t in labels):
        return [int(t.removeprefix("token_id:")) for t in labels]
    return None


def _choice_logprobs(choice: Mapping[str, Any]) -> list[float] | None:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    if logprobs.get("content") is not None:
        return [float(e["logprob"]) for e in logprobs["content"]]
    if logprobs.get("token_logprobs") is not None:
        return [float(x) for x in logprobs["token_logprobs"]]
    return None


class RecordingProxy:
    """Args:
    upstream: base URL of an OpenAI-compatible server (``http://host:port``; a trailing ``/v1`` is accepted), or
        an `Engine`.
    tokenizer: needed with an `Engine` upstream. With a URL it is optional: with it the proxy asks the upstream
        for ``token_id:N`` labels and turns them back into text for clients that asked for log-probs but not for
        ids (works with any vLLM); without it the upstream labels tokens as text and the ids come from the
        choices' ``token_ids`` (vLLM >= 0.10.2, ``orchard serve-model``).
    timeout_s: per upstream call. Default 600.
    model_name: with an `Engine` upstream, the model name requests must give (what ``/v1/models`` lists).
        Default ``"orchard"``.
    record_dir: a directory (made if missing) to keep the sessions in, so that they survive a restart: each call
        is appended to ``<record_dir>/<url-quoted session id>.jsonl`` before it counts as recorded, and the
        sessions already there are loaded now (`orchard.rollout.proxy_records`). Default None: memory only.

    Raises:
        ValueError: a bad ``upstream``, or a ``record_dir`` that is not a directory and cannot be made one.
    """

    def __init__(
        self,
        upstream: str | Engine,
        tokenizer: Any = None,
        *,
        timeout_s: float = 600.0,
        model_name: str = "orchard",
        record_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(upstream, str):
            if not upstream.startswith(("http://", "https://")):
                raise ValueError(f"upstream must be an http(s) URL or an Engine, got {upstream!r}")
            # the OpenAI base-URL habit: routes are forwarded under /v1 already
            self.upstream = upstream.rstrip("/").removesuffix("/v1")
            self._client = httpx.AsyncClient(base_url=self.upstream, timeout=timeout_s)
        elif hasattr(upstream, "generate"):
            if tokenizer is None:
                raise ValueError("tokenizer is required when upstream is an Engine")
            self.upstream = "in-process engine"
            inner = build_app(upstream, tokenizer, model_name=model_name)
            self._client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=inner), base_url="http://engine", timeout=timeout_s
            )
        else:
            raise ValueError(f"upstream must be an http(s) URL or an Engine, got {type(upstream).__name__}")
        self.tokenizer = tokenizer
        self._records: dict[str, list[CallRecord]] = {}
        self._session_seeds: dict[str, list[int]] = {}  # session -> [seed, calls forwarded so far]
        self._ended: set[str] = set()
        self._files = None if record_dir is None else SessionFiles(record_dir)
        if self._files is not None:
            for session_id, calls, ended in self._files.load():
                if calls:
                    self._records[session_id] = calls
                if ended:
                    self._ended.add(session_id)
        self._lock = threading.Lock()
        self.app = self._build_app()

    # ---- records -----------------------------------------------------------------------------------------------

    def sessions(self) -> list[str]:
        """Ids of the sessions with at least one recorded call, in first-seen order."""
        with self._lock:
            return list(self._records)

    def calls(self, session_id: str) -> list[CallRecord]:
        """The recorded calls of one session, in arrival order (empty for an unknown session)."""
        with self._lock:
            return list(self._records.get(session_id, []))

    def pop_session(self, session_id: str) -> list[CallRecord]:
        """Remove and return a session's calls (so a long-running proxy does not grow without bound), with its file
        under ``record_dir`` and its ended mark: the id is free again."""
        with self._lock:
            if self._files is not None:
                self._files.delete(session_id)
            self._ended.discard(session_id)
            self._session_seeds.pop(session_id, None)
            return self._records.pop(session_id, [])

    def end_session(self, session_id: str) -> None:
        """Mark a session ended (kept under ``record_dir``): its calls stay readable, and a new call under its id is
        refused with 409 ``session_ended`` (nothing is forwarded), so an episode's record cannot grow after it was
        read for training. A call already forwarded when the session ends is still recorded. Ending an ended or
        unknown session is allowed (the unknown id can then not be used)."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        with self._lock:
            if session_id in self._ended:
                return
            if self._files is not None:
                self._files.end(session_id)
            self._ended.add(session_id)

    def ended(self, session_id: str) -> bool:
        """Whether `end_session` ended this session (False for an unknown one)."""
        with self._lock:
            return session_id in self._ended

    def seed_session(self, session_id: str, seed: int) -> None:
        """Seed the sampling of ``session_id``'s calls: its ``k``-th call forwarded (from 0) samples with
        ``derive_seed(seed, k)`` unless its body gives a ``seed`` of its own. A harness program that cannot seed its
        requests itself thus plays the same episode wherever it runs (`orchard.rollout.Rollouts`)."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty str, got {session_id!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        with self._lock:
            self._session_seeds[session_id] = [seed, 0]

    def _session_seed(self, session_id: str) -> int | None:
        """The seed of ``session_id``'s next call (None: not seeded), counting the call."""
        with self._lock:
            seeded = self._session_seeds.get(session_id)
            if seeded is None:
                return None
            seed, k = seeded
            seeded[1] += 1
        return derive_seed(seed, k)

    def samples(self, session_id: str) -> list[RenderedSample]:
        """The session's calls as training samples, one per call and choice, in order.

        Sample of call ``k``, choice ``c``: ``input_ids = prompt_ids + token_ids`` (shape ``[P + S]``),
        ``action_mask`` False on the prompt and True on the sampled ids, ``turn_index`` ``k`` on actions and -1
        elsewhere, ``old_logprobs`` the sampling log-probs on actions (0 elsewhere), ``logprob_mask`` = actions
        whose log-prob was returned. This equals `orchard.data.render_turns` of the same conversation.
        """
        out = []
        for k, record in enumerate(self.calls(session_id)):
            for c, choice in enumerate(record.choices):
                prompt = record.prompt_ids[min(c // record.n_per_prompt, len(record.prompt_ids) - 1)]
                n_prompt, n_out = len(prompt), len(choice.token_ids)
                known = len(choice.logprobs) == n_out
                out.append(
                    RenderedSample(
                        input_ids=torch.tensor(prompt + choice.token_ids, dtype=torch.long),
                        action_mask=torch.tensor([False] * n_prompt + [True] * n_out),
                        turn_index=torch.tensor([-1] * n_prompt + [k] * n_out, dtype=torch.long),
                        old_logprobs=torch.tensor(
                            [0.0] * n_prompt + (choice.logprobs if known else [0.0] * n_out),
                            dtype=torch.float32,
                        ),
                        logprob_mask=torch.tensor([False] * n_prompt + [known] * n_out),
                        report=RenderReport(full_length=n_prompt + n_out),
                    )
                )
        return out

    def trajectory(self, session_id: str) -> Trajectory:
        """The session as one `Trajectory`: the conversation of its last chat call (the request's messages and the
        answer's first choice, which carries its sampled ids and log-probs), the tools offered, and every call's
        training samples (`samples`) in ``samples``. A session without chat calls gives empty messages."""
        calls = self.calls(session_id)
        samples = self.samples(session_id)
        metadata = {"session_id": session_id, "calls": len(calls)}
        chats = [c for c in calls if c.endpoint == "chat.completions"]
        if not chats:
            return Trajectory(metadata=metadata, samples=samples)
        last = chats[-1]
        keys = ("role", "content", "tool_calls", "tool_call_id", "name")
        messages = [
            Message.from_dict({k: m[k] for k in keys if m.get(k) is not None})
            for m in normalize_messages(last.request.get("messages"))
        ]
        choices = last.response.get("choices") or []
        if choices and last.choices:
            answer = {k: v for k, v in (choices[0].get("message") or {}).items() if k in keys and v is not None}
            recorded = last.choices[0]
            known = len(recorded.logprobs) == len(recorded.token_ids)
            messages.append(
                Message.from_dict(
                    {**answer, "token_ids": recorded.token_ids, "logprobs": recorded.logprobs if known else None}
                )
            )
        return Trajectory(messages=messages, tools=list(last.request.get("tools") or []), metadata=metadata,
                          samples=samples)

    # ---- the app ----------------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="orchard recording proxy")

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        @app.get("/sessions/{session_id}/v1/models")
        async def models(session_id: str | None = None) -> Response:
            try:
                r = await self._client.get("/v1/models")
            except httpx.HTTPError as exc:
                return self._upstream_failed(exc)
            return Response(r.content, status_code=r.status_code, media_type="application/json")

        @app.get("/sessions")
        async def list_sessions() -> dict[str, Any]:
            return {"sessions": self.sessions()}

        @app.get("/sessions/{session_id}/calls")
        async def session_calls(session_id: str) -> dict[str, Any]:
            return {"session_id": session_id, "calls": [c.to_dict() for c in self.calls(session_id)]}

        @app.get("/sessions/{session_id}/samples")
        async def session_samples(session_id: str) -> dict[str, Any]:
            return {"session_id": session_id, "samples": [sample_to_json(s) for s in self.samples(session_id)]}

        @app.get("/sessions/{session_id}/trajectory")
        async def session_trajectory(session_id: str) -> dict[str, Any]:
            trajectory = self.trajectory(session_id)
            return {**trajectory.to_dict(), "samples": [sample_to_json(s) for s in trajectory.samples]}

        @app.delete("/sessions/{session_id}")
        async def drop_session(session_id: str) -> dict[str, Any]:
            return {"session_id": session_id, "calls": len(self.pop_session(session_id))}

        @app.post("/sessions/{session_id}/end")
        async def end_session(session_id: str) -> dict[str, Any]:
            self.end_session(session_id)
            return {"session_id": session_id, "ended": True, "calls": len(self.calls(session_id))}

        @app.post("/v1/{endpoint:path}")
        async def forward(endpoint: str, request: Request) -> Response:
            return await self._forward(endpoint, request, None)

        @app.post("/sessions/{session_id}/v1/{endpoint:path}")
        async def forward_session(session_id: str, endpoint: str, request: Request) -> Response:
            return await self._forward(endpoint, request, session_id)

        return app

    async def _forward(self, endpoint: str, request: Request, path_session: str | None) -> Response:
        kind = {"chat/completions": "chat.completions", "completions": "completions"}.get(endpoint)
        if kind is None:
            return JSONResponse({"error": {"message": f"unknown endpoint /v1/{endpoint}"}}, status_code=404)
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(
                {"error": {"message": "body is not JSON", "type": "invalid_request_error"}}, 400
            )
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "body must be a JSON object"}}, status_code=400)
        user = body.get("user") if isinstance(body.get("user"), str) else None
        session = path_session or request.headers.get(SESSION_HEADER) or user or DEFAULT_SESSION
        if self.ended(session):
            return JSONResponse(
                {"error": {"message": f"session {session!r} has ended; start a new session id",
                           "type": "invalid_request_error", "param": None, "code": "session_ended"}},
                409,
            )
        upstream_body = copy.deepcopy(body)
        call_seed = self._session_seed(session)
        if call_seed is not None and body.get("seed") is None:
            upstream_body["seed"] = call_seed
        upstream_body["return_token_ids"] = True
        if self.tokenizer is not None:
            upstream_body["return_tokens_as_token_ids"] = True
        if kind == "chat.completions":
            upstream_body["logprobs"] = True
        elif upstream_body.get("logprobs") is None:
            upstream_body["logprobs"] = 0
        started, t0 = time.time(), time.perf_counter()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        if body.get("stream"):
            return await self._forward_stream(endpoint, kind, session, body, upstream_body, headers)
        try:
            r = await self._client.post(f"/v1/{endpoint}", json=upstream_body, headers=headers)
        except httpx.HTTPError as exc:
            return self._upstream_failed(exc)
        duration = time.perf_counter() - t0
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        data = r.json()
        self._record(session, kind, body, data, started, duration)
        return JSONResponse(self._client_view(body, data, kind))

    def _upstream_failed(self, exc: httpx.HTTPError) -> JSONResponse:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return JSONResponse(
            {"error": {"message": f"upstream {self.upstream} failed: {type(exc).__name__}: {reason}",
                       "type": "upstream_error", "param": None, "code": None}},
            502,
        )

    async def _forward_stream(
        self,
        endpoint: str,
        kind: str,
        session: str,
        body: dict[str, Any],
        upstream_body: dict[str, Any],
        headers: dict[str, str],
    ) -> Response:
        started, t0 = time.time(), time.perf_counter()
        upstream = self._client.build_request("POST", f"/v1/{endpoint}", json=upstream_body, headers=headers)
        try:
            r = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return self._upstream_failed(exc)
        if r.status_code != 200:
            content = await r.aread()
            await r.aclose()
            return Response(content, status_code=r.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            whole = _StreamedCall(kind)
            try:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # event separators and SSE comments
                    payload = line.removeprefix("data:").strip()
                    if payload == "[DONE]":
                        if not whole.failed:
                            duration = time.perf_counter() - t0
                            self._record(session, kind, body, whole.response(), started, duration)
                        yield b"data: [DONE]\n\n"
                        return
                    chunk = json.loads(payload)
                    whole.add(chunk)
                    yield f"data: {json.dumps(self._client_view(body, chunk, kind))}\n\n".encode()
            finally:
                await r.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    def _record(
        self,
        session: str,
        kind: str,
        body: dict[str, Any],
        data: dict[str, Any],
        started: float,
        duration: float,
    ) -> None:
        choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
        recorded = []
        for choice in choices:
            ids = _choice_token_ids(choice) or []
            lps = _choice_logprobs(choice) or []
            recorded.append(RecordedChoice(ids, lps, str(choice.get("finish_reason"))))
        if kind == "chat.completions":
            prompts = (
                [list(data.get("prompt_token_ids") or choices[0].get("prompt_token_ids") or [])]
                if choices
                else []
            )
            per_prompt = max(1, len(choices))
        else:
            prompts = [list(choice.get("prompt_token_ids") or []) for choice in choices]  # one per choice
            per_prompt = 1
        record = CallRecord(
            session, kind, body, data, prompts or [[]], recorded, started, duration, per_prompt
        )
        with self._lock:
            if self._files is not None:
                # on disk first: a call that could not be kept fails loudly rather than living in memory only
                self._files.append(record)
            self._records.setdefault(session, []).append(record)

    def _client_view(self, body: dict[str, Any], data: dict[str, Any], kind: str) -> dict[str, Any]:
        """The response as the client asked for it: log-probs only when requested, token labels as text unless
        ``return_tokens_as_token_ids`` was requested (token ids fields stay: extra fields are harmless)."""
        out = copy.deepcopy(data)
        wants_logprobs = (
            bool(body.get("logprobs")) if kind == "chat.completions" else body.get("logprobs") is not None
        )
        wants_id_labels = bool(body.get("return_tokens_as_token_ids"))
        for choice in out.get("choices") or []:
            if not wants_logprobs:
                choice["logprobs"] = None
            elif not wants_id_labels and self.tokenizer is not None and choice.get("logprobs"):
                self._relabel(choice["logprobs"])
        return out

    def _relabel(self, logprobs: dict[str, Any]) -> None:
        def text(label: Any) -> Any:
            if isinstance(label, str) and label.startswith("token_id:"):
                return self.tokenizer.decode(
                    [int(label.removeprefix("token_id:"))], skip_special_tokens=False
                )
            return label

        for entry in logprobs.get("content") or []:
            entry["token"] = text(entry.get("token"))
            for alternative in entry.get("top_logprobs") or []:
                alternative["token"] = text(alternative.get("token"))
        if logprobs.get("tokens") is not None:
            logprobs["tokens"] = [text(t) for t in logprobs["tokens"]]
        if logprobs.get("top_logprobs") is not None:
            logprobs["top_logprobs"] = [{text(k): v for k, v in d.items()} for d in logprobs["top_logprobs"]]

    async def aclose(self) -> None:
        await self._client.aclose()


def sample_to_json(sample: RenderedSample) -> dict[str, Any]:
    """A `RenderedSample`'s tensors as JSON lists (what ``GET /sessions/{id}/samples`` returns)."""
    return {
        name: getattr(sample, name).tolist()
        for name in ("input_ids", "action_mask", "turn_index", "old_logprobs", "logprob_mask")
    }


def sample_from_json(data: Mapping[str, Any]) -> RenderedSample:
    """Invert `sample_to_json`."""
    ids = data["input_ids"]
    return RenderedSample(
        input_ids=torch.tensor(ids, dtype=torch.long),
        action_mask=torch.tensor(data["action_mask"], dtype=torch.bool),
        turn_index=torch.tensor(data["turn_index"], dtype=torch.long),
        old_logprobs=torch.tensor(data["old_logprobs"], dtype=torch.float32),
        logprob_mask=torch.tensor(data["logprob_mask"], dtype=torch.bool),
        report=RenderReport(full_length=len(ids)),
    )


def fetch_trajectory(proxy_url: str, session_id: str, *, timeout_s: float = 60.0) -> Trajectory:
    """A session of an out-of-process proxy (``orchard serve-proxy``) as a `Trajectory` with its training samples
    (`RecordingProxy.trajectory` over HTTP)."""
    if not isinstance(proxy_url, str) or not proxy_url.startswith(("http://", "https://")):
        raise ValueError(f"proxy_url must be an http(s) URL, got {proxy_url!r}")
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
    r = httpx.get(f"{proxy_url.rstrip('/')}/sessions/{session_id}/trajectory", timeout=timeout_s)
    r.raise_for_status()
    data = r.json()
    samples = [sample_from_json(s) for s in data.pop("samples")]
    trajectory = Trajectory.from_dict(data)
    trajectory.samples = samples
    return trajectory


@dataclass
class _StreamedChoice:
    token_ids: list[int] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    """Chat log-prob entries (``logprobs.content``)."""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    text: str = ""
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None


class _StreamedCall:
    """The chunks of a streamed call, joined into the body the upstream would have answered without streaming."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.choices: dict[int, _StreamedChoice] = {}
        self.prompt_token_ids: list[int] | None = None
        self.usage: Any = None
        self.failed = False

    def add(self, chunk: Mapping[str, Any]) -> None:
        if "error" in chunk:
            self.failed = True
            return
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        self.usage = chunk.get("usage") or self.usage
        for c in chunk.get("choices") or []:
            choice = self.choices.setdefault(int(c.get("index", 0)), _StreamedChoice())
            choice.token_ids += [int(t) for t in c.get("token_ids") or []]
            if c.get("prompt_token_ids") is not None:
                choice.prompt_token_ids = list(c["prompt_token_ids"])
            logprobs = c.get("logprobs") or {}
            choice.entries += logprobs.get("content") or []
            choice.tokens += logprobs.get("tokens") or []
            choice.token_logprobs += logprobs.get("token_logprobs") or []
            delta = c.get("delta") or {}
            choice.text += (delta.get("content") if self.kind == "chat.completions" else c.get("text")) or ""
            for call in delta.get("tool_calls") or []:
                whole = choice.tool_calls.setdefault(int(call.get("index", 0)), {"function": {"arguments": ""}})
                for key in ("id", "type"):
                    whole[key] = call.get(key) or whole.get(key)
                function = call.get("function") or {}
                whole["function"]["name"] = function.get("name") or whole["function"].get("name")
                whole["function"]["arguments"] += function.get("arguments") or ""
            choice.finish_reason = c.get("finish_reason") or choice.finish_reason

    def response(self) -> dict[str, Any]:
        choices = []
        for index, c in sorted(self.choices.items()):
            if self.kind == "chat.completions":
                message: dict[str, Any] = {"role": "assistant", "content": c.text or None}
                if c.tool_calls:
                    message["tool_calls"] = [c.tool_calls[k] for k in sorted(c.tool_calls)]
                choice = {"index": index, "message": message, "logprobs": {"content": c.entries}}
            else:
                choice = {"index": index, "text": c.text,
                          "logprobs": {"tokens": c.tokens, "token_logprobs": c.token_logprobs},
                          "prompt_token_ids": c.prompt_token_ids}
            choices.append({**choice, "finish_reason": c.finish_reason, "token_ids": c.token_ids})
        return {"choices": choices, "prompt_token_ids": self.prompt_token_ids, "usage": self.usage}
