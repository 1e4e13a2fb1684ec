"""`OpenAIEngine`: the `Engine` interface over any OpenAI-compatible server that returns token ids and log-probs.

It sends token-id prompts to ``POST /v1/completions`` (one HTTP call per request, all concurrent) with
``logprobs: 0``, ``return_token_ids: true`` and ``return_tokens_as_token_ids: true``, and reads the sampled ids
from the choice's ``token_ids`` (vLLM >= 0.10.2 and ``orchard serve-model``) or, failing that, from the
``token_id:{id}`` labels of its log-probs (older vLLM). Servers: ``orchard serve-model``, or ``vllm serve MODEL
--logprobs-mode processed_logprobs`` (vLLM reports the raw model's log-probs by default; the processed mode gives
the log-probs of the distribution after temperature and top-p, our convention).

Scoring (`OpenAIEngine.score`, a teacher's log-probs of given tokens): vLLM's way, which ``orchard serve-model``
accepts too: ``POST /v1/completions`` with the prompt = prompt + completion ids, ``max_tokens: 1``, ``echo: true``,
``logprobs: 0``, ``prompt_logprobs: 0`` and ``temperature: 1``. The choice's ``prompt_logprobs`` (vLLM's field: one
entry per prompt token, ``null`` for the first, else ``{"<id>": {"logprob": ...}}``) gives each token's log-prob;
a server without that field is read from the echoed ``logprobs.token_logprobs``. vLLM computes prompt log-probs
from the raw logits (no temperature, no top-p, whatever ``--logprobs-mode``): the untempered convention of
`orchard.rollout.engine.Scorer`. The one token sampled after the echo is ignored (``max_tokens: 0`` with ``echo``
is refused by some servers).

Weights: ``update_weights(path)`` asks the server to load a checkpoint from ``path`` (``POST /update_weights``,
served by ``orchard serve-model --allow-weight-updates``). vLLM's server has no such route: restart it, or use
`VLLMEngine` in-process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from orchard._extras import requires_extra
from orchard._retry import backoff_s

with requires_extra("rollout"):
    import httpx

from orchard.rollout.engine import (
    Completion,
    GenerateRequest,
    GenerateResult,
    ScoreRequest,
    validate_requests,
    validate_score_requests,
)

_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class OpenAIEngine:
    """Args:
    base_url: the server's root (``http://host:port``; a trailing ``/v1`` is accepted).
    model: the model name sent with each request (``/v1/models`` lists it).
    api_key: sent as ``Authorization: Bearer``; None sends none.
    timeout_s: per HTTP call. Default 600.
    retries: extra attempts on connection errors and 408/429/5xx, with exponential backoff and jitter
        (`orchard._retry.backoff_s`, base 0.25 s). Default 3.
    max_connections: concurrent HTTP connections. Default 256.
    """

    def __init__(
        self,
        base_url: str,
        model: str = "orchard",
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 3,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.retries = retries
        self.weight_version = 0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            final = attempt == self.retries
            try:
                response = await self._http.post(path, json=body)
            except httpx.TransportError:
                if final:
                    raise
            else:
                if response.status_code == 200:
                    return response.json()
                if response.status_code not in _RETRY_STATUSES or final:
                    raise RuntimeError(f"POST {path} answered {response.status_code}: {response.text[:500]}")
            await asyncio.sleep(backoff_s(attempt, base_s=0.25))
        raise AssertionError("unreachable")

    async def _one(self, request: GenerateRequest) -> GenerateResult:
        p = request.params
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(request.prompt_ids),
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "n": p.n,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.seed is not None:
            body["seed"] = p.seed
        data = await self._post("/v1/completions", body)
        choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != p.n:
            raise RuntimeError(f"server returned {len(choices)} choices for n={p.n}")
        return GenerateResult(tuple(request.prompt_ids), [parse_completion_choice(c) for c in choices])

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """One concurrent HTTP call per request; results in request order."""
        requests = validate_requests(requests)
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def _score_one(self, request: ScoreRequest) -> list[float]:
        ids = [*request.prompt_ids, *request.completion_ids]
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "echo": True,
            "logprobs": 0,
            "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        data = await self._post("/v1/completions", body)
        choices = data.get("choices") or []
        if not choices:
            raise RuntimeError("the server returned no choice for a scoring request")
        return parse_prompt_logprobs(choices[0], ids)[len(request.prompt_ids) - 1 :]

    async def score(self, requests: Sequence[ScoreRequest]) -> list[list[float]]:
        """The untempered log-prob of each completion token (`orchard.rollout.engine.Scorer`); one concurrent
        HTTP call per request, results in request order."""
        requests = validate_score_requests(requests)
        return list(await asyncio.gather(*(self._score_one(r) for r in requests)))

    async def update_weights(self, weights: Any) -> None:
        """Ask the server to load the checkpoint at ``weights`` (a path on the server's machine)."""
        if not isinstance(weights, str):
            raise ValueError(
                "weights must be a checkpoint path the server can read (save the state dict first), "
                f"got {type(weights).__name__}"
            )
        data = await self._post("/update_weights", {"path": weights})
        self.weight_version = int(data.get("weight_version") or self.weight_version + 1)

    async def close(self) -> None:
        await self._http.aclose()


def parse_completion_choice(choice: dict[str, Any]) -> Completion:
    """A ``/v1/completions`` choice with token ids and log-probs -> `Completion`.

    Ids come from ``token_ids`` or the ``token_id:{id}`` log-prob labels; log-probs from
    ``logprobs.token_logprobs``. ``ValueError`` when the server returned neither form of ids, or no log-probs.
    """
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        labels = logprobs.get("tokens") or []
        if not labels or not all(isinstance(t, str) and t.startswith("token_id:") for t in labels):
            raise ValueError(
                "the server returned no token ids (needs `token_ids` or `return_tokens_as_token_ids` support)"
            )
        ids = [int(t.removeprefix("token_id:")) for t in labels]
    lps = logprobs.get("token_logprobs")
    if lps is None or len(lps) != len(ids):
        raise ValueError(
            f"the server returned {None if lps is None else len(lps)} log-probs for {len(ids)} tokens"
        )
    reason = choice.get("finish_reason")
    return Completion(
        [int(t) for t in ids], [float(x) for x in lps], "length" if reason == "length" else "stop"
    )


def parse_prompt_logprobs(choice: dict[str, Any], prompt_ids: Sequence[int]) -> list[float]:
    """The log-probs of ``prompt_ids[1:]`` from an echoed ``/v1/completions`` choice (``len(prompt_ids) - 1``).

    Read from vLLM's ``prompt_logprobs`` (``[null, {"<id>": {"logprob": x, ...}}, ...]``), else from the echoed
    ``logprobs`` (``token_logprobs[0]`` is null; when the tokens are ``token_id:{id}`` labels they are checked
    against ``prompt_ids``). ``ValueError`` when neither holds a log-prob for every prompt token after the first.
    """
    n = len(prompt_ids)
    entries = choice.get("prompt_logprobs")
    if entries is not None:
        if len(entries) != n:
            raise ValueError(f"the server returned {len(entries)} prompt_logprobs entries for {n} prompt tokens")
        out = []
        for j in range(1, n):
            entry = (entries[j] or {}).get(str(prompt_ids[j]))
            if entry is None:
                raise ValueError(f"the server's prompt_logprobs[{j}] has no log-prob for token {prompt_ids[j]}")
            out.append(float(entry["logprob"] if isinstance(entry, dict) else entry))
        return out
    logprobs = choice.get("logprobs") or {}
    lps = logprobs.get("token_logprobs") or []
    labels = logprobs.get("tokens") or []
    if len(lps) < n or any(lp is None for lp in lps[1:n]):
        raise ValueError(
            f"the server echoed {len(lps)} log-probs for {n} prompt tokens (needs echo with logprobs, or vLLM's "
            "prompt_logprobs)"
        )
    for j, label in enumerate(labels[:n]):
        if isinstance(label, str) and label.startswith("token_id:") and int(label[9:]) != prompt_ids[j]:
            raise ValueError(f"the server echoed token {label!r} at prompt position {j}, sent {prompt_ids[j]}")
    return [float(lp) for lp in lps[1:n]]
