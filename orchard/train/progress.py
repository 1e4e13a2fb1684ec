"""Progress of long work: steps done / total, loss, tokens/s and an ETA, redrawn in place on a terminal and written
as a line every ``interval_s`` seconds (and at the first and last step) when the output is a log file or a pipe."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = ["StepProgress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``"1h02m"``, ``"4m05s"``, ``"12s"``; ``"?"`` for a value that is not a finite number >= 0."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class StepProgress:
    """Reports ``label: step k/n  loss x  tokens/s y  elapsed  ETA`` as work advances.

    On a terminal (``stream.isatty()``) the line is redrawn in place after every update; otherwise a line is
    written at the first update, whenever ``interval_s`` has passed since the last one, and at the last step, so a
    log shows a run is alive without a line per step. The ETA is the mean time per step so far times the steps
    left (steps done before ``start`` do not count).

    Args:
        label: what advances (``"sft"``, ``"rl"``, ``"eval base react"``).
        total: the number of steps (>= 1).
        start: steps already done (a resumed run).
        interval_s: seconds between lines in a log (> 0).
        unit: what a step is, in the line (``"step"``, ``"episode"``).
        stream: where to write (default ``sys.stderr`` on a terminal, else ``sys.stdout``, read at each write).
        enabled: False writes nothing (every rank but 0).
    """

    def __init__(self, label: str, total: int, *, start: int = 0, interval_s: float = 30.0, unit: str = "step",
                 stream: TextIO | None = None, enabled: bool = True) -> None:
        if not isinstance(label, str) or not label:
            raise ValueError(f"label must be a non-empty string, got {label!r}")
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be an int >= 1, got {total!r}")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= total:
            raise ValueError(f"start must be an int in [0, total], got {start!r}")
        if not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"interval_s must be a number > 0, got {interval_s!r}")
        self.label, self.total, self.start, self.interval_s, self.unit = label, total, start, float(interval_s), unit
        self._stream, self.enabled = stream, bool(enabled)
        self.step = start
        self._started = time.monotonic()
        self._last_line: float | None = None
        self._tokens = 0.0
        self._drawn = False

    @property
    def stream(self) -> TextIO:
        if self._stream is not None:
            return self._stream
        return sys.stderr if sys.stderr.isatty() else sys.stdout

    def line(self, metrics: Mapping[str, Any] | None = None) -> str:
        """The progress line for the current step."""
        elapsed = time.monotonic() - self._started
        done = self.step - self.start
        parts = [f"{self.label}: {self.unit} {self.step}/{self.total}"]
        metrics = metrics or {}
        loss = metrics.get("loss/total")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            parts.append(f"loss {loss:.4f}")
        if self._tokens and elapsed > 0:
            parts.append(f"{self._tokens / elapsed:.0f} tok/s")
        parts.append(f"elapsed {format_duration(elapsed)}")
        eta = elapsed / done * (self.total - self.step) if done else float("nan")
        parts.append(f"ETA {format_duration(eta)}" if self.step < self.total else "done")
        return "  ".join(parts)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Record that ``step`` steps are done (``metrics``: the last step's, for its loss and ``tokens/total``)."""
        if isinstance(step, bool) or not isinstance(step, int) or not self.start <= step <= self.total:
            raise ValueError(f"step must be an int in [{self.start}, {self.total}], got {step!r}")
        self.step = step
        tokens = (metrics or {}).get("tokens/total")
        if isinstance(tokens, (int, float)) and math.isfinite(tokens):
            self._tokens += tokens
        if not self.enabled:
            return
        stream, now = self.stream, time.monotonic()
        if stream.isatty():
            stream.write("\r\033[K" + self.line(metrics))
            self._drawn = True
            if step == self.total:
                stream.write("\n")
                self._drawn = False
            stream.flush()
        elif self._last_line is None or now - self._last_line >= self.interval_s or step == self.total:
            stream.write(self.line(metrics) + "\n")
            stream.flush()
            self._last_line = now

    def close(self) -> None:
        """End a line left open on a terminal."""
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
