"""`VLLMEngine`: the `Engine` interface over vLLM's offline ``LLM`` (GPU extra: ``pip install orchard-rl[gpu]``).

vLLM is imported inside the constructor, so this module imports without it. Requests go to ``LLM.generate`` with
token-id prompts and ``SamplingParams(logprobs=0)`` (the sampled token's log-prob only), run in a worker thread
so the event loop keeps serving. The engine is built with ``logprobs_mode="processed_logprobs"`` unless told
otherwise: vLLM then reports the log-probs of the distribution after temperature and top-p (our convention; its
default, ``raw_logprobs``, reports the untempered model's).

Weights: `update_weights` takes a state dict (or a module) and hands it to every worker with
``LLM.collective_rpc``, each calling its model's ``load_weights`` (vLLM's loader maps HF parameter names, fuses
q/k/v and gate/up projections, and shards for tensor parallelism), then resets the prefix cache, whose entries
were computed with the old weights. With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the workers share this process and
no copy is made; otherwise the tensors are serialised to the worker processes. Older vLLM (V0) exposes the same
model as ``llm.llm_engine.model_executor.driver_worker.model_runner.model`` — used as a fallback.

Not run in this repository's CI (no GPU): the code around it is tested through the OpenAI-compatible protocol
(`OpenAIEngine` against ``orchard serve-model``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from orchard.rollout.engine import Completion, GenerateRequest, GenerateResult, validate_requests


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, Any]]) -> int:
    model = worker.model_runner.model
    loaded = model.load_weights(weights=weights)
    return len(loaded) if loaded is not None else len(weights)


class VLLMEngine:
    """Args:
    model: a model path or hub id vLLM can load.
    **llm_kwargs: passed to ``vllm.LLM`` (``tensor_parallel_size``, ``gpu_memory_utilization``, ``dtype``,
        ``enable_prefix_caching``...); ``logprobs_mode`` defaults to ``"processed_logprobs"``.
    """

    def __init__(self, model: str, **llm_kwargs: Any) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty model path or id, got {model!r}")
        try:
            import vllm
        except ImportError as exc:  # the GPU extra is optional
            raise ImportError("VLLMEngine needs vLLM: pip install 'orchard-rl[gpu]'") from exc
        self._vllm = vllm
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        self.llm = vllm.LLM(model=model, **llm_kwargs)
        self.weight_version = 0
        self._lock = threading.Lock()  # LLM.generate is not re-entrant: one batch at a time

    def _sampling(self, request: GenerateRequest) -> Any:
        p = request.params
        return self._vllm.SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=p.max_tokens,
            stop_token_ids=list(p.stop_token_ids),
            seed=p.seed,
            logprobs=0,
            detokenize=False,
        )

    def _generate_sync(self, requests: list[GenerateRequest]) -> tuple[list[Any], int]:
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        with self._lock:
            outputs = self.llm.generate(prompts, [self._sampling(r) for r in requests], use_tqdm=False)
            return outputs, self.weight_version

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """All requests of one call go to vLLM as one batch (its scheduler batches continuously inside)."""
        requests = validate_requests(requests)
        if not requests:
            return []
        outputs, version = await asyncio.to_thread(self._generate_sync, requests)
        results = []
        for request, output in zip(requests, outputs, strict=True):
            completions = []
            for sample in output.outputs:
                ids = list(sample.token_ids)
                lps = [float(step[t].logprob) for t, step in zip(ids, sample.logprobs, strict=True)]
                reason = "length" if sample.finish_reason == "length" else "stop"
                completions.append(Completion(ids, lps, reason))  # type: ignore[arg-type]
            results.append(GenerateResult(tuple(request.prompt_ids), completions, version))
        return results

    def _update_sync(self, weights: list[tuple[str, Any]]) -> None:
        with self._lock:
            if hasattr(self.llm, "collective_rpc"):
                self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
            else:
                _load_weights_on_worker(self.llm.llm_engine.model_executor.driver_worker, weights)
            self.llm.reset_prefix_cache()
            self.weight_version += 1

    async def update_weights(self, weights: Any) -> None:
        """Load a state dict (HF parameter names) or a module's state dict into every worker; clears the prefix
        cache. Waits for the running batch."""
        if hasattr(weights, "state_dict") and callable(weights.state_dict):
            weights = weights.state_dict()
        if not isinstance(weights, dict):
            raise ValueError(f"weights must be a state dict or an nn.Module, got {type(weights).__name__}")
        await asyncio.to_thread(self._update_sync, list(weights.items()))

    async def close(self) -> None:
        self.llm = None
