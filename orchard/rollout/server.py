"""An OpenAI-compatible HTTP server over any `Engine`: what ``orchard serve-model`` runs.

Routes: ``POST /v1/chat/completions`` (messages + tools -> chat template -> engine -> tool calls parsed into
``tool_calls`` when the request offered tools), ``POST /v1/completions`` (text or token-id prompts; stops at the
end-of-turn / eos token unless ``ignore_eos``), ``GET /v1/models``, ``GET /health``, and ``POST /update_weights``
(``{"path": ...}``: a safetensors / torch state-dict file or a directory of safetensors shards; only when the app
was built with ``allow_weight_updates=True``).

As vLLM does, every choice carries the sampled ``token_ids`` and the response the ``prompt_token_ids``; with
``logprobs`` the log-probs come in the OpenAI shape, and ``return_tokens_as_token_ids: true`` writes each token
as ``"token_id:{id}"`` so a client can recover ids without the tokenizer. Log-probs follow the engine's
convention (the sampling distribution after temperature and top-p, see `orchard.rollout.engine`).

``stream: true`` answers with server-sent events (``chat.completion.chunk`` / ``text_completion`` chunks, each
choice's chunks carrying its new ``token_ids`` and log-probs, the first chat chunk the ``prompt_token_ids``; tool
calls arrive whole in the choice's last chunk; ``stream_options.include_usage`` adds a usage chunk before
``[DONE]``). See `orchard.rollout.streaming` for engines without ``generate_stream``.

Validation follows vLLM's server: a ``model`` other than the served one is a 404; a prompt that leaves no room in
the context, or an explicit ``max_tokens`` that does not fit after it, a 400; a seed outside the signed 64-bit
range a 400. Fields the engines do not implement (``response_format`` other than text, ``tool_choice`` other than
``auto`` / ``none``, ``logit_bias``, presence / frequency / repetition penalties, ``top_k``, ``min_p``, chat
``echo``, guided decoding) are refused with 400, never ignored. ``top_logprobs`` (chat) / ``logprobs: k`` (completions)
alternatives are scored by a forward pass over the engine's in-process model (`alternatives`), not streamed. Choice ``i`` of a seeded
request samples with `choice_seed` ``(seed, i)``. ``stop`` strings are applied to the decoded text: the sample is
cut after the token that completes the first stop string (those ids are kept, the text ends before the stop
string), finish reason ``stop``.

Scoring, in vLLM's request shape (`orchard.rollout.openai_engine` sends it to either server): a completion with
``echo: true`` starts each choice's text, ``token_ids``-free log-probs and offsets with the prompt (the first
prompt token's log-prob is ``null``), ``max_tokens: 0`` with ``echo`` returns the prompt alone, and
``prompt_logprobs: 0`` adds vLLM's per-choice ``prompt_logprobs`` (``[null, {"<id>": {"logprob", "rank",
"decoded_token"}}, ...]``, ``rank`` null). Prompt log-probs come from the engine's ``score`` (untempered, as
vLLM's); 400 for an engine without one, with ``stream``, and for ``prompt_logprobs`` > 0 or ``logprobs`` > 0 with
``echo`` (no prompt alternatives).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from orchard._extras import requires_extra

with requires_extra("rollout"):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

from orchard._uvicorn import quiet_shutdown_cancellations
from orchard.rollout.engine import (
    Completion,
    Engine,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    Scorer,
    ScoreRequest,
    choice_seed,
)
from orchard.rollout.streaming import ChoiceStreams, ChoiceText
from orchard.rollout.token_sampling import nucleus_logprobs
from orchard.rollout.tool_calls import parse_tool_calls


class RequestError(ValueError):
    """A request the server refuses (answered ``status``, default 400, in OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def _error(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status
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


_SEED_RANGE = (-(2**63), 2**63 - 1)
"""Seeds a request may give (a signed 64-bit int, as vLLM's server accepts)."""


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
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
        raise RequestError(f"seed must be in [-2**63, 2**63 - 1], got {seed}", "seed")
    try:
        return SamplingParams(
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            max_tokens=max_tokens,
            stop_token_ids=tuple(dict.fromkeys([*stop_ids, *extra_stop_ids])),
            seed=seed,
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


_UNHONOURED: dict[str, Any] = {
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "repetition_penalty": lambda v: v in (None, 1),
    "top_k": lambda v: v in (None, 0, -1),
    "min_p": lambda v: v in (None, 0),
    "min_tokens": lambda v: v in (None, 0),
    "response_format": lambda v: v is None or (isinstance(v, Mapping) and v.get("type") == "text"),
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "best_of": lambda v: v in (None, 1),
}
"""Sampling fields the engines do not implement, with the values that ask for nothing (accepted); any other value
is refused with 400 rather than silently ignored."""


def refuse_unhonoured(body: Mapping[str, Any]) -> None:
    """400 for a field in `_UNHONOURED` set to a value that asks for something the engines do not do."""
    for name, neutral in _UNHONOURED.items():
        if not neutral(body.get(name)):
            raise RequestError(f"{name}={body.get(name)!r:.100} is not supported by this server", name)


def choice_requests(prompt_ids: Sequence[int], params: SamplingParams) -> list[GenerateRequest]:
    """One single-sample request per choice, seeded with `choice_seed`."""
    return [
        GenerateRequest(prompt_ids, replace(params, n=1, seed=choice_seed(params.seed, i))) for i in range(params.n)
    ]


def fit_context(
    params: SamplingParams, body: Mapping[str, Any], prompt_len: int, max_model_len: int | None, param: str
) -> SamplingParams:
    """Check a prompt of ``prompt_len`` tokens against the context length, as vLLM does: the prompt must leave
    room for one token, and an explicit ``max_tokens`` must fit after it (400 otherwise); a default one is cut
    to the room left."""
    if max_model_len is None:
        return params
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"the model's context length is {max_model_len} tokens, and the prompt alone has {prompt_len}", param
        )
    explicit = body.get("max_completion_tokens", body.get("max_tokens")) is not None
    if params.max_tokens > room:
        if explicit:
            raise RequestError(
                f"the model's context length is {max_model_len} tokens; the prompt has {prompt_len} and "
                f"max_tokens asks for {params.max_tokens} more ({prompt_len + params.max_tokens} in all)",
                "max_tokens",
            )
        params = replace(params, max_tokens=room)
    return params


def _max_model_len(engine: Engine) -> int | None:
    config = getattr(getattr(engine, "model", None), "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def _end_of_turn_ids(engine: Engine, tokenizer: Any) -> list[int]:
    """The tokenizer's eos and the model's generation-config eos ids (one or a list), deduplicated."""
    ids: list[Any] = [tokenizer.eos_token_id]
    generation = getattr(getattr(engine, "model", None), "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and not isinstance(i, bool)))


def chat_message(text: str, parse_tools: bool) -> tuple[dict[str, Any], bool]:
    """The assistant message of a choice's text (tool-call blocks parsed into ``tool_calls`` when
    ``parse_tools``); returns (message, whether it holds tool calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if not parse_tools:
        return message, False
    parsed = parse_tool_calls(text)
    if not parsed.tool_calls:
        return message, False
    message["content"] = parsed.content or None
    message["tool_calls"] = [
        {
            "id": f"call_{uuid.uuid4().hex[:12]}_{c.id}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments_json()},
        }
        for c in parsed.tool_calls
    ]
    return message, True


_MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs``."""


def top_logprobs_k(engine: Engine, body: Mapping[str, Any], k: int | None, name: str) -> int:
    """How many alternatives per token a request asks for (0: none); 400 where they cannot be given: over
    `_MAX_TOP_LOGPROBS`, streamed, or an engine without an in-process ``model`` to score them with."""
    if not k:
        return 0
    if k > _MAX_TOP_LOGPROBS:
        raise RequestError(f"{name} must be <= {_MAX_TOP_LOGPROBS}, got {k}", name)
    if body.get("stream"):
        raise RequestError(f"{name} > 0 is not supported with stream", name)
    if not isinstance(getattr(engine, "model", None), torch.nn.Module):
        raise RequestError(f"{name} > 0 needs an engine with an in-process model", name)
    return k


async def alternatives(
    engine: Any, prompt_ids: Sequence[int], sampled: Sequence[int], params: SamplingParams, k: int
) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely ``(token id, log-prob)`` of the distribution each sampled token was drawn from
    (tempered, top-p nucleus, as `nucleus_logprobs`), scored by one forward pass over prompt + sample on a worker
    thread (the engine's sampled log-probs stay the engine's). Tokens outside the nucleus get -9999.0, as vLLM
    writes -inf in JSON."""

    def score() -> list[list[tuple[int, float]]]:
        model = engine.model
        device = next(model.parameters()).device
        ids = torch.tensor([[*prompt_ids, *sampled[:-1]]], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 :]  # [S, V]
        steps = logits.shape[0]
        logp_SV = nucleus_logprobs(
            logits,
            torch.full((steps,), float(params.temperature), device=device),
            torch.full((steps,), float(params.top_p), device=device),
        )
        values, indices = logp_SV.topk(min(k, logp_SV.shape[1]), dim=-1)  # [S, k]
        values = values.clamp(min=-9999.0)
        return [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]

    return await asyncio.to_thread(score) if sampled else []


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


_SSE_DONE = b"data: [DONE]\n\n"


def build_app(
    engine: Engine,
    tokenizer: Any,
    *,
    model_name: str = "orchard",
    default_max_tokens: int = 512,
    allow_weight_updates: bool = False,
    max_model_len: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine``.

    Args:
        engine: any `Engine` (token ids in, token ids + log-probs out); one with ``generate_stream`` streams
            tokens as they are sampled.
        tokenizer: a transformers tokenizer with a chat template; its eos token ends chat turns and completions.
        model_name: the id ``/v1/models`` lists, responses echo, and requests must name (404 otherwise).
        default_max_tokens: ``max_tokens`` of a chat request that gives none (cut to the context left).
        allow_weight_updates: serve ``POST /update_weights`` (it reads files on this machine).
        max_model_len: the context length (prompt + completion); default the engine model's
            ``config.max_position_embeddings``, else unchecked.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer must have a chat_template, got {type(tokenizer).__name__}")
    if not isinstance(default_max_tokens, int) or default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be an int >= 1, got {default_max_tokens!r}")
    if max_model_len is None:
        max_model_len = _max_model_len(engine)
    elif isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise ValueError(f"max_model_len must be an int >= 2 or None, got {max_model_len!r}")
    app = FastAPI(title="orchard model server")
    eot_ids = _end_of_turn_ids(engine, tokenizer)
    created = int(time.time())

    async def body_of(request: Request, *, generation: bool = True) -> dict[str, Any]:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise RequestError(f"body is not JSON: {exc.msg}") from exc
        if not isinstance(body, dict):
            raise RequestError("body must be a JSON object")
        if not generation:
            return body
        if body.get("model") != model_name:
            raise RequestError(
                f"the model {body.get('model')!r} does not exist; this server serves {model_name!r}",
                "model",
                status=404,
                code="model_not_found",
            )
        refuse_unhonoured(body)
        stream_options = body.get("stream_options")
        if stream_options is not None and not isinstance(stream_options, Mapping):
            raise RequestError(f"stream_options must be an object, got {stream_options!r:.100}", "stream_options")
        return body

    def wants_usage(body: Mapping[str, Any]) -> bool:
        return bool((body.get("stream_options") or {}).get("include_usage"))

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, str(exc), exc.param, code=exc.code)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "orchard"}],
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await body_of(request)
        if body.get("echo"):
            raise RequestError("echo is not supported for chat completions", "echo")
        messages = normalize_messages(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list", "tools")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise RequestError(
                f"tool_choice {tool_choice!r:.100} is not supported (only 'auto' and 'none')", "tool_choice"
            )
        top_k = top_logprobs_k(engine, body, _int_field(body, "top_logprobs", None, 0), "top_logprobs")
        params = sampling_from_body(body, default_max_tokens=default_max_tokens, extra_stop_ids=eot_ids)
        stops = stop_strings(body)
        try:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template error is the request's fault (e.g. a malformed tool call)
            raise RequestError(f"chat template failed: {exc}", "messages") from exc
        prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        params = fit_context(params, body, len(prompt_ids), max_model_len, "messages")
        requests = choice_requests(prompt_ids, params)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        want_logprobs = bool(body.get("logprobs"))
        parse = tools is not None and tool_choice != "none"

        def entry(t: int, lp: float) -> dict[str, Any]:
            label = _token_label(tokenizer, t, as_ids)
            return {"token": label, "logprob": lp, "bytes": list(tokenizer.decode([t]).encode("utf-8"))}

        def logprob_entries(
            ids: Sequence[int], lps: Sequence[float], top: list[list[tuple[int, float]]] | None = None
        ) -> list[dict[str, Any]]:
            return [
                {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top[k]] if top else []}
                for k, (t, lp) in enumerate(zip(ids, lps, strict=True))
            ]

        if body.get("stream"):
            return StreamingResponse(
                chat_stream(body, requests, prompt_ids, stops, params, parse, want_logprobs, logprob_entries),
                media_type="text/event-stream",
            )
        results = await engine.generate(requests)
        choices = []
        for index, result in enumerate(results):
            completion, cut_text = apply_stop_strings(tokenizer, result.completions[0], stops)
            ids = completion.token_ids
            top = await alternatives(engine, prompt_ids, ids, params, top_k) if want_logprobs and top_k else None
            visible = (
                ids[:-1]
                if completion.finish_reason == "stop" and ids and ids[-1] in params.stop_token_ids
                else ids
            )
            out_text = (
                cut_text if cut_text is not None else tokenizer.decode(visible, skip_special_tokens=True)
            )
            message, has_calls = chat_message(out_text, parse)
            finish = completion.finish_reason
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": {"content": logprob_entries(ids, completion.logprobs, top)} if want_logprobs else None,
                    "finish_reason": "tool_calls" if has_calls and finish == "stop" else finish,
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
                "weight_version": min(r.weight_version for r in results),
            }
        )

    async def chat_stream(
        body: Mapping[str, Any],
        requests: list[GenerateRequest],
        prompt_ids: list[int],
        stops: list[str],
        params: SamplingParams,
        parse: bool,
        want_logprobs: bool,
        logprob_entries: Any,
    ) -> AsyncIterator[bytes]:
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name}
        usage = wants_usage(body)

        def chunk(choice: dict[str, Any], **extra: Any) -> bytes:
            return _sse({**head, "choices": [choice], **({"usage": None} if usage else {}), **extra})

        texts = [ChoiceText(tokenizer, stops, params.stop_token_ids, parse) for _ in requests]
        for i in range(len(requests)):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None, "token_ids": []}
            yield chunk(first, **({"prompt_token_ids": prompt_ids} if i == 0 else {}))
        streams = ChoiceStreams(engine, requests)
        try:
            while (event := await streams.next()) is not None:
                i, state = event.index, texts[event.index]
                if event.error is not None:
                    yield _sse({"error": {"message": f"generation failed: {event.error}", "type": "server_error"}})
                    return
                if event.token is not None:
                    delta = state.add(event.token, event.logprob)
                    yield chunk({
                        "index": i,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": {"content": logprob_entries([event.token], [event.logprob])}
                        if want_logprobs else None,
                        "finish_reason": None,
                        "token_ids": [event.token],
                    })
                    if not state.stopped:
                        continue
                    streams.stop(i)
                finish = "stop" if state.stopped else event.finish
                message, has_calls = chat_message(state.text(), parse)
                delta = {"content": rest} if (rest := state.rest(message["content"])) else {}
                if has_calls:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                    finish = "tool_calls" if finish == "stop" else finish
                yield chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": finish,
                             "token_ids": []})
        finally:
            await streams.aclose()
        if usage:
            n_out = sum(len(t.token_ids) for t in texts)
            yield _sse({**head, "choices": [], "usage": {"prompt_tokens": len(prompt_ids),
                        "completion_tokens": n_out, "total_tokens": len(prompt_ids) + n_out}})
        yield _SSE_DONE

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await body_of(request)
        prompts = _completion_prompts(
            body.get("prompt"), tokenizer, bool(body.get("add_special_tokens", True))
        )
        logprobs_k = _int_field(body, "logprobs", None, 0)
        top_k = top_logprobs_k(engine, body, logprobs_k, "logprobs")
        echo, prompt_k = bool(body.get("echo")), _int_field(body, "prompt_logprobs", None, 0)
        check_scoring(body, echo, prompt_k, logprobs_k)
        echo_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0  # vLLM's echo without generation
        # vLLM's default: stop at the end of turn / eos unless `ignore_eos`
        stop_ids = [] if body.get("ignore_eos") else eot_ids
        params = sampling_from_body(  # OpenAI's default max_tokens: 16
            {**body, "max_tokens": 1} if echo_only else body, default_max_tokens=16, extra_stop_ids=stop_ids
        )
        stops = stop_strings(body)
        for p in sorted(prompts, key=len)[-1:]:  # the longest prompt bounds them all
            params = fit_context(params, body, len(p), max_model_len, "prompt")
        requests = [r for p in prompts for r in choice_requests(p, params)]
        as_ids = bool(body.get("return_tokens_as_token_ids"))

        def logprobs_of(
            ids: Sequence[int], lps: Sequence[float | None], start: int,
            top: list[list[tuple[int, float]]] | None = None,
        ) -> dict[str, Any]:
            labels = [_token_label(tokenizer, t, as_ids) for t in ids]
            offsets, acc = [], start
            for t in ids:
                offsets.append(acc)
                acc += len(tokenizer.decode([t], skip_special_tokens=True))
            tops = [
                None if lp is None else
                {**{_token_label(tokenizer, a, as_ids): alp for a, alp in (top[k] if top else [])}, lab: lp}
                for k, (lab, lp) in enumerate(zip(labels, lps, strict=True))
            ]
            return {"tokens": labels, "token_logprobs": list(lps), "top_logprobs": tops, "text_offset": offsets}

        if body.get("stream"):
            return StreamingResponse(
                completion_stream(body, requests, stops, params, logprobs_k is not None, logprobs_of),
                media_type="text/event-stream",
            )
        scored = (echo and logprobs_k is not None) or prompt_k is not None
        prompt_lps = await score_prompts(engine, prompts) if scored else [[] for _ in prompts]
        if echo_only:
            results = [GenerateResult(tuple(r.prompt_ids), [Completion([], [], "length")]) for r in requests]
        else:
            results = await engine.generate(requests)
        choices = []
        for index, result in enumerate(results):
            completion, cut_text = apply_stop_strings(tokenizer, result.completions[0], stops)
            ids = completion.token_ids
            top = await alternatives(engine, result.prompt_ids, ids, params, top_k) if top_k else None
            stopped_on_id = completion.finish_reason == "stop" and cut_text is None
            visible = ids[:-1] if stopped_on_id else ids
            text = cut_text if cut_text is not None else tokenizer.decode(visible, skip_special_tokens=True)
            shown_ids, shown_lps = ids, list(completion.logprobs)
            prompt, prompt_lp = list(result.prompt_ids), [None, *prompt_lps[index // params.n]]
            if echo:
                text = tokenizer.decode(prompt, skip_special_tokens=False) + text
                shown_ids, shown_lps = [*prompt, *ids], [*prompt_lp, *shown_lps]
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs_of(shown_ids, shown_lps, 0, top) if logprobs_k is not None else None,
                "finish_reason": completion.finish_reason,
                "token_ids": ids,
                "prompt_token_ids": prompt,
            }
            if prompt_k is not None:
                choice["prompt_logprobs"] = [
                    None if lp is None else {str(t): {"logprob": lp, "rank": None,
                                                      "decoded_token": _token_label(tokenizer, t, as_ids)}}
                    for t, lp in zip(prompt, prompt_lp, strict=True)
                ]
            choices.append(choice)
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

    async def completion_stream(
        body: Mapping[str, Any],
        requests: list[GenerateRequest],
        stops: list[str],
        params: SamplingParams,
        want_logprobs: bool,
        logprobs_of: Any,
    ) -> AsyncIterator[bytes]:
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        usage = wants_usage(body)

        def chunk(choice: dict[str, Any]) -> bytes:
            return _sse({**head, "choices": [choice], **({"usage": None} if usage else {})})

        texts = [ChoiceText(tokenizer, stops, params.stop_token_ids, False) for _ in requests]
        offsets = [0] * len(requests)
        streams = ChoiceStreams(engine, requests)
        try:
            while (event := await streams.next()) is not None:
                i, state = event.index, texts[event.index]
                if event.error is not None:
                    yield _sse({"error": {"message": f"generation failed: {event.error}", "type": "server_error"}})
                    return
                if event.token is not None:
                    first = not state.token_ids
                    delta = state.add(event.token, event.logprob)
                    logprobs = None
                    if want_logprobs:
                        logprobs = logprobs_of([event.token], [event.logprob], offsets[i])
                        offsets[i] += len(tokenizer.decode([event.token], skip_special_tokens=True))
                    extra = {"prompt_token_ids": list(requests[i].prompt_ids)} if first else {}
                    yield chunk({"index": i, "text": delta, "logprobs": logprobs, "finish_reason": None,
                                 "token_ids": [event.token], **extra})
                    if not state.stopped:
                        continue
                    streams.stop(i)
                finish = "stop" if state.stopped else event.finish
                yield chunk({"index": i, "text": state.rest(state.text()), "logprobs": None,
                             "finish_reason": finish, "token_ids": []})
        finally:
            await streams.aclose()
        if usage:
            n_in = sum(len(r.prompt_ids) for r in requests[:: params.n])
            n_out = sum(len(t.token_ids) for t in texts)
            yield _sse({**head, "choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                                         "total_tokens": n_in + n_out}})
        yield _SSE_DONE

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        if not allow_weight_updates:
            return _error(403, "weight updates are disabled on this server (allow_weight_updates=False)")
        body = await body_of(request, generation=False)
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


def check_scoring(body: Mapping[str, Any], echo: bool, prompt_k: int | None, logprobs_k: int | None) -> None:
    """400 for the scoring requests this server cannot answer (module docstring)."""
    if prompt_k:
        raise RequestError(f"prompt_logprobs must be 0 (the prompt token's own log-prob), got {prompt_k}",
                           "prompt_logprobs")
    if echo and logprobs_k:
        raise RequestError(f"logprobs must be 0 with echo (no alternatives for prompt tokens), got {logprobs_k}",
                           "logprobs")
    if (echo or prompt_k is not None) and body.get("stream"):
        raise RequestError("echo and prompt_logprobs are not supported with stream", "stream")


async def score_prompts(engine: Any, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
    """The untempered log-prob of every prompt token after the first (`orchard.rollout.engine.Scorer`)."""
    if not isinstance(engine, Scorer):
        raise RequestError("echo with logprobs and prompt_logprobs need an engine that scores (Scorer.score)",
                           "prompt_logprobs")
    long = [i for i, p in enumerate(prompts) if len(p) > 1]
    scores = await engine.score([ScoreRequest(prompts[i][:1], prompts[i][1:]) for i in long])
    out: list[list[float]] = [[] for _ in prompts]
    for i, lps in zip(long, scores, strict=True):
        out[i] = lps
    return out


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
    quiet_shutdown_cancellations()  # a request cut off when the block ends is no error of the app
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
