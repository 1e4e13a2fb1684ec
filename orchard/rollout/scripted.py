"""`ScriptedEngine`: an `Engine` that answers with scripted text, for testing harnesses, servers and loops.

Each call's answer comes from ``script``: a list consumed in order (one entry per generated sample), or a
callable ``script(prompt_text) -> str``. The text is tokenized (no special tokens added), the end-of-turn token
is appended, and every token gets log-prob ``logprob``. ``max_tokens`` cuts the answer (finish reason
``length``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from orchard.rollout.engine import Completion, GenerateRequest, GenerateResult, validate_requests


class ScriptedEngine:
    """Args:
    tokenizer: encodes the scripted text and decodes prompts for a callable script.
    script: texts to answer with, in order, or a callable from the decoded prompt to the answer text.
    logprob: the log-prob reported for every token (a finite float <= 0). Default -1.0.
    delay_s: seconds each `generate` call sleeps first (to simulate model latency). Default 0.
    """

    def __init__(
        self,
        tokenizer: Any,
        script: Sequence[str] | Callable[[str], str],
        *,
        logprob: float = -1.0,
        delay_s: float = 0.0,
    ) -> None:
        if not callable(script) and (isinstance(script, str) or not all(isinstance(s, str) for s in script)):
            raise ValueError(f"script must be a list of str or a callable, got {type(script).__name__}")
        if not logprob <= 0:
            raise ValueError(f"logprob must be <= 0, got {logprob!r}")
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer must have an eos_token_id (the end-of-turn token)")
        self.tokenizer = tokenizer
        self._script = script if callable(script) else list(script)
        self._next = 0
        self.logprob = float(logprob)
        self.delay_s = float(delay_s)
        self.weight_version = 0
        self.prompts: list[tuple[int, ...]] = []
        """Every prompt it was asked to continue, in order."""

    def _answer(self, prompt_ids: Sequence[int]) -> str:
        if callable(self._script):
            return self._script(self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False))
        if self._next >= len(self._script):
            raise RuntimeError(f"ScriptedEngine ran out of script after {self._next} answers")
        self._next += 1
        return self._script[self._next - 1]

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        requests = validate_requests(requests)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        results = []
        for request in requests:
            self.prompts.append(tuple(request.prompt_ids))
            completions = []
            for _ in range(request.params.n):
                ids = list(
                    self.tokenizer(self._answer(request.prompt_ids), add_special_tokens=False)["input_ids"]
                )
                ids.append(self.tokenizer.eos_token_id)
                reason = "stop"
                if len(ids) > request.params.max_tokens:
                    ids, reason = ids[: request.params.max_tokens], "length"
                completions.append(Completion(ids, [self.logprob] * len(ids), reason))  # type: ignore[arg-type]
            results.append(GenerateResult(tuple(request.prompt_ids), completions, self.weight_version))
        return results

    async def update_weights(self, weights: Any) -> None:
        self.weight_version += 1

    async def close(self) -> None:
        return None
