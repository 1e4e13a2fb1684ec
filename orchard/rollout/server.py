"""An OpenAI-compatible HTTP server over any `Engine`: what ``orchard serve-model`` runs.

Routes: ``POST /v1/chat/completions`` (messages + tools -> chat template -> engine -> tool calls parsed into
``tool_calls``), ``POST /v1/completions`` (text or token-id prompts), ``GET /v1/models``, ``GET /health``, and
``POST /update_weights`` (``{"path": ...}``: a safetensors / torch state-dict file or a directory of safetensors
shards; only when the app was built with ``allow_weight_updates=True``).

As vLLM does, every choice carries the sampled ``token_ids`` and the response the ``prompt_token_ids``; with
``logprobs`` the log-probs come in the OpenAI shape, and ``return_tokens_as_token_ids: true`` writes each token
as ``"token_id:{id}"`` so a client can recover ids without the tokenizer. Log-probs follow the engine's
convention (the sampling distribution after temperature and top-p, see `orchard.rollout.engine`).
``top_logprobs`` > 0, ``echo`` and ``stream`` are refused with 400. ``stop`` strings are applied after
generation: the sample is cut after the token that completes the first stop string (those ids are kept, the text
ends before the stop string), finish reason ``stop``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from orchard._extras import requires_extra

with requires_extra("rollout"):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

from orchard.rollout.engine import Completion, Engine, GenerateRequest, SamplingParams
from orchard.rollout.tool_calls import parse_tool_calls


class RequestError(ValueError):
    """A request the server refuses (answered 400 in OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _error(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status
    )


_ROLES = ("system", "developer", "user", "assistant", "tool")


def flatten_content(content: Any) -> str | None:
    """OpenAI content (a string, None, or a list of ``{"type": "text", "text": ...}`` parts) as one string."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text"):
                raise RequestError(f"only text content parts are supported, got {part!r:.100}", "messages")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RequestError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and flatten their content for the chat template."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in _ROLES:
            raise RequestError(
                f"messages[{i}] must be a message with a valid role, got {message!r:.100}", "messages"
            )
        m = {k: v for k, v in message.items() if v is not None}
        m["content"] = flatten_content(message.get("content"))
        if m["role"] == "developer":
            m["role"] = "system"
        out.append(m)
    return out


def _int_field(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"{name} must be an int >= {minimum}, got {value!r}", name)
    return value


def sampling_from_body(
    body: Mapping[str, Any], *, default_max_tokens: int, extra_stop_ids: Sequence[int]
) -> SamplingParams:
    """OpenAI (+ vLLM) sampling fields -> `SamplingParams` (400 on bad values)."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise RequestError(f"stop_token_ids must be a list of ints, got {stop_ids!r}", "stop_token_ids")
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    try:
        return SamplingParams(
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            max_tokens=max_tokens,
            stop_token_ids=tuple(dict.fromkeys([*stop_ids, *extra_stop_ids])),
            seed=body.get("seed"),
            n=1 if body.get("n") is None else body.get("n"),
        )
    except ValueError as exc:
        raise RequestError(str(exc)) from exc


def stop_strings(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a string or a list of non-empty strings, got {stop!r}", "stop")
    return stop


def apply_stop_strings(
    tokenizer: Any, completion: Completion, stops: Sequence[str]
) -> tuple[Completion, str | None]:
    """Cut a completion after the token that completes the first of ``stops``; returns (completion, text) where
    text is the decoded output up to (excluding) the stop string, or None when no stop string occurs."""
    if not stops:
        return completion, None
    text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return completion, None
    pos, stop = min(hits)
    need = pos + len(stop)
    lo, hi = 1, len(completion.token_ids)  # smallest prefix whose text reaches past the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(completion.token_ids[:mid], skip_special_tokens=True)) >= need:
            hi = mid
        else:
            lo = mid + 1
    cut = Completion(completion.token_ids[:lo], completion.logprobs[:lo], "stop")
    return cut, text[:pos]


def _token_label(tokenizer: Any, token_id: int, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def load_state_dict_file(path: str | Path) -> dict[str, Any]:
    """Read weights for ``/update_weights``: a ``.safetensors`` file, a torch ``.pt``/``.bin`` state dict, or a
    directory of ``*.safetensors`` shards (as ``save_pretrained`` writes)."""
    import torch
    with requires_extra("rollout"):
        from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise ValueError(f"path {str(path)!r} is a directory without *.safetensors files")
        state: dict[str, Any] = {}
        for shard in shards:
            state.update(load_file(str(shard)))
        return state
    if path.suffix == ".safetensors":
        return load_file(str(path))
    if path.suffix in (".pt", ".bin", ".pth"):
        return torch.load(str(path), map_location="cpu", weights_only=True)
    raise ValueError(f"path must be a directory, .safetensors, .pt or .bin file, got {str(path)!r}")


def build_app(
    engine: Engine,
    tokenizer: Any,
    *,
    model_name: str = "orchard",
    default_max_tokens: int = 512,
    allow_weight_updates: bool = False,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine``.

    Args:
        engine: any `Engine` (token ids in, token ids + log-probs out).
        tokenizer: a transformers tokenizer with a chat template; its eos token ends chat turns.
        model_name: the id ``/v1/models`` lists and responses echo.
        default_max_tokens: ``max_tokens`` when a request gives none.
        allow_weight_updates: serve ``POST /update_weights`` (it reads files on this machine).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer must have a chat_template, got {type(tokenizer).__name__}")
    if not isinstance(default_max_tokens, int) or default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be an int >= 1, got {default_max_tokens!r}")
    app = FastAPI(title="orchard model server")
    eos_id = tokenizer.eos_token_id
    chat_stop_ids = [eos_id] if eos_id is not None else []
    created = int(time.time())

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise RequestError(f"body is not JSON: {exc.msg}") from exc
        if not isinstance(body, dict):
            raise RequestError("body must be a JSON object")
        if body.get("stream"):
            raise RequestError("stream is not supported", "stream")
        if body.get("echo"):
            raise RequestError("echo is not supported", "echo")
        return body

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, exc: RequestError) -> JSONResponse:
        return _error(400, str(exc), exc.param)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "orchard"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        body = await body_of(request)
        messages = normalize_messages(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list", "tools")
        if body.get("top_logprobs"):
            raise RequestError("top_logprobs > 0 is not supported", "top_logprobs")
        params = sampling_from_body(body, default_max_tokens=default_max_tokens, extra_stop_ids=chat_stop_ids)
        stops = stop_strings(body)
        try:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template error is the request's fault (e.g. a malformed tool call)
            raise RequestError(f"chat template failed: {exc}", "messages") from exc
        prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        result = (await engine.generate([GenerateRequest(prompt_ids, params)]))[0]
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        parse = body.get("tool_choice") != "none"
        choices = []
        for index, completion in enumerate(result.completions):
            completion, cut_text = apply_stop_strings(tokenizer, completion, stops)
            ids = completion.token_ids
            visible = (
                ids[:-1]
                if completion.finish_reason == "stop" and ids and ids[-1] in params.stop_token_ids
                else ids
            )
            out_text = (
                cut_text if cut_text is not None else tokenizer.decode(visible, skip_special_tokens=True)
            )
            message: dict[str, Any] = {"role": "assistant", "content": out_text}
            finish = completion.finish_reason
            if parse:
                parsed = parse_tool_calls(out_text)
                if parsed.tool_calls:
                    message["content"] = parsed.content or None
                    message["tool_calls"] = [
                        {
                            "id": f"call_{uuid.uuid4().hex[:12]}_{c.id}",
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments_json()},
                        }
                        for c in parsed.tool_calls
                    ]
                    if finish == "stop":
                        finish = "tool_calls"
            logprobs = None
            if body.get("logprobs"):
                logprobs = {
                    "content": [
                        {
                            "token": _token_label(tokenizer, t, as_ids),
                            "logprob": lp,
                            "bytes": list(tokenizer.decode([t], skip_special_tokens=False).encode("utf-8")),
                            "top_logprobs": [],
                        }
                        for t, lp in zip(ids, completion.logprobs, strict=True)
                    ]
                }
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "token_ids": ids,
                }
            )
        n_out = sum(len(c["token_ids"]) for c in choices)
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": n_out,
                    "total_tokens": len(prompt_ids) + n_out,
                },
                "prompt_token_ids": prompt_ids,
                "weight_version": result.weight_version,
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await body_of(request)
        prompts = _completion_prompts(
            body.get("prompt"), tokenizer, bool(body.get("add_special_tokens", True))
        )
        logprobs_k = _int_field(body, "logprobs", None, 0)
        if logprobs_k:
            raise RequestError("logprobs > 0 (top alternatives) is not supported; use 0", "logprobs")
        params = sampling_from_body(body, default_max_tokens=16, extra_stop_ids=[])  # OpenAI's default
        stops = stop_strings(body)
        results = await engine.generate([GenerateRequest(p, params) for p in prompts])
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for i, result in enumerate(results):
            for j, completion in enumerate(result.completions):
                completion, cut_text = apply_stop_strings(tokenizer, completion, stops)
                ids = completion.token_ids
                stopped_on_id = completion.finish_reason == "stop" and cut_text is None
                visible = ids[:-1] if stopped_on_id else ids
                text = (
                    cut_text if cut_text is not None else tokenizer.decode(visible, skip_special_tokens=True)
                )
                logprobs = None
                if logprobs_k is not None:
                    labels = [_token_label(tokenizer, t, as_ids) for t in ids]
                    offsets, acc = [], 0
                    for t in ids:
                        offsets.append(acc)
                        acc += len(tokenizer.decode([t], skip_special_tokens=True))
                    logprobs = {
                        "tokens": labels,
                        "token_logprobs": completion.logprobs,
                        "top_logprobs": [
                            {lab: lp} for lab, lp in zip(labels, completion.logprobs, strict=True)
                        ],
                        "text_offset": offsets,
                    }
                choices.append(
                    {
                        "index": i * params.n + j,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": completion.finish_reason,
                        "token_ids": ids,
                        "prompt_token_ids": list(result.prompt_ids),
                    }
                )
        n_in = sum(len(p) for p in prompts)
        n_out = sum(len(c["token_ids"]) for c in choices)
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": choices,
                "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
            }
        )

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        if not allow_weight_updates:
            return _error(403, "weight updates are disabled on this server (allow_weight_updates=False)")
        body = await body_of(request)
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise RequestError(f"path must be a non-empty string, got {path!r}", "path")
        try:
            state = await asyncio.to_thread(load_state_dict_file, path)
            await engine.update_weights(state)
        except (ValueError, OSError) as exc:
            raise RequestError(str(exc), "path") from exc
        return JSONResponse({"status": "ok", "weight_version": getattr(engine, "weight_version", None)})

    return app


def _completion_prompts(prompt: Any, tokenizer: Any, add_special_tokens: bool) -> list[list[int]]:
    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    if isinstance(prompt, str):
        prompts = [encode(prompt)]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [encode(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise RequestError(
            f"prompt must be a string, token ids, or a list of either, got {prompt!r:.100}", "prompt"
        )
    for p in prompts:
        if not p or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in p):
            raise RequestError("every prompt must encode to at least one non-negative token id", "prompt")
    return prompts


@contextmanager
def serve_in_thread(
    app: Any, host: str = "127.0.0.1", port: int = 0, *, startup_timeout_s: float = 30.0
) -> Iterator[str]:
    """Run ``app`` under uvicorn in a daemon thread for the duration of the block; yields its base URL.

    ``port=0`` picks a free port. The server is shut down (and the thread joined) on exit.
    """
    with requires_extra("rollout"):
        import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="orchard-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"server on {host}:{port} did not start within {startup_timeout_s} s")
        time.sleep(0.01)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
