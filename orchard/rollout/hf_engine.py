"""`HFEngine`: sampling from a Hugging Face causal LM with continuous batching and a prefix cache.

Why our own loop instead of ``model.generate``: the log-prob of every sampled token is taken from the very
distribution it was drawn from (see `orchard.rollout.engine` for the convention), per-row sampling parameters and
seeds can differ within one batch, and nothing is re-tokenized.

How it serves, as serving engines do: one scheduler thread owns the model. Requests from any number of concurrent
`generate` calls (any event loop) land in a queue; between two decode steps the scheduler prefills the rows that
arrived and they join the running batch, and a row that stops leaves it at once and frees its slot. The KV cache of
a finished row is kept in a prefix store (`orchard.rollout.kv_cache`), so the next turn of an agent episode, whose
prompt starts with the previous prompt and completion, prefills only its new tokens. Per step the batch shares one
forward, one batched draw and one device-to-host copy; the per-row Python is the bookkeeping of its output.

`HFEngine.score` (a teacher's log-probs of given tokens) runs on the same thread, between two decode steps: one
forward pass per ``max_batch_size`` sequences, ordered with weight updates like any arriving row.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from orchard.rollout.engine import (
    Completion,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    ScoreRequest,
    choice_seed,
    validate_requests,
    validate_score_requests,
)
from orchard.rollout.fast_decode import DecodeForward, unsupported_reason
from orchard.rollout.kv_cache import BatchCache, PrefixStore, check_cache_layers, prefill_inputs
from orchard.rollout.token_sampling import inverse_cdf_sample, nucleus_logprobs

_UNIFORMS_PER_DRAW = 64
"""A row's generator fills its uniforms this many at a time (one call, not one per token)."""


@dataclass(eq=False)
class _Row:
    """One sample of one request, from its arrival to its completion."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    sample_index: int
    future: asyncio.Future[tuple[Completion, int]]
    loop: asyncio.AbstractEventLoop
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    version: int = 0
    generator: torch.Generator | None = None
    prefix_key: int | None = None
    """The prefix-store entry its prompt reused, if any."""
    uniforms: list[float] = field(default_factory=list)
    on_token: Callable[[int, float], None] | None = None
    """Called on the scheduler thread with each sampled token and its log-prob (`HFEngine.generate_stream`)."""

    def next_uniform(self) -> float:
        """The next draw of this row's own uniform stream, so its samples do not depend on its batch mates."""
        if not self.uniforms:
            assert self.generator is not None
            self.uniforms = torch.rand(
                _UNIFORMS_PER_DRAW, generator=self.generator, dtype=torch.float64
            ).tolist()
            self.uniforms.reverse()
        return self.uniforms.pop()

    def record(self, token: int, logprob: float) -> bool:
        """Append a sampled token; True when the row has finished."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if self.on_token is not None:
            self.on_token(token, logprob)
        if token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def cached_ids(self) -> tuple[int, ...]:
        """The tokens whose keys and values are in the cache: all but the last sampled one (never fed back)."""
        return self.prompt_ids + tuple(self.token_ids[:-1])


@dataclass
class _WeightUpdate:
    state_dict: dict[str, torch.Tensor]
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


@dataclass
class _ScoreJob:
    requests: list[ScoreRequest]
    future: asyncio.Future[list[list[float]]]
    loop: asyncio.AbstractEventLoop


_STOP = object()


def _resolve(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any, error: bool = False
) -> None:
    """Hand a result to the caller's event loop from the scheduler thread (a closed loop's caller is gone)."""

    def settle() -> None:
        if not future.done():
            if error:
                future.set_exception(value)
            else:
                future.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


@dataclass
class _Running:
    """The rows decoding together and their per-row tensors, batch axis in ``rows`` order."""

    rows: list[_Row]
    cache: BatchCache
    next_B: torch.Tensor
    """``[B]`` long: each row's last sampled token, fed at the next step."""
    positions_B: torch.Tensor
    """``[B]`` long: the position of that token."""
    temperature_B: torch.Tensor
    top_p_B: torch.Tensor
    greedy_B: torch.Tensor

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.next_B.device)
        self.rows = [self.rows[b] for b in keep]
        self.cache.select(keep)
        for name in ("next_B", "positions_B", "temperature_B", "top_p_B", "greedy_B"):
            setattr(self, name, getattr(self, name).index_select(0, index))

    def extend(self, other: _Running) -> None:
        self.rows += other.rows
        self.cache.extend(other.cache)
        for name in ("next_B", "positions_B", "temperature_B", "top_p_B", "greedy_B"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))


class HFEngine:
    """An `Engine` over a Hugging Face causal LM (CPU or GPU) with continuous batching and a prefix cache.

    Args:
        model: a causal LM with full-attention layers whose forward accepts ``input_ids, attention_mask,
            position_ids`` and a KV cache; it is put in eval mode and used where it lives (its device and dtype).
        pad_token_id: id written into padding positions (never attended to); default the model config's pad id,
            else 0.
        max_batch_size: most rows (a request with ``n`` samples is ``n`` rows) decoding together. Default 32.
        batch_wait_s: when no row is decoding, how long the engine waits after the first arrival for more rows to
            prefill with it. A row arriving while others decode joins at the next step without waiting.
            Default 0.005 s.
        seed: seeds the generators of rows whose request has no seed (one per row, drawn in arrival order).
            Default 0.
        prefix_cache_tokens: most tokens whose KV cache is kept after their row finishes, for a later prompt that
            starts with them (an episode's next turn prefills only its new tokens). Memory per token: 2 x layers x
            KV heads x head dim x dtype bytes (Qwen3-8B in bf16: 144 KiB). 0 disables. Default 65536.
        fast_decode: decode steps and prefill on `orchard.rollout.fast_decode.DecodeForward` (the engine's own
            forward over the same parameters, without the model forward's per-call mask, rotary and dispatch
            work; speed in ``benchmarks/README.md``) instead of the model's forward.
            ``"auto"``: when the model is supported (Qwen3, Qwen2, Llama, Mistral with the default rope and full
            attention), else the model's forward; ``True``: required, ``ValueError`` naming the reason otherwise;
            ``False``: always the model's forward. `score` always uses the model's forward. Default ``"auto"``.
        compile_decode: run the fast decode step through ``torch.compile`` (inductor): its element-wise ops
            (norms, rotary, SiLU, residuals, mask, softmax) fuse into a few kernels. The engine compiles it when
            built (`DecodeForward.warm_up`: tens of seconds on CPU, once per process: one graph serves every batch
            size and cache length; a compile that fails raises here), then every step is cheaper: worth it for a
            run that samples many thousands of tokens. Needs the fast decode forward (``ValueError`` naming the reason otherwise); weight updates reach it
            as they reach the eager step. Default False.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_token_id: int | None = None,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.005,
        seed: int = 0,
        prefix_cache_tokens: int = 65536,
        fast_decode: bool | str = "auto",
        compile_decode: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module causal LM, got {type(model).__name__}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not batch_wait_s >= 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s!r}")
        if not isinstance(prefix_cache_tokens, int) or prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be an int >= 0, got {prefix_cache_tokens!r}")
        if not (isinstance(fast_decode, bool) or fast_decode == "auto"):
            raise ValueError(f"fast_decode must be 'auto', True or False, got {fast_decode!r}")
        if not isinstance(compile_decode, bool):
            raise ValueError(f"compile_decode must be True or False, got {compile_decode!r}")
        self.model = model.eval()
        self._config = getattr(model, "config", None)
        check_cache_layers(self._config)
        if pad_token_id is None:
            pad_token_id = getattr(self._config, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        self.max_batch_size = max_batch_size
        self.batch_wait_s = float(batch_wait_s)
        self.weight_version = 0
        self._seed_stream = torch.Generator().manual_seed(int(seed))
        params = inspect.signature(model.forward).parameters
        # transformers renamed `past_key_values` to `cache` in 5.2x; accept both.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._prefixes = PrefixStore(prefix_cache_tokens)
        reason = unsupported_reason(model) if fast_decode is not False else "fast_decode is False"
        if fast_decode is True and reason is not None:
            raise ValueError(f"fast_decode=True but the model is not supported: {reason}")
        if compile_decode and reason is not None:
            raise ValueError(f"compile_decode=True needs the fast decode forward: {reason}")
        self._decoder = DecodeForward(model, compiled=compile_decode) if reason is None else None
        if self._decoder is not None:
            self._decoder.warm_up()  # the compile (tens of seconds) here, not in a first episode's time budget
        self._running: _Running | None = None
        # The scheduler thread and its inbox are replaced together under this lock, so a row is never put into
        # the inbox of a thread that is stopping.
        self._thread_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- async interface -------------------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Sample every request; rows of concurrent calls decode together. Results are in request order."""
        requests = validate_requests(requests)
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        rows = [
            [_Row(tuple(r.prompt_ids), r.params, i, loop.create_future(), loop) for i in range(r.params.n)]
            for r in requests
        ]
        self._submit([row for request_rows in rows for row in request_rows])
        try:
            results = []
            for request, request_rows in zip(requests, rows, strict=True):
                done = await asyncio.gather(*(row.future for row in request_rows))
                completions = [completion for completion, _ in done]
                version = min(version for _, version in done)
                results.append(GenerateResult(tuple(request.prompt_ids), completions, weight_version=version))
            return results
        finally:
            for request_rows in rows:  # a caller that gave up frees its rows' slots at the next step
                for row in request_rows:
                    row.future.cancel()

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[tuple[int, float]]:
        """Sample one request with ``n == 1``, yielding each ``(token_id, logprob)`` as the scheduler samples it.

        The row decodes in the running batch like any `generate` row (same seed, same tokens). The stream ends
        after the stop token or the ``max_tokens``-th token; leaving the iteration early frees the row's slot at
        the next step.
        """
        if not isinstance(request, GenerateRequest):
            raise ValueError(f"request must be a GenerateRequest, got {type(request).__name__}")
        if request.params.n != 1:
            raise ValueError(f"request.params.n must be 1 to stream, got {request.params.n}")
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[tuple[int, float]] = asyncio.Queue()

        def on_token(token: int, logprob: float) -> None:
            try:
                loop.call_soon_threadsafe(tokens.put_nowait, (token, logprob))
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass

        row = _Row(tuple(request.prompt_ids), request.params, 0, loop.create_future(), loop, on_token=on_token)
        self._submit([row])
        try:
            while True:
                get = asyncio.ensure_future(tokens.get())
                await asyncio.wait({get, row.future}, return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield get.result()
                    continue
                get.cancel()
                # Tokens and the result reach this loop in the order the scheduler sent them: all are queued.
                row.future.result()
                while not tokens.empty():
                    yield tokens.get_nowait()
                return
        finally:
            row.future.cancel()

    async def update_weights(self, weights: Any) -> None:
        """Load new weights (a state dict or a module with the same parameter names) once no row is decoding.

        Rows already decoding finish with the old weights; rows that have not started wait and use the new ones.
        Stored prefix caches were computed with the old weights and are dropped. Missing keys are allowed only for
        parameters tied to a loaded one (e.g. ``lm_head.weight`` tied to the embeddings); unexpected keys are an
        error. Increments ``weight_version``.
        """
        if isinstance(weights, nn.Module):
            weights = weights.state_dict()
        if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
            raise ValueError(
                f"weights must be a state dict of tensors or an nn.Module, got {type(weights).__name__}"
            )
        self._check_weights(weights)
        loop = asyncio.get_running_loop()
        update = _WeightUpdate(weights, loop.create_future(), loop)
        self._submit(update)
        await update.future

    async def score(self, requests: Sequence[ScoreRequest]) -> list[list[float]]:
        """Per request, the untempered log-prob ``log_softmax(logits)`` of each completion token after its prompt
        and the completion tokens before it (see `orchard.rollout.engine.Scorer`).

        Runs on the scheduler thread between decode steps: requests are left-padded together, up to
        ``max_batch_size`` per forward pass, and only the logits of the last ``longest completion + 1`` positions
        are computed. A score submitted after an `update_weights` uses the new weights.
        """
        requests = validate_score_requests(requests)
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        job = _ScoreJob(requests, loop.create_future(), loop)
        self._submit(job)
        return await job.future

    async def close(self) -> None:
        """Stop the scheduler thread; rows not finished fail with ``RuntimeError``. A later `generate` starts a new
        one. Idempotent."""
        with self._thread_lock:
            thread, inbox = self._thread, self._inbox
            self._thread, self._inbox = None, queue.SimpleQueue()
            if thread is not None:
                inbox.put(_STOP)
        if thread is not None:
            await asyncio.to_thread(thread.join)

    def _submit(self, item: Any) -> None:
        with self._thread_lock:
            if self._thread is None or not self._thread.is_alive():
                self._inbox = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._serve, args=(self._inbox,), name="HFEngine-scheduler", daemon=True
                )
                self._thread.start()
            self._inbox.put(item)

    # ---- the scheduler thread ---------------------------------------------------------------------------------

    def _receive(self, inbox: queue.SimpleQueue[Any], block: bool) -> list[Any]:
        items = []
        if block:
            items.append(inbox.get())
            deadline = time.monotonic() + self.batch_wait_s
            while sum(len(i) for i in items if isinstance(i, list)) < self.max_batch_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    items.append(inbox.get(timeout=remaining))
                except queue.Empty:
                    break
        while True:
            try:
                items.append(inbox.get_nowait())
            except queue.Empty:
                return items

    def _serve(self, inbox: queue.SimpleQueue[Any]) -> None:
        # Grad mode is per thread: this one never builds a graph.
        with torch.no_grad():
            waiting: list[_Row] = []
            updates: list[_WeightUpdate] = []
            scores: list[_ScoreJob] = []
            while True:
                idle = self._running is None and not waiting and not updates and not scores
                for item in self._receive(inbox, block=idle):
                    if item is _STOP:
                        self._fail_all(inbox, waiting, [*updates, *scores])
                        return
                    if isinstance(item, _WeightUpdate):
                        updates.append(item)
                    elif isinstance(item, _ScoreJob):
                        scores.append(item)
                    else:
                        waiting.extend(item)
                waiting = [row for row in waiting if not row.future.done()]
                if updates and self._running is None:
                    self._apply_updates(updates)
                    updates = []
                if scores and not updates:  # a score waits for an update submitted before it, as rows do
                    for job in scores:
                        self._run_score(job)
                    scores = []
                running = 0 if self._running is None else len(self._running.rows)
                if waiting and not updates and running < self.max_batch_size:
                    admitted = waiting[: self.max_batch_size - running]
                    waiting = waiting[len(admitted) :]
                    self._guarded(self._admit, admitted)
                if self._running is not None:
                    self._guarded(self._step, self._running.rows)

    def _guarded(self, work: Any, rows: list[_Row]) -> None:
        """Run one forward's work; if it fails, its rows fail with the error and the scheduler keeps serving. A
        failed decode step also fails the running batch (its cache may be half updated); a failed prefill leaves
        the running rows decoding (it only touches them once it succeeded)."""
        try:
            work(rows)
        except Exception as exc:
            failed = list(rows)
            if work == self._step and self._running is not None:
                failed, self._running = self._running.rows, None
            for row in failed:
                _resolve(row.loop, row.future, exc, error=True)

    def _fail_all(
        self, inbox: queue.SimpleQueue[Any], waiting: list[_Row], updates: list[_WeightUpdate | _ScoreJob]
    ) -> None:
        rows = waiting + (self._running.rows if self._running is not None else [])
        self._running = None
        for item in self._receive(inbox, block=False):
            if isinstance(item, (_WeightUpdate, _ScoreJob)):
                updates.append(item)
            elif isinstance(item, list):
                rows.extend(item)
        error = RuntimeError("HFEngine was closed before this request finished")
        for row in rows:
            _resolve(row.loop, row.future, error, error=True)
        for update in updates:
            _resolve(update.loop, update.future, error, error=True)

    def _apply_updates(self, updates: list[_WeightUpdate]) -> None:
        for update in updates:
            try:
                self.model.load_state_dict(update.state_dict, strict=False)
            except Exception as exc:
                _resolve(update.loop, update.future, exc, error=True)
                continue
            self._prefixes.clear()  # computed with the old weights: never reused after an update
            self.weight_version += 1
            _resolve(update.loop, update.future, None)

    def _run_score(self, job: _ScoreJob) -> None:
        if job.future.done():  # the caller gave up
            return
        try:
            scores: list[list[float]] = []
            for start in range(0, len(job.requests), self.max_batch_size):
                scores += self._score_chunk(job.requests[start : start + self.max_batch_size])
        except Exception as exc:
            _resolve(job.loop, job.future, exc, error=True)
        else:
            _resolve(job.loop, job.future, scores)

    def _score_chunk(self, requests: list[ScoreRequest]) -> list[list[float]]:
        """One forward over left-padded prompt + completion rows; each row's completion is its last tokens, so
        the last ``K = longest completion + 1`` positions hold every logit that predicts a completion token."""
        device = self.device
        seqs = [(*r.prompt_ids, *r.completion_ids) for r in requests]
        width = max(len(seq) for seq in seqs)
        ids_BL = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask_BL = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, seq in enumerate(seqs):
            ids_BL[b, width - len(seq) :] = torch.tensor(seq)
            mask_BL[b, width - len(seq) :] = 1
        ids_BL, mask_BL = ids_BL.to(device), mask_BL.to(device)
        positions_BL = (mask_BL.cumsum(dim=1) - 1).clamp(min=0)
        keep = max(len(r.completion_ids) for r in requests) + 1
        logits_BKV = self.model(
            input_ids=ids_BL, attention_mask=mask_BL, position_ids=positions_BL, use_cache=False,
            logits_to_keep=keep,
        ).logits[:, -keep:]
        # local position j predicts the token at global position width - keep + j + 1
        logp_BK = torch.log_softmax(logits_BKV[:, :-1].float(), dim=-1).gather(
            -1, ids_BL[:, width - keep + 1 :, None]
        )[..., 0]  # [B, K - 1]
        host = logp_BK.double().cpu()
        return [host[b, host.shape[1] - len(r.completion_ids) :].tolist() for b, r in enumerate(requests)]

    # ---- prefill, decode, sample ------------------------------------------------------------------------------

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: BatchCache
    ) -> torch.Tensor:
        """The model's own forward over ``[B, S]`` new tokens; their keys and values go into ``cache``'s buffers
        (room reserved, mask set), which then advances ``S`` columns. Returns the last position's logits."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache.hf_cache(self._config)},
        )
        cache.advance(input_ids.shape[1])
        return out.logits[:, -1, :]  # [B, V]

    def _admit(self, rows: list[_Row]) -> None:
        """Prefill newly arrived rows together (each after its longest stored prefix), sample their first tokens,
        and add the rows that go on to the running batch."""
        device = self.device
        for row in rows:
            row.version = self.weight_version
            if row.params.temperature > 0:
                seed = row.params.seed
                seed = int(torch.randint(2**62, (1,), generator=self._seed_stream)) if seed is None else seed
                row.generator = torch.Generator().manual_seed(choice_seed(seed, row.sample_index))
        found = [self._prefixes.lookup(row.prompt_ids) for row in rows]
        for row, (_, _, key) in zip(rows, found, strict=True):
            row.prefix_key = key
        inputs = prefill_inputs(
            self._config,
            [kv for _, kv, _ in found],
            [row.prompt_ids[n:] for (n, _, _), row in zip(found, rows, strict=True)],
            self.pad_token_id,
            device,
        )
        if self._decoder is not None:
            logits = self._decoder.prefill(
                inputs.input_ids, inputs.attention_mask, inputs.position_ids, inputs.cache
            )
            inputs.cache.advance(inputs.input_ids.shape[1])
        else:
            logits = self._forward(inputs.input_ids, inputs.attention_mask, inputs.position_ids, inputs.cache)
        temperature_B = torch.tensor([r.params.temperature for r in rows], device=device)
        new = _Running(
            rows=rows,
            cache=inputs.cache,
            next_B=torch.zeros(len(rows), dtype=torch.long, device=device),
            positions_B=torch.tensor([len(r.prompt_ids) for r in rows], device=device),
            temperature_B=temperature_B,
            top_p_B=torch.tensor([r.params.top_p for r in rows], device=device),
            greedy_B=temperature_B == 0,
        )
        self._sample_and_record(new, logits)
        if new.rows:
            if self._running is None:
                self._running = new
            else:
                self._running.extend(new)

    def _step(self, rows: list[_Row]) -> None:
        """One decode step of the running batch: feed every row's last token, sample its next."""
        running = self._running
        assert running is not None
        cache = running.cache
        cache.reserve(1)
        cache.mask[:, cache.length] = 1
        if self._decoder is not None:
            logits = self._decoder(running.next_B, running.positions_B, cache)
            cache.advance(1)
        else:
            attention_mask = cache.mask[:, : cache.length + 1]
            logits = self._forward(
                running.next_B[:, None], attention_mask, running.positions_B[:, None], cache
            )
        running.positions_B = running.positions_B + 1
        self._sample_and_record(running, logits)
        if not running.rows:
            self._running = None

    def _sample_and_record(self, running: _Running, logits: torch.Tensor) -> None:
        """Sample each row's next token from ``logits`` ``[B, V]``, append it, and retire the rows that finished
        (their results go to their callers, their caches to the prefix store)."""
        ids, logprobs, running.next_B = self._sample(logits, running)
        finished = []
        for b, row in enumerate(running.rows):
            if row.record(ids[b], logprobs[b]) or row.future.done():
                finished.append(b)
        if not finished:
            return
        for b in finished:
            row = running.rows[b]
            if row.future.done():
                continue
            if self._prefixes.max_tokens > 0:
                self._prefixes.add(row.cached_ids(), running.cache.row_kv(b), extends=row.prefix_key)
            completion = Completion(row.token_ids, row.logprobs, row.finish_reason)  # type: ignore[arg-type]
            _resolve(row.loop, row.future, (completion, row.version))
        gone = set(finished)
        running.select([b for b in range(len(running.rows)) if b not in gone])

    def _sample(self, logits: torch.Tensor, running: _Running) -> tuple[list[int], list[float], torch.Tensor]:
        """Next token per row (argmax for greedy rows, else inverse-CDF sampling with the row's own uniform) and
        its log-prob; one batched draw and one device-to-host copy for the whole batch."""
        rows = running.rows
        samplers = [row.params.temperature > 0 for row in rows]
        if any(row.params.top_p < 1 for row in rows):
            logp_BV = nucleus_logprobs(logits, running.temperature_B, running.top_p_B)
            weights_BV = logp_BV.exp()

            def logprob(pick_B: torch.Tensor) -> torch.Tensor:
                return logp_BV.gather(1, pick_B[:, None])[:, 0]

        else:
            # No nucleus: the draw needs only the tempered softmax's numerators, and the log-prob of the picked
            # token is z - max - log(sum); one exp over [B, V] per step instead of log_softmax's and the draw's.
            temp_B = torch.where(running.greedy_B, torch.ones_like(running.temperature_B), running.temperature_B)
            z_BV = logits.float() / temp_B.float()[:, None]
            top_B1 = z_BV.amax(dim=-1, keepdim=True)
            weights_BV = (z_BV - top_B1).exp_()
            log_total_B1 = weights_BV.sum(dim=-1, keepdim=True).log_()

            def logprob(pick_B: torch.Tensor) -> torch.Tensor:
                return (z_BV.gather(1, pick_B[:, None]) - top_B1 - log_total_B1)[:, 0]

        pick_B = weights_BV.argmax(dim=-1) if not all(samplers) else None
        if any(samplers):
            u_B = torch.tensor(
                [row.next_uniform() if s else 0.0 for row, s in zip(rows, samplers, strict=True)],
                dtype=torch.float64,
                device=logits.device,
            )
            drawn_B = inverse_cdf_sample(weights_BV, u_B)
            pick_B = drawn_B if pick_B is None else torch.where(running.greedy_B, pick_B, drawn_B)
        assert pick_B is not None
        host = torch.stack([pick_B.double(), logprob(pick_B).double()]).cpu()
        return [int(t) for t in host[0].tolist()], host[1].tolist(), pick_B

    def _check_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
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
