"""Streaming for the model server: per-choice token streams merged into one, and the text each chunk may send.

`ChoiceStreams` runs one task per choice. An engine with ``generate_stream(request)`` (`HFEngine`) yields each
token as the scheduler samples it; any other engine is streamed after the fact: its finished completion is cut
into one chunk per token (the client sees the stream protocol, not tokens as they are produced).

`ChoiceText` decides what text a chunk may carry without ever taking it back: it holds back the characters that
may still become a stop string, an incomplete UTF-8 character, and (when tools were offered) everything from a
``<tool_call>`` tag on, so the streamed content is always a prefix of the content the non-streamed answer has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orchard.rollout.engine import Engine, GenerateRequest
from orchard.rollout.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


@dataclass
class ChoiceEvent:
    """A sampled token of choice ``index`` (``token`` set), or its end (``finish`` or ``error`` set)."""

    index: int
    token: int | None = None
    logprob: float = 0.0
    finish: str | None = None
    error: BaseException | None = None


class ChoiceStreams:
    """One task per single-sample request (a choice), all feeding one queue of `ChoiceEvent`s in arrival order.

    ``stop(i)`` ends choice ``i`` early (a stop string completed): its engine row is cancelled, and the events it
    had already queued are dropped by the consumer (`ChoiceStreams.events`).
    """

    def __init__(self, engine: Engine, requests: Sequence[GenerateRequest]) -> None:
        self._queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self._open = set(range(len(requests)))
        self._tasks = [asyncio.create_task(self._run(engine, i, r)) for i, r in enumerate(requests)]

    async def _run(self, engine: Engine, index: int, request: GenerateRequest) -> None:
        put = self._queue.put_nowait
        try:
            stream = getattr(engine, "generate_stream", None)
            if stream is None:
                (result,) = await engine.generate([request])
                completion = result.completions[0]
                for token, logprob in zip(completion.token_ids, completion.logprobs, strict=True):
                    put(ChoiceEvent(index, token, logprob))
                put(ChoiceEvent(index, finish=completion.finish_reason))
                return
            last = None
            async for token, logprob in stream(request):
                last = token
                put(ChoiceEvent(index, token, logprob))
            put(ChoiceEvent(index, finish="stop" if last in request.params.stop_token_ids else "length"))
        except Exception as exc:
            put(ChoiceEvent(index, error=exc))

    async def next(self) -> ChoiceEvent | None:
        """The next event of a choice still open; None once every choice has ended."""
        while self._open:
            event = await self._queue.get()
            if event.index not in self._open:
                continue
            if event.token is None:
                self._open.discard(event.index)
            return event
        return None

    def stop(self, index: int) -> None:
        self._open.discard(index)
        self._tasks[index].cancel()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass
class ChoiceText:
    """The text of one streamed choice, token by token.

    Args:
        tokenizer: decodes the sampled ids (special tokens skipped, as the non-streamed answer does).
        stops: stop strings; the first to appear ends the choice (``stopped`` becomes True).
        stop_ids: stop token ids; a trailing one is not part of the text.
        hold_tool_calls: hold back text from the first tool-call tag on (tools were offered).
    """

    tokenizer: Any
    stops: Sequence[str]
    stop_ids: Sequence[int]
    hold_tool_calls: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent: str = ""
    stop_text: str | None = None
    """The text before the stop string, once one completed."""

    @property
    def stopped(self) -> bool:
        return self.stop_text is not None

    def text(self) -> str:
        """The decoded output so far (up to the stop string once one completed)."""
        if self.stop_text is not None:
            return self.stop_text
        ids = self.token_ids
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int, logprob: float) -> str:
        """Record a sampled token; returns the text that may be sent now (possibly empty)."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        text = self.text()
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            self.stop_text = text[: min(hits)[0]]
            return ""
        return self._take(text, self._sendable(text))

    def _sendable(self, text: str) -> int:
        """How many leading characters of ``text`` can no longer change meaning."""
        limit = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes to U+FFFD until it completes
        if self.stops:
            limit = min(limit, len(text) - max(len(s) for s in self.stops) + 1)
        if self.hold_tool_calls:
            found = [text.find(tag) for tag in _TAGS if tag in text]
            if found:
                limit = min(limit, min(found))
            else:
                for k in range(min(len(TOOL_CALL_CLOSE), len(text)), 0, -1):  # a tag may be starting
                    if any(tag.startswith(text[-k:]) for tag in _TAGS):
                        limit = min(limit, len(text) - k)
                        break
            # the newline before a call is not content (see `parse_tool_calls`): send it once text follows it
            if limit > 0 and text[limit - 1] == "\n":
                limit -= 1
        return limit

    def _take(self, text: str, limit: int) -> str:
        if limit <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) : limit]
        self.sent += delta
        return delta

    def rest(self, content: str | None) -> str:
        """What is left to send of the final ``content`` (the non-streamed answer's)."""
        if not content or not content.startswith(self.sent):
            return ""
        delta = content[len(self.sent) :]
        self.sent = content
        return delta
