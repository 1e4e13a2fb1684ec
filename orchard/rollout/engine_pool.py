"""`EnginePool`: one `Engine` over several replicas (``orchard serve-model`` or vLLM servers behind `OpenAIEngine`).

Routing, per request:

- **sticky per episode**: a prompt that continues an earlier request's prompt + completion (the next turn of the
  same episode: previous prompt, the sampled answer, then the tool's observation) goes to the replica that served
  that request, whose prefix cache still holds the episode's KV;
- **balanced by load** otherwise (first turns, evicted episodes): the replica with the fewest requests in flight,
  ties broken round-robin.

Every result carries the pool's ``weight_version`` (the agent loop records it per turn in
``metadata["weight_versions"]``), so a trainer knows how many updates old a sample is.

Weight sync (``update_weights``): the pool stops handing out requests, waits until none is in flight, then asks
every replica at once to load the same checkpoint (a state dict is saved once under ``save_dir`` and its path
POSTed to each ``/update_weights``), bumps the version and opens again. No request is ever served while some
replicas are updated and others not, and no sample mixes two versions within one request. A replica that fails
its update is taken out of rotation (``down``), so the pool never serves from a stale replica either.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import warnings
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orchard.rollout.engine import Engine, GenerateRequest, GenerateResult, validate_requests

__all__ = ["EnginePool"]


class EnginePool:
    """Args:
    engines: the replicas (each an `Engine`; usually `OpenAIEngine`s, see `from_urls`).
    push_weights: whether ``update_weights`` sends the weights to the replicas. Under several training ranks
        sharing the same replicas, rank 0 pushes (``push_weights=ranks.is_main``) and the other ranks' pools only
        drain and follow the version. Default True.
    save_dir: where a state dict passed to ``update_weights`` is saved (once) for the replicas to load; it must
        be readable by every replica (same machine or a shared file system). Needed only for state dicts.
    keep_files: saved weight files kept on disk (older ones are deleted once every replica loaded a newer one).
        Default 2.
    max_episodes: episodes remembered for stickiness (least recently used forgotten first). Default 4096.
    """

    def __init__(self, engines: Sequence[Engine], *, push_weights: bool = True, save_dir: str | None = None,
                 keep_files: int = 2, max_episodes: int = 4096) -> None:
        engines = list(engines)
        if not engines:
            raise ValueError("engines must hold at least one engine, got none")
        for i, engine in enumerate(engines):
            if not isinstance(engine, Engine):
                raise ValueError(f"engines[{i}] must be an Engine (generate, update_weights, close), "
                                 f"got {type(engine).__name__}")
        for name, value in (("keep_files", keep_files), ("max_episodes", max_episodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.engines = engines
        self.push_weights = bool(push_weights)
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.keep_files = keep_files
        self.max_episodes = max_episodes
        self.weight_version = 0
        self.down: set[int] = set()
        """Replicas out of rotation (their weight update failed)."""
        self.in_flight = [0] * len(engines)
        self.served = [0] * len(engines)
        """Requests each replica answered (for load reports)."""
        self._episodes: OrderedDict[tuple[int, int], int] = OrderedDict()  # (length, hash of ids) -> replica
        self._lengths: Counter[int] = Counter()
        self._next = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._saved: list[Path] = []

    def _sync_primitives(self) -> None:
        """(Re)create the pause and drain primitives for the running loop: asyncio binds them to the first loop
        that waits on them, and a recipe may call ``asyncio.run`` more than once with the same pool."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._open = asyncio.Event()
            self._open.set()
            self._drained = asyncio.Condition()

    @classmethod
    def from_urls(cls, urls: Sequence[str], model: str = "orchard", **kwargs: Any) -> EnginePool:
        """A pool of `OpenAIEngine`s, one per base URL; ``kwargs`` go to the pool (``push_weights``, ``save_dir``,
        ...) or, for ``api_key`` / ``timeout_s`` / ``retries`` / ``max_connections``, to every engine."""
        from orchard.rollout.openai_engine import OpenAIEngine

        if isinstance(urls, str) or not urls:
            raise ValueError(f"urls must be a non-empty list of base URLs, got {urls!r}")
        engine_keys = {"api_key", "timeout_s", "retries", "max_connections"}
        engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in engine_keys}
        return cls([OpenAIEngine(url, model, **engine_kwargs) for url in urls], **kwargs)

    # ---- routing -------------------------------------------------------------------------------------------------

    def _key(self, ids: bytes, length: int) -> tuple[int, int]:
        return length, hash(ids[: 8 * length])

    def _route(self, prompt_ids: Sequence[int]) -> int:
        ids = np.asarray(prompt_ids, dtype=np.int64).tobytes()
        # Longest remembered sequence first: the latest turn of the episode this prompt continues.
        for length in sorted((n for n in self._lengths if n <= len(prompt_ids)), reverse=True):
            key = self._key(ids, length)
            replica = self._episodes.pop(key, None)
            if replica is not None:
                self._forget_length(length)
                if replica not in self.down:
                    return replica
        live = [i for i in range(len(self.engines)) if i not in self.down]
        if not live:
            raise RuntimeError("every replica of the pool is down (failed weight updates)")
        start = next(self._next)
        order = live[start % len(live):] + live[:start % len(live)]
        return min(order, key=lambda i: self.in_flight[i])

    def _forget_length(self, length: int) -> None:
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]

    def _remember(self, prompt_ids: Sequence[int], result: GenerateResult, replica: int) -> None:
        for completion in result.completions:
            sequence = [*prompt_ids, *completion.token_ids]
            key = self._key(np.asarray(sequence, dtype=np.int64).tobytes(), len(sequence))
            if key not in self._episodes:
                self._lengths[key[0]] += 1
            self._episodes[key] = replica
            self._episodes.move_to_end(key)
        while len(self._episodes) > self.max_episodes:
            (length, _), _ = self._episodes.popitem(last=False)
            self._forget_length(length)

    # ---- the Engine interface ------------------------------------------------------------------------------------

    async def _one(self, request: GenerateRequest) -> GenerateResult:
        self._sync_primitives()
        await self._open.wait()
        replica = self._route(request.prompt_ids)
        version = self.weight_version
        self.in_flight[replica] += 1
        try:
            (result,) = await self.engines[replica].generate([request])
        finally:
            self.in_flight[replica] -= 1
            async with self._drained:
                self._drained.notify_all()
        self.served[replica] += 1
        self._remember(request.prompt_ids, result, replica)
        return GenerateResult(result.prompt_ids, result.completions, weight_version=version)

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Each request routed on its own (sticky, else least loaded), all concurrently; results in request order,
        each with the pool's ``weight_version`` when it was sent (an update waits for it to finish)."""
        requests = validate_requests(requests)
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def update_weights(self, weights: Any) -> None:
        """Pause, drain, have every live replica load ``weights`` at once, bump the version, resume.

        ``weights`` is a checkpoint path the replicas can read, or a state dict (saved once under ``save_dir``).
        A replica whose update fails leaves the rotation with a warning; ``RuntimeError`` when none succeeded.
        With ``push_weights=False`` the replicas are left alone (another rank updates them) and only the version
        follows.
        """
        if self.push_weights:
            path = self._save(weights)
        self._sync_primitives()
        self._open.clear()
        try:
            async with self._drained:
                await self._drained.wait_for(lambda: not any(self.in_flight))
            if self.push_weights:
                live = [i for i in range(len(self.engines)) if i not in self.down]
                outcomes = await asyncio.gather(*(self.engines[i].update_weights(path) for i in live),
                                                return_exceptions=True)
                failed = {i: o for i, o in zip(live, outcomes, strict=True) if isinstance(o, BaseException)}
                self.down |= set(failed)
                if len(failed) == len(live):
                    raise RuntimeError(f"no replica loaded {path!r}: {next(iter(failed.values()))!r}")
                if failed:
                    warnings.warn(f"replicas {sorted(failed)} failed to load {path!r} and leave the pool: "
                                  f"{list(failed.values())!r}", RuntimeWarning, stacklevel=2)
                self._prune(path)
            self.weight_version += 1
        finally:
            self._open.set()

    def _save(self, weights: Any) -> str:
        if isinstance(weights, (str, os.PathLike)):
            return str(weights)
        if not isinstance(weights, Mapping):
            raise ValueError(f"weights must be a checkpoint path or a state dict, got {type(weights).__name__}")
        if self.save_dir is None:
            raise ValueError("save_dir must be set to push a state dict (the replicas load it from a file), got None")
        import torch

        self.save_dir.mkdir(parents=True, exist_ok=True)
        path = self.save_dir / f"weights_v{self.weight_version + 1:06d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(dict(weights), tmp)
        tmp.replace(path)  # a replica never reads a half-written file
        self._saved.append(path)
        return str(path)

    def _prune(self, loaded: str) -> None:
        while len(self._saved) > self.keep_files and str(self._saved[0]) != loaded:
            self._saved.pop(0).unlink(missing_ok=True)

    async def close(self) -> None:
        """Close every replica's client. Idempotent."""
        await asyncio.gather(*(engine.close() for engine in self.engines))
