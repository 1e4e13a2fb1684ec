"""What the recording proxy records (`CallRecord`, `RecordedChoice`) and where it keeps it on disk (`SessionFiles`).

On disk, one JSON-lines file per session, ``<record_dir>/<url-quoted session id>.jsonl``: one line per recorded
call (`CallRecord.to_dict`), appended, flushed and fsynced before the call counts as recorded, and the line
``{"ended": true}`` once the session is ended. A crash can only cut the last line short: loading skips such a line
(with a warning) and cuts it off the file, so the next append starts on a clean line.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

logger = logging.getLogger(__name__)

END_MARKER = {"ended": True}
"""The line that marks a session's file as ended."""


@dataclass
class RecordedChoice:
    """One sampled answer of a call: ids, log-probs (aligned), finish reason."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecordedChoice:
        """Invert `to_dict`."""
        _check_keys(cls, data)
        return cls(list(data["token_ids"]), list(data["logprobs"]), data["finish_reason"])


@dataclass
class CallRecord:
    """One forwarded call.

    Fields:
        session_id: the session it was recorded under.
        endpoint: ``chat.completions`` or ``completions``.
        request: the request body as the client sent it.
        response: the upstream's response body (with token ids and log-probs).
        prompt_ids: the prompt token ids the upstream sampled from (one list per prompt of a completions batch).
        choices: the sampled answers, in the response's choice order.
        started_at: wall-clock time the call arrived (``time.time()``).
        duration_s: time to the upstream's answer.
        n_per_prompt: choices per prompt (a chat call's ``n``; 1 for completions, one prompt per choice).
    """

    session_id: str
    endpoint: str
    request: dict[str, Any]
    response: dict[str, Any]
    prompt_ids: list[list[int]]
    choices: list[RecordedChoice]
    started_at: float
    duration_s: float
    n_per_prompt: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON types (what ``GET /sessions/{id}/calls`` returns, one line of a session file)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CallRecord:
        """Invert `to_dict`: ``CallRecord.from_dict(r.to_dict()) == r``."""
        _check_keys(cls, data)
        return cls(
            session_id=data["session_id"],
            endpoint=data["endpoint"],
            request=dict(data["request"]),
            response=dict(data["response"]),
            prompt_ids=[list(p) for p in data["prompt_ids"]],
            choices=[RecordedChoice.from_dict(c) for c in data["choices"]],
            started_at=data["started_at"],
            duration_s=data["duration_s"],
            n_per_prompt=data.get("n_per_prompt", 1),
        )


def _check_keys(cls: type, data: Any) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{cls.__name__}.from_dict needs a mapping, got {type(data).__name__}")
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"{cls.__name__}.from_dict: missing {', '.join(missing)}; got keys {sorted(data)}")


class SessionFiles:
    """The sessions of a `RecordingProxy` on disk, one JSON-lines file per session in ``record_dir``.

    Args:
        record_dir: the directory (made, with its parents, if missing).

    Raises:
        ValueError: ``record_dir`` is not a path, is an existing non-directory, cannot be made, or is not writable.
    """

    def __init__(self, record_dir: str | os.PathLike[str]) -> None:
        if not isinstance(record_dir, (str, os.PathLike)) or not os.fspath(record_dir):
            raise ValueError(f"record_dir must be a directory path, got {record_dir!r}")
        path = Path(record_dir)
        if path.exists() and not path.is_dir():
            raise ValueError(f"record_dir {str(path)!r} exists and is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"record_dir {str(path)!r} cannot be made: {exc.strerror or exc}") from exc
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"record_dir {str(path)!r} is not writable")
        self.dir = path

    def path(self, session_id: str) -> Path:
        """The session's file: its id URL-quoted (every ``/``, ``%`` and other unsafe character escaped)."""
        return self.dir / f"{quote(session_id, safe='')}.jsonl"

    def append(self, record: CallRecord) -> None:
        """Append one call, durable (flushed and fsynced) when this returns."""
        self._append_line(record.session_id, record.to_dict())

    def end(self, session_id: str) -> None:
        """Append the end marker."""
        self._append_line(session_id, END_MARKER)

    def delete(self, session_id: str) -> None:
        """Remove the session's file (nothing if it has none)."""
        self.path(session_id).unlink(missing_ok=True)

    def _append_line(self, session_id: str, obj: Mapping[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with open(self.path(session_id), "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def load(self) -> list[tuple[str, list[CallRecord], bool]]:
        """Every session on disk as ``(session_id, calls, ended)``, ordered by its first call's start time (sessions
        with no call last, by id).

        Raises:
            ValueError: a line other than the last is not a record or the end marker (not a crash's work: the file
                was edited or is not ours); the message names the file and line.
        """
        sessions = [self._load_file(p) for p in sorted(self.dir.glob("*.jsonl"))]
        return sorted(sessions, key=lambda s: (not s[1], s[1][0].started_at if s[1] else 0.0, s[0]))

    def _load_file(self, path: Path) -> tuple[str, list[CallRecord], bool]:
        session_id = unquote(path.name.removesuffix(".jsonl"))
        raw = path.read_bytes()
        lines = raw.split(b"\n")
        # a file that ends with "\n" splits into [... , b""]; anything else after the last "\n" was cut short
        *complete, tail = lines
        calls: list[CallRecord] = []
        ended = False
        for number, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                ended |= self._read_line(line, session_id, calls)
            except ValueError as exc:
                raise ValueError(f"{path}: line {number} is not a call record or the end marker: {exc}") from exc
        if tail.strip():
            try:
                ended |= self._read_line(tail, session_id, calls)
                with open(path, "ab") as f:  # complete but for its newline: finish it, so appends stay lines
                    f.write(b"\n")
                    f.flush()
                    os.fsync(f.fileno())
            except ValueError as exc:
                logger.warning(
                    "%s: skipping its last line, cut short (a crash while writing it?): %s", path, exc
                )
                with open(path, "r+b") as f:
                    f.truncate(len(raw) - len(tail))
                    f.flush()
                    os.fsync(f.fileno())
        return session_id, calls, ended

    @staticmethod
    def _read_line(line: bytes, session_id: str, calls: list[CallRecord]) -> bool:
        """Add the line's record to ``calls``; True if the line is the end marker."""
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not JSON ({exc})") from exc
        if obj == END_MARKER:
            return True
        try:
            record = CallRecord.from_dict(obj)
        except (TypeError, KeyError) as exc:
            raise ValueError(f"not a call record ({type(exc).__name__}: {exc})") from exc
        if record.session_id != session_id:
            raise ValueError(f"a call of session {record.session_id!r} in the file of session {session_id!r}")
        calls.append(record)
        return False
