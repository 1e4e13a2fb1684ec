"""What the sync and async clients share: settings, the retry policy, typed results, errors from responses,
and the registry of sandboxes to delete at interpreter exit."""

from __future__ import annotations

import atexit
import functools
import json
import os
import random
import secrets
import threading
from dataclasses import dataclass, fields
from typing import Any

from orchard._extras import requires_extra
from orchard._retry import SYSTEM_RANDOM, backoff_s

with requires_extra("env"):
    import httpx

from orchard.env.errors import SandboxError, ServiceUnavailable, error_for_status

BASE_URL_ENV = "SANDBOX_BASE_URL"
"""The variable the clients read the service's URL from when no `base_url` is given."""
API_KEY_ENV = "SANDBOX_API_KEY"
"""The variable the clients read the service's key from when no `api_key` is given; the lines `orchard env serve`
prints set it. Not `orchard.env.embedded.API_KEY_ENV` (`ORCHARD_ENV_API_KEY`), the key the service itself starts
with."""
DEFAULT_BASE_URL = "http://localhost:8000"
RETRY_STATUSES = (502, 503, 504)


def unreachable_message(base_url: str, method: str, path: str, attempts: int, last: BaseException | None) -> str:
    """What a client says when the service never answered: the URL it tried, and how to point it elsewhere."""
    env_url = os.environ.get(BASE_URL_ENV)
    source = f"${BASE_URL_ENV}={env_url}" if env_url else f"${BASE_URL_ENV} is unset; default {DEFAULT_BASE_URL}"
    return (f"{method} {base_url}{path}: no answer after {attempts} attempts: {type(last).__name__}: {last}. "
            f"Is the service running at {base_url}? ({source}.) Start one with `orchard env serve` and export "
            f"the {BASE_URL_ENV}=... and {API_KEY_ENV}=... lines it prints, or pass base_url= and api_key=.")


def resolve_settings(base_url: str | None, api_key: str | None) -> tuple[str, str | None]:
    """Arguments win over `SANDBOX_BASE_URL` / `SANDBOX_API_KEY`; the URL defaults to Orchard Env's
    http://localhost:8000."""
    url = base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must be an http(s) URL, got {url!r}")
    return url.rstrip("/"), api_key or os.environ.get(API_KEY_ENV) or None


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for connection errors and 502/503/504.

    Attempt k (0-based) waits uniform(c/2, c) with c = min(backoff_max_s, backoff_base_s * 2**k)
    (`orchard._retry.backoff_s`); a 503's
    `Retry-After` replaces c/2..c with retry_after + uniform(0, 0.25 * retry_after).
    """

    max_attempts: int = 6
    backoff_base_s: float = 0.2
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {self.max_attempts!r}")
        if not self.backoff_base_s >= 0 or not self.backoff_max_s >= 0:
            raise ValueError(f"backoff times must be >= 0, got {self.backoff_base_s!r}, {self.backoff_max_s!r}")

    def delay(self, attempt: int, retry_after_s: float | None = None, rng: random.Random | None = None) -> float:
        if retry_after_s is not None:
            return retry_after_s + (rng or SYSTEM_RANDOM).uniform(0.0, 0.25 * retry_after_s)
        return backoff_s(attempt, base_s=self.backoff_base_s, max_s=self.backoff_max_s, rng=rng)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header value; None when absent or not a number."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def retry_after_of(response: httpx.Response) -> float | None:
    return parse_retry_after(response.headers.get("Retry-After"))


def new_idempotency_key() -> str:
    """32 random hex digits, shaped like `uuid.uuid4().hex` but without building a UUID."""
    return secrets.token_hex(16)


def error_from_parts(status_code: int, body: bytes, retry_after: str | None) -> SandboxError:
    """The typed error of a failed answer: its status, raw body and `Retry-After` header (None if absent)."""
    try:
        detail: Any = json.loads(body).get("detail")
    except (ValueError, AttributeError):
        detail = body.decode("utf-8", errors="replace")
    if isinstance(detail, str):
        message = detail
    elif isinstance(detail, dict):
        message = str(detail.get("message") or detail)
    else:
        message = str(detail)
    error = error_for_status(status_code, f"{status_code}: {message}", detail)
    if isinstance(error, ServiceUnavailable):
        error.retry_after_s = parse_retry_after(retry_after) or 1.0
    return error


def error_from_response(response: httpx.Response) -> SandboxError:
    return error_from_parts(response.status_code, response.content, response.headers.get("Retry-After"))


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The items of ``data`` that are fields of the dataclass ``cls``: a newer server may send more."""
    names = _field_names(cls)
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class JobResult:
    """One exec: Orchard Env's job fields plus ours (truncation, timeout, duration).

    `status` is "queued" | "running" | "succeeded" | "failed"; "succeeded" means exit code 0. A job that
    was running when the orchestrator died is "failed" with `error` starting "lost:" (it was not run again).
    """

    job_id: str
    sandbox_id: str = ""
    command: str = ""
    status: str = "queued"
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    created_at: float = 0.0
    started_at: float | None = None
    completed_at: float | None = None
    error: str | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobResult:
        return cls(**_known_fields(cls, data))

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed")

    is_complete = done

    @property
    def ok(self) -> bool:
        """True when the command ran and exited 0."""
        return self.status == "succeeded"

    succeeded = ok

    @property
    def failed(self) -> bool:
        return self.status == "failed"


@dataclass(frozen=True)
class FileEntry:
    name: str
    type: str
    """"file" or "directory"."""
    size: int
    modified: str | None = None
    path: str | None = None
    mode: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FileEntry:
        return cls(**_known_fields(cls, data))

    @property
    def is_dir(self) -> bool:
        return self.type == "directory"


@dataclass(frozen=True)
class PatchResult:
    success: bool
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    error: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PatchResult:
        return cls(**_known_fields(cls, data))


class _OpenSandboxes:
    """Sandboxes created with auto_cleanup that are not deleted yet; deleted at interpreter exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], str | None] = {}
        self._registered = False

    def add(self, base_url: str, sandbox_id: str, api_key: str | None) -> None:
        with self._lock:
            self._open[(base_url, sandbox_id)] = api_key
            if not self._registered:
                atexit.register(self.delete_all)
                self._registered = True

    def discard(self, base_url: str, sandbox_id: str) -> None:
        with self._lock:
            self._open.pop((base_url, sandbox_id), None)

    def snapshot(self) -> list[tuple[str, str, str | None]]:
        with self._lock:
            return [(url, sid, key) for (url, sid), key in self._open.items()]

    def delete_all(self) -> None:
        for base_url, sandbox_id, api_key in self.snapshot():
            headers = {"Idempotency-Key": new_idempotency_key()}
            if api_key:
                headers["X-API-Key"] = api_key
            try:
                httpx.delete(f"{base_url}/sandboxes/{sandbox_id}", headers=headers, timeout=10.0)
            except httpx.HTTPError:
                pass  # best effort: the service's heartbeat reaper deletes it later
            self.discard(base_url, sandbox_id)


OPEN_SANDBOXES = _OpenSandboxes()


def ws_url(base_url: str, sandbox_id: str) -> str:
    scheme, rest = base_url.split("://", 1)
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/sandboxes/{sandbox_id}/exec/pty"


def pty_init_frame(cmd: str | list[str] | None, *, env: dict[str, str] | None, cwd: str | None, rows: int,
                   cols: int) -> dict[str, Any]:
    if not isinstance(rows, int) or not isinstance(cols, int) or rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be ints >= 1, got rows={rows!r} cols={cols!r}")
    return {"type": "init", "cmd": cmd, "env": env or {}, "cwd": cwd, "rows": rows, "cols": cols}


COPY_TIMEOUT_S = 600.0
"""How long a client waits for a snapshot or a fork, which copy a workspace (a large one takes a while)."""


def fork_payload(*, sandbox_id: str | None, timeout: int | None, ttl_seconds: float | None,
                 heartbeat_timeout: float | None) -> dict[str, Any]:
    """The body of a fork request: the fork's own settings that are set (the rest is its source's)."""
    given = {"sandbox_id": sandbox_id, "timeout": timeout, "ttl_seconds": ttl_seconds,
             "heartbeat_timeout": heartbeat_timeout}
    return {name: value for name, value in given.items() if value is not None}


SERVICE_HEARTBEAT_TIMEOUT_S = 600.0
"""The service's default heartbeat timeout (`orchard env serve --heartbeat-timeout`), for a sandbox whose info
names none."""
BEATS_PER_TIMEOUT = 3
"""Heartbeats a kept-alive sandbox gets per heartbeat timeout: two may be late or lost before it is reaped."""


def keepalive_interval_s(info: dict[str, Any], default_timeout_s: float | None = None) -> float:
    """Seconds between the heartbeats that keep a sandbox alive: a third of its heartbeat timeout (``info``'s,
    else ``default_timeout_s``, else the service's default)."""
    timeout = info.get("heartbeat_timeout") or default_timeout_s or SERVICE_HEARTBEAT_TIMEOUT_S
    return float(timeout) / BEATS_PER_TIMEOUT
