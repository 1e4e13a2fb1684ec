"""`HFEngine`: batched sampling from a Hugging Face causal LM with our own loop over the KV cache.

Why our own loop instead of ``model.generate``: the log-prob of every sampled token is taken from the very
distribution it was drawn from (see `orchard.rollout.engine` for the convention), per-row sampling parameters and
seeds can differ within one batch, and nothing is re-tokenized.

Concurrent `generate` calls are gathered by an asyncio queue into batches of at most ``max_batch_size`` rows
(waiting up to ``batch_wait_s`` for more rows once the first arrives). A batch is left-padded, prefilled once, then
decoded one token per step for all its rows until every row has stopped; the forward passes run in a worker
thread so the event loop (a server, the agent loop's sandbox calls) keeps running. Batches are static: a request
that arrives while a batch decodes waits for the next one.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from orchard._extras import requires_extra
from orchard.rollout.engine import (
    Completion,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    validate_requests,
)


@dataclass
class _Row:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    sample_index: int
    future: asyncio.Future[tuple[Completion, int]]


def nucleus_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probs of the distribution a row samples from: tempered softmax restricted to its top-p nucleus.

    Args:
        logits: ``[B, V]`` raw next-token logits.
        temperature: ``[B]`` temperatures; a row with 0 is greedy and gets the untempered ``log_softmax(logits)``.
        top_p: ``[B]`` nucleus masses in (0, 1]. The nucleus is the smallest set of most likely tokens whose
            tempered probability reaches ``top_p`` (always at least the top token); outside it the result is -inf.

    Returns:
        ``[B, V]`` float32 log-probs, ``log softmax(logits / T)`` renormalised over the nucleus.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if temperature.shape != (batch,) or top_p.shape != (batch,):
        raise ValueError(
            f"temperature and top_p must be [B]={batch}, got {tuple(temperature.shape)} and {tuple(top_p.shape)}"
        )
    temp_B = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    logp_BV = torch.log_softmax(logits.float() / temp_B[:, None], dim=-1)  # [B, V]
    if bool((top_p < 1).any()):
        sorted_BV, order_BV = logp_BV.sort(dim=-1, descending=True)
        mass_before_BV = sorted_BV.exp().cumsum(dim=-1) - sorted_BV.exp()  # probability mass strictly above
        drop_sorted_BV = mass_before_BV >= top_p.float()[:, None]
        drop_sorted_BV[:, 0] = False
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        logp_BV = torch.log_softmax(logp_BV.masked_fill(drop_BV, float("-inf")), dim=-1)
    return logp_BV


class HFEngine:
    """An `Engine` over a Hugging Face causal LM (CPU or GPU).

    Args:
        model: a causal LM whose forward accepts ``input_ids, attention_mask, position_ids`` and a KV cache; it is
            put in eval mode and used where it lives (its device and dtype).
        pad_token_id: id written into padding positions (never attended to); default the model config's pad id,
            else 0.
        max_batch_size: most rows (a request with ``n`` samples is ``n`` rows) in one forward batch. Default 32.
        batch_wait_s: how long the batcher waits for more rows after the first arrives. Default 0.005 s.
        seed: seeds the generator of rows whose request has no seed. Default 0.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_token_id: int | None = None,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.005,
        seed: int = 0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module causal LM, got {type(model).__name__}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not batch_wait_s >= 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s!r}")
        self.model = model.eval()
        config = getattr(model, "config", None)
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        self.max_batch_size = max_batch_size
        self.batch_wait_s = float(batch_wait_s)
        self.weight_version = 0
        self._seed = int(seed)
        self._generator: torch.Generator | None = None
        params = inspect.signature(model.forward).parameters
        # transformers renamed `past_key_values` to `cache` in 5.2x; accept both.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._workers: dict[asyncio.AbstractEventLoop, tuple[asyncio.Queue[_Row], asyncio.Task[None]]] = {}
        self._model_lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- async interface -------------------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Sample every request; concurrent calls share forward batches. Results are in request order."""
        requests = validate_requests(requests)
        if not requests:
            return []
        queue = self._ensure_worker()
        loop = asyncio.get_running_loop()
        futures: list[list[asyncio.Future[tuple[Completion, int]]]] = []
        for request in requests:
            row_futures = []
            for i in range(request.params.n):
                future: asyncio.Future[tuple[Completion, int]] = loop.create_future()
                queue.put_nowait(_Row(tuple(request.prompt_ids), request.params, i, future))
                row_futures.append(future)
            futures.append(row_futures)
        results = []
        for request, row_futures in zip(requests, futures, strict=True):
            done = await asyncio.gather(*row_futures)
            completions = [completion for completion, _ in done]
            version = min(version for _, version in done)
            results.append(GenerateResult(tuple(request.prompt_ids), completions, weight_version=version))
        return results

    async def update_weights(self, weights: Any) -> None:
        """Load new weights (a state dict or a module with the same parameter names) once the running batch ends.

        Missing keys are allowed only for parameters tied to a loaded one (e.g. ``lm_head.weight`` tied to the
        embeddings); unexpected keys are an error. Increments ``weight_version``.
        """
        if isinstance(weights, nn.Module):
            weights = weights.state_dict()
        if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
            raise ValueError(
                f"weights must be a state dict of tensors or an nn.Module, got {type(weights).__name__}"
            )
        await asyncio.to_thread(self._load_state_dict, weights)

    async def close(self) -> None:
        """Stop this event loop's batching worker (others stop with their loops). Idempotent."""
        entry = self._workers.pop(asyncio.get_running_loop(), None)
        if entry is not None and not entry[1].done():
            entry[1].cancel()
            try:
                await entry[1]
            except asyncio.CancelledError:
                pass

    # ---- batching ----------------------------------------------------------------------------------------------

    def _ensure_worker(self) -> asyncio.Queue[_Row]:
        # One queue and worker per event loop (a server thread and the caller's loop may share the engine); the
        # model itself is guarded by a thread lock, so batches of different loops run one after another.
        loop = asyncio.get_running_loop()
        entry = self._workers.get(loop)
        if entry is None or entry[1].done():
            for other in [lp for lp in self._workers if lp.is_closed()]:
                del self._workers[other]
            queue: asyncio.Queue[_Row] = asyncio.Queue()
            entry = (queue, loop.create_task(self._work(queue)))
            self._workers[loop] = entry
        return entry[0]

    async def _work(self, queue: asyncio.Queue[_Row]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            deadline = loop.time() + self.batch_wait_s
            while len(batch) < self.max_batch_size:
                if not queue.empty():
                    batch.append(queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), remaining))
                except TimeoutError:
                    break
            batch = [row for row in batch if not row.future.done()]  # drop rows whose caller gave up
            if not batch:
                continue
            try:
                completions, version = await asyncio.to_thread(self._locked_batch, batch)
            except Exception as exc:  # the callers see the failure; the worker keeps serving
                for row in batch:
                    if not row.future.done():
                        row.future.set_exception(exc)
                continue
            for row, completion in zip(batch, completions, strict=True):
                if not row.future.done():
                    row.future.set_result((completion, version))

    def _locked_batch(self, batch: list[_Row]) -> tuple[list[Completion], int]:
        with self._model_lock:
            return self.generate_batch(batch), self.weight_version

    # ---- the sampling loop --------------------------------------------------------------------------------------

    @staticmethod
    def _row_generator(row: _Row, device: torch.device) -> torch.Generator:
        assert row.params.seed is not None
        return torch.Generator(device=device).manual_seed(row.params.seed + row.sample_index)

    @torch.no_grad()
    def generate_batch(self, rows: Sequence[_Row]) -> list[Completion]:
        """Sample one static batch synchronously (what the worker thread runs)."""
        device = self.device
        batch = len(rows)
        prompt_len = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((batch, prompt_len), self.pad_token_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros((batch, prompt_len), dtype=torch.long, device=device)
        for b, row in enumerate(rows):  # left padding: every row's last prompt token sits in the last column
            input_ids[b, prompt_len - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids, device=device)
            attention_mask[b, prompt_len - len(row.prompt_ids) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        temperature_B = torch.tensor([r.params.temperature for r in rows], device=device)
        top_p_B = torch.tensor([r.params.top_p for r in rows], device=device)
        greedy = [r.params.temperature == 0 for r in rows]
        seeded = [b for b, r in enumerate(rows) if r.params.seed is not None and r.params.temperature > 0]
        generators = {b: self._row_generator(rows[b], device) for b in seeded}
        max_tokens = [r.params.max_tokens for r in rows]
        stops = [set(r.params.stop_token_ids) for r in rows]
        out_ids: list[list[int]] = [[] for _ in rows]
        out_logprobs: list[list[float]] = [[] for _ in rows]
        finish: list[str | None] = [None] * batch

        cache = self._new_cache()
        step_ids = input_ids
        for _ in range(max(max_tokens)):
            kwargs = {self._cache_kwarg: cache}
            logits = self.model(
                input_ids=step_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            ).logits[:, -1, :]  # [B, V]
            logp_BV = nucleus_logprobs(logits, temperature_B, top_p_B)
            next_B = self._sample(logp_BV, greedy, seeded, generators, finish)
            picked_B = logp_BV.gather(1, next_B[:, None])[:, 0].tolist()
            next_list = next_B.tolist()
            for b in range(batch):
                if finish[b] is not None:
                    continue
                out_ids[b].append(next_list[b])
                out_logprobs[b].append(float(picked_B[b]))
                if next_list[b] in stops[b]:
                    finish[b] = "stop"
                elif len(out_ids[b]) >= max_tokens[b]:
                    finish[b] = "length"
            if all(f is not None for f in finish):
                break
            step_ids = next_B[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1
        return [
            Completion(token_ids=ids, logprobs=lps, finish_reason=reason)  # type: ignore[arg-type]
            for ids, lps, reason in zip(out_ids, out_logprobs, finish, strict=True)
        ]

    def _sample(
        self,
        logp_BV: torch.Tensor,
        greedy: list[bool],
        seeded: list[int],
        generators: dict[int, torch.Generator],
        finish: list[str | None],
    ) -> torch.Tensor:
        """Next token per row: argmax for greedy rows, one batched draw from the engine's generator for unseeded
        rows, a draw from its own generator for each seeded row; finished rows get the pad id."""
        device = logp_BV.device
        next_B = logp_BV.argmax(dim=-1)  # [B]
        seeded_set = set(seeded)
        shared = [
            b for b in range(len(finish)) if not greedy[b] and b not in seeded_set and finish[b] is None
        ]
        if shared:
            if self._generator is None or self._generator.device != device:
                self._generator = torch.Generator(device=device).manual_seed(self._seed)
            idx = torch.tensor(shared, device=device)
            next_B[idx] = torch.multinomial(logp_BV[idx].exp(), 1, generator=self._generator)[:, 0]
        for b in seeded:
            if finish[b] is None:
                next_B[b] = torch.multinomial(logp_BV[b].exp(), 1, generator=generators[b])[0]
        done = [b for b in range(len(finish)) if finish[b] is not None]
        if done:
            next_B[torch.tensor(done, device=device)] = self.pad_token_id
        return next_B

    def _new_cache(self) -> Any:
        with requires_extra("rollout"):
            from transformers import DynamicCache

        return DynamicCache(config=getattr(self.model, "config", None))

    def _load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        expected = set(self.model.state_dict())
        unexpected = set(state_dict) - expected
        if unexpected:
            raise ValueError(f"weights has keys the model does not: {sorted(unexpected)[:5]}")
        missing = expected - set(state_dict)
        by_storage: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            by_storage.setdefault(param.data_ptr(), []).append(name)
        tied_to_loaded = {
            name for names in by_storage.values() if any(n in state_dict for n in names) for name in names
        }
        buffers = {name for name, _ in self.model.named_buffers()}
        untied_missing = [k for k in missing if k not in tied_to_loaded and k not in buffers]
        if untied_missing:
            raise ValueError(f"weights lacks parameters of the model: {sorted(untied_missing)[:5]}")
        with self._model_lock:
            self.model.load_state_dict(state_dict, strict=False)
            self.weight_version += 1
