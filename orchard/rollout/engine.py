"""The engine interface: asynchronous generation from prompt token ids to sampled token ids and their log-probs.

Every engine (`HFEngine`, `VLLMEngine`, `OpenAIEngine`) takes token ids, not text, so the caller controls the exact
prompt the trainer will later render, and returns the exact ids it sampled, so nothing is re-tokenized between
sampling and training.

Log-prob convention (all engines): the log-probability of each sampled token under the distribution it was drawn
from, i.e. ``log_softmax(logits / temperature)`` restricted to the top-p nucleus and renormalised over it. With
``top_p = 1`` this is exactly what a trainer computes as ``log_softmax(logits / temperature)`` at the sampled ids.
At ``temperature = 0`` (greedy) it is ``log_softmax(logits)`` at the argmax.

Scoring (optional, `Scorer`): an engine that can also *score* given tokens answers ``score(requests)`` with the
log-prob of each completion token after its prompt under the untempered model, ``log_softmax(logits)`` (no
temperature, no nucleus): what on-policy distillation needs from a teacher (`orchard.stages.distill`).
`HFEngine` scores with one batched forward pass; `OpenAIEngine` through ``/v1/completions`` with
``echo`` and ``prompt_logprobs`` (vLLM's way, which ``orchard serve-model`` accepts too).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]
"""``stop``: a stop token was sampled (it is the last of ``token_ids``); ``length``: ``max_tokens`` ran out."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed``: ``seed`` itself for the first, then a hash of
    ``(seed, index)`` in ``[0, 2**63)``, so that seed ``s``'s second choice is not seed ``s + 1``'s first."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def derive_seed(seed: int, *parts: str | int) -> int:
    """A seed for one named piece of a seeded run: a hash of ``(seed, *parts)`` in ``[0, 2**63)``.

    What makes a run's episodes independent of how it is split: the seed of episode ``j`` of task ``t`` is
    ``derive_seed(run_seed, t, j)`` wherever that episode is played (one process or any rank of many, in any batch),
    and the seed of its turn ``k`` is ``derive_seed(episode_seed, k)``. Distinct parts give unrelated seeds, so
    ``derive_seed(s, "a", 1)`` is not ``derive_seed(s, "a1")`` and task ``t``'s episodes share nothing with ``t + 1``'s.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise ValueError(f"parts must be str or int, got {part!r}")
    # repr keeps 1 and "1" apart; the unit separator keeps ("a", "b") apart from ("a\x1fb",) in practice
    key = "\x1f".join(repr(x) for x in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 keeps the whole vocabulary."""
    max_tokens: int = 256
    """Most tokens to sample (the stop token counts)."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling one of these ends the sample (finish reason ``stop``); the stop token is kept in ``token_ids``."""
    seed: int | None = None
    """Per-request seed: sample ``i`` of the request draws from a generator seeded with `choice_seed` ``(seed, i)``
    (``seed`` itself for the first sample)."""
    n: int = 1
    """Independent samples of the same prompt."""

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt (token ids) and how to sample it."""

    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        ids = list(self.prompt_ids)
        if not ids:
            raise ValueError("prompt_ids must hold at least one token id, got an empty sequence")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError(f"prompt_ids must be non-negative ints, got {ids[:8]!r}...")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")
        object.__setattr__(self, "prompt_ids", tuple(ids))


@dataclass
class Completion:
    """One sample: the sampled ids, their log-probs (one per id, same length) and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass
class GenerateResult:
    """The answer to one `GenerateRequest`: ``n`` completions, and the weight version that produced them."""

    prompt_ids: tuple[int, ...]
    completions: list[Completion]
    weight_version: int = 0
    """Incremented by every `update_weights`; lets a trainer measure how off-policy a sample is."""


@runtime_checkable
class Engine(Protocol):
    """What the server, the proxy and the agent loop need from an inference engine.

    Optional beyond these: ``score`` (`Scorer`), the teacher's side of on-policy distillation.
    """

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Sample every request (concurrent calls may be batched together); results in request order."""
        ...

    async def update_weights(self, weights: Any) -> None:
        """Replace the policy's weights (a state dict, a model, or an engine-specific handle such as a path);
        waits for in-flight generation to finish first."""
        ...

    async def close(self) -> None:
        """Release workers, connections and memory. Idempotent."""
        ...


@dataclass(frozen=True)
class ScoreRequest:
    """Token ids to score: ``completion_ids`` after ``prompt_ids`` (the prompt's own tokens are not scored)."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "completion_ids"):
            ids = list(getattr(self, name))
            if not ids:
                raise ValueError(f"{name} must hold at least one token id, got an empty sequence")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise ValueError(f"{name} must be non-negative ints, got {ids[:8]!r}...")
            object.__setattr__(self, name, tuple(ids))


@runtime_checkable
class Scorer(Protocol):
    """The optional scoring capability of an engine (`HFEngine`, `OpenAIEngine`, `EnginePool`)."""

    async def score(self, requests: Sequence[ScoreRequest]) -> list[list[float]]:
        """Per request, ``len(completion_ids)`` log-probs: entry ``j`` is ``log p(completion_ids[j] | prompt_ids
        + completion_ids[:j])`` under the model's untempered distribution ``log_softmax(logits)``. In request
        order; an empty sequence of requests gets ``[]``."""
        ...


def validate_score_requests(requests: Sequence[ScoreRequest]) -> list[ScoreRequest]:
    """Check the argument of `Scorer.score`: a sequence of `ScoreRequest` (possibly empty)."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise ValueError(f"requests must be a sequence of ScoreRequest, got {type(requests).__name__}")
    for i, request in enumerate(requests):
        if not isinstance(request, ScoreRequest):
            raise ValueError(f"requests[{i}] must be a ScoreRequest, got {type(request).__name__}")
    return list(requests)


def validate_requests(requests: Sequence[GenerateRequest]) -> list[GenerateRequest]:
    """Check the argument of `Engine.generate`: a sequence of `GenerateRequest` (possibly empty)."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise ValueError(f"requests must be a sequence of GenerateRequest, got {type(requests).__name__}")
    for i, request in enumerate(requests):
        if not isinstance(request, GenerateRequest):
            raise ValueError(f"requests[{i}] must be a GenerateRequest, got {type(request).__name__}")
    return list(requests)
