"""Typed errors of the sandbox service, shared by the server (which maps them to HTTP status codes) and the
client (which raises them from responses).

Every error carries the HTTP `status_code` it travels as; `SandboxError` is the base of all of them.
"""

from __future__ import annotations

import builtins


class SandboxError(Exception):
    """Base of every sandbox-service error. `status_code` is the HTTP status it is sent as (0: no response)."""

    status_code: int = 500

    def __init__(self, message: str = "", *, status_code: int | None = None, detail: object = None) -> None:
        super().__init__(message)
        if status_code is not None:
            self.status_code = status_code
        self.detail = detail if detail is not None else message


class BadRequestError(SandboxError, ValueError):
    """The request is malformed or names something invalid (400)."""

    status_code = 400


class PathError(BadRequestError):
    """A file path escapes the sandbox (`..`, an absolute path elsewhere, a symlink pointing out) (400)."""


class AuthError(SandboxError):
    """Missing (401) or wrong (403) API key."""

    status_code = 401


class NotFoundError(SandboxError, LookupError):
    """No such sandbox, job or file (404)."""

    status_code = 404


class WaitTimeoutError(SandboxError, builtins.TimeoutError):
    """A server-side wait ran out before the sandbox became ready (408), or a client-side wait ran out."""

    status_code = 408


class ConflictError(SandboxError):
    """The id is taken, or the sandbox is not in a state that allows the request (409)."""

    status_code = 409


class IdempotencyKeyReuseError(SandboxError):
    """An `Idempotency-Key` was reused with a different request (422)."""

    status_code = 422


class BackendRefusedError(SandboxError):
    """The platform under the service (Kubernetes) refused the sandbox, for a reason a retry alone does not change:
    its quota is used up (403, `detail["error"]` "quota_exceeded"), its policies forbid the request (403,
    "forbidden"), or it finds an object invalid (422, "invalid"). `detail["message"]` is what it said. Retrying
    the same request is pointless until an operator (or, for a quota, the deletion of other sandboxes) changes
    something. The service's own quotas on snapshots and forks (`max_snapshots`, `max_forks`) are refused the
    same way (403, "quota_exceeded"): deleting a snapshot or a fork frees room."""

    status_code = 403


REFUSALS = ("quota_exceeded", "forbidden", "invalid")


class ServiceUnavailable(SandboxError):
    """The service is saturated or a backend failed transiently (503); safe to retry after `retry_after_s`."""

    status_code = 503

    def __init__(self, message: str = "", *, retry_after_s: float = 1.0, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.retry_after_s = retry_after_s


class SandboxConnectionError(SandboxError, ConnectionError):
    """The service could not be reached after every retry (no HTTP response)."""

    status_code = 0


class ServerError(SandboxError):
    """Any other failure on the server's side (5xx)."""

    status_code = 500


_BY_STATUS: dict[int, type[SandboxError]] = {
    400: BadRequestError,
    401: AuthError,
    403: AuthError,
    404: NotFoundError,
    408: WaitTimeoutError,
    409: ConflictError,
    422: BadRequestError,
    503: ServiceUnavailable,
}


def error_for_status(status_code: int, message: str, detail: object = None) -> SandboxError:
    """The typed error for an HTTP error response (`PathError` when a 400's detail says a path escapes)."""
    if status_code == 400 and isinstance(detail, dict) and detail.get("error") == "path_escape":
        return PathError(message, status_code=400, detail=detail)
    if status_code == 422 and isinstance(detail, dict) and detail.get("error") == "idempotency_key_reuse":
        return IdempotencyKeyReuseError(message, detail=detail)
    if status_code in (403, 422) and isinstance(detail, dict) and detail.get("error") in REFUSALS:
        return BackendRefusedError(message, status_code=status_code, detail=detail)
    cls = _BY_STATUS.get(status_code, ServerError if status_code >= 500 else SandboxError)
    return cls(message, status_code=status_code, detail=detail)
