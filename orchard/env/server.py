"""The REST API of the sandbox service, wire-compatible with Orchard Env's (see `docs/env-api.md`).

`create_app(orchestrator, api_keys)` returns a FastAPI app (whose hot calls skip FastAPI's stack when they
are authorised and valid: `_ServiceApp`); `orchard.env.embedded` runs it under uvicorn. Every
route but `/` and `/health` needs an API key in `X-API-Key`, compared in constant time. The PTY WebSocket takes
the key from the `X-API-Key` header, a `Sec-WebSocket-Protocol: api_key.<key>` entry, or the first message —
never from the URL (a key in a query string ends up in logs; such connections are refused).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import re
import shlex
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from orchard._extras import requires_extra

with requires_extra("env"):
    from fastapi import Depends, FastAPI, Header, Query, Request, Security, WebSocket, WebSocketDisconnect
    from fastapi.responses import JSONResponse
    from fastapi.security import APIKeyHeader
    from pydantic import BaseModel, Field

from orchard.env.backends.base import ExecResult, FileInfo
from orchard.env.errors import AuthError, BadRequestError, SandboxError, ServiceUnavailable
from orchard.env.fork_routes import add_fork_routes
from orchard.env.forks import Forks
from orchard.env.orchestrator import CreateParams, ExecParams, Orchestrator
from orchard.env.store.base import JobRecord, SandboxRecord

logger = logging.getLogger(__name__)

API_VERSION = "0.1.0"
WS_AUTH_TIMEOUT_S = 10.0


class CreateSandboxRequest(BaseModel):
    image: str = Field("host", description="Root file system name in the backend's image registry.")
    block_network: bool = Field(True, description="Deny network egress.")
    sandbox_id: str | None = Field(None, description="Custom id; 409 if taken.")
    cpu: str | None = Field(None, description="CPU limit, Kubernetes quantity ('2', '500m').")
    memory: str | None = Field(None, description="Memory limit, Kubernetes quantity ('512Mi', '2Gi').")
    timeout: int | None = Field(None, description="Seconds to wait for readiness (Orchard Env); echoed back.")
    ttl_seconds: float | None = Field(None, description="Hard lifetime; the reaper deletes it after this.")
    heartbeat_timeout: float | None = Field(None, description="Idle seconds (no heartbeat/exec) before reaping.")
    env: dict[str, str] | None = Field(None, description="Environment of every command in the sandbox.")


class ExecRequestBody(BaseModel):
    command: str | list[str] = Field(..., description="Shell string (bash -c) or argv list (run directly).")
    timeout_seconds: float | None = Field(None, description="Kill the command's process tree after this.")
    cwd: str | None = Field(None, description="Working directory (default /workspace).")
    env: dict[str, str] | None = None
    login_shell: bool = Field(False, description="Run a shell string with bash -lc instead of bash -c.")
    wait: bool = Field(False, description="Block until the job ends (or the server-side wait runs out).")
    max_output_bytes: int | None = Field(None, description="Per-stream cap (at most the server's).")
    stdin: str | None = Field(None, description="Text fed to the command's stdin.")


class ApplyPatchRequest(BaseModel):
    patch: str
    timeout_seconds: float = 30.0


class UploadArchiveRequest(BaseModel):
    path: str = Field("/workspace", description="The directory to unpack into (made if missing).")
    content: str = Field(..., description="Base64 of a tar archive, gzipped or not.")


class UploadFileRequest(BaseModel):
    path: str
    content: str = Field(..., description="Base64 of the file's bytes.")
    mode: int | None = Field(None, description="Permission bits, e.g. 493 (0o755).")


# Built once: json.dumps with any option builds a new encoder on every call.
_FINGERPRINT_JSON = json.JSONEncoder(sort_keys=True, default=str)
_RESPONSE_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # Starlette's



def sandbox_view(record: SandboxRecord, namespace: str, isolation: str = "unknown",
                 blocks_network: bool = True) -> dict[str, Any]:
    """A sandbox as the API shows it (Orchard Env's fields, then ours). `block_network` is what is enforced:
    true only where the backend blocks the network (`blocks_network`); `isolation` names how; `env` is the
    environment every command starts with (as created)."""
    return {
        "sandbox_id": record.sandbox_id,
        "namespace": namespace,
        "image": record.image,
        "pod_name": record.sandbox_id,
        "block_network": record.block_network and blocks_network,
        "cpu": record.cpu or "",
        "memory": record.memory or "",
        "timeout": record.timeout,
        "created_at": record.created_at,
        "ready": record.status == "ready",
        "status": record.status,
        "status_message": record.status_message,
        "last_heartbeat": record.last_heartbeat,
        "heartbeat_timeout": record.heartbeat_timeout,
        "expires_at": record.expires_at,
        "isolation": isolation,
        "env": dict(record.env),
        "forked_from": record.forked_from,
    }


def job_view(record: JobRecord) -> dict[str, Any]:
    # a job's fields are all scalars: a shallow copy is what `dataclasses.asdict` gives, without its
    # recursive deep copy (which showed in the service's CPU profile of every exec)
    return dict(vars(record))


def file_view(info: FileInfo) -> dict[str, Any]:
    name = info.path.rstrip("/").rsplit("/", 1)[-1] or info.path
    modified = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(info.mtime))
    return {
        "name": name,
        "path": info.path,
        "type": "directory" if info.is_dir else "file",
        "size": int(info.size),
        "modified": modified,
        "mode": info.mode,
    }


def patch_view(result: ExecResult, timeout: float) -> dict[str, Any]:
    error = f"apply_patch timed out after {timeout:g}s" if result.timed_out else None
    return {"success": result.exit_code == 0 and not result.timed_out,
            "stdout": result.stdout.decode("utf-8", errors="replace"),
            "stderr": result.stderr.decode("utf-8", errors="replace"), "exit_code": result.exit_code,
            "error": error}


def _fingerprint(method: str, path: str, body: dict[str, Any]) -> str:
    payload = _FINGERPRINT_JSON.encode([method, path, body])
    return hashlib.sha256(payload.encode()).hexdigest()


def _error_headers(exc: SandboxError) -> dict[str, str]:
    if isinstance(exc, ServiceUnavailable):
        return {"Retry-After": f"{max(1, round(exc.retry_after_s))}"}
    return {}


def _content_bytes(content: str) -> bytes:
    """An upload's ``content`` field decoded; 400 when it is not base64."""
    try:
        return base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError("content must be base64") from None


def _check_idempotency_key(key: str | None) -> str | None:
    if key is not None and not (1 <= len(key) <= 255 and key.isprintable()):
        raise BadRequestError(f"Idempotency-Key must be 1-255 printable characters, got {len(key)} characters")
    return key


def create_app(orchestrator: Orchestrator, api_keys: Sequence[str], *, manage_lifecycle: bool = True) -> FastAPI:
    """The FastAPI app over `orchestrator`.

    Args:
        orchestrator: what the routes call.
        api_keys: accepted keys (at least one, each non-empty).
        manage_lifecycle: start the orchestrator (reconcile, reaper) with the app and close it after.
    """
    keys = [k.encode() for k in api_keys] if not isinstance(api_keys, str) else []
    if not keys or any(not k for k in keys):
        raise ValueError(f"api_keys must be a non-empty sequence of non-empty strings, got {api_keys!r}")

    def key_ok(candidate: str | None) -> bool:
        if not candidate:
            return False
        given = candidate.encode()
        ok = False
        for key in keys:  # every key is compared, so timing does not tell which one nearly matched
            ok |= hmac.compare_digest(given, key)
        return ok

    # APIKeyHeader reads the header from the request itself (and documents the scheme in the OpenAPI
    # schema); a Header() parameter costs FastAPI a type analysis of its annotation on every request
    # (~40 us of CPU per request, a tenth of a simple request's)
    api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="the service's API key")

    async def require_key(x_api_key: str | None = Security(api_key_header)) -> None:
        if not x_api_key:
            raise AuthError("Missing API key. Please provide X-API-Key header.", status_code=401)
        if not key_ok(x_api_key):
            raise AuthError("Invalid API key", status_code=403)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await orchestrator.start()
            await forks.reconcile()
        try:
            yield
        finally:
            if manage_lifecycle:
                await orchestrator.close()

    app = _ServiceApp(title="orchard sandbox service", version=API_VERSION, lifespan=lifespan,
                      description="Orchard-Env-compatible sandbox API (see docs/env-api.md).")
    app.state.orchestrator = orchestrator
    auth = [Depends(require_key)]
    ns = orchestrator.namespace

    def view(record: SandboxRecord) -> dict[str, Any]:
        return sandbox_view(record, ns, orchestrator.isolation, orchestrator.blocks_network)

    orchestrator.sandbox_response = view
    forks = app.state.forks = Forks(orchestrator)

    async def run_idempotent(key: str | None, method: str, path: str, body: dict[str, Any],
                             operation: Callable[[], Awaitable[tuple[int, dict[str, Any]]]],
                             resource_id: str | None) -> tuple[int, Any]:
        return await orchestrator.idempotent(_check_idempotency_key(key), _fingerprint(method, path, body),
                                             operation, resource_id=resource_id)

    add_fork_routes(app, forks, auth, view, run_idempotent)

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code or 500, content={"detail": exc.detail},
                            headers=_error_headers(exc))

    def replay(status: int, body: dict[str, Any]) -> JSONResponse:
        return JSONResponse(status_code=status, content=body)

    @app.get("/")
    async def root() -> dict[str, Any]:
        return {"service": "orchard-env", "version": API_VERSION, "status": "running"}

    def backend_health() -> dict[str, Any]:
        report = getattr(orchestrator.backend, "health", None)
        return dict(report()) if callable(report) else {"backend": ns}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # Unauthenticated: only whether it runs and how sandboxes are isolated; details are on /resources.
        details = backend_health()
        return {"status": "healthy", "backend": ns, "isolation": details.get("isolation")}

    @app.get("/resources", dependencies=auth)
    async def resources() -> dict[str, Any]:
        return {**await orchestrator.summary(), "backend_health": backend_health()}

    async def do_create(body: CreateSandboxRequest, path: str, idempotency_key: str | None) -> tuple[int, Any]:
        key = _check_idempotency_key(idempotency_key)
        params = CreateParams(image=body.image, block_network=body.block_network, sandbox_id=body.sandbox_id,
                              cpu=body.cpu, memory=body.memory, timeout=body.timeout, ttl_seconds=body.ttl_seconds,
                              heartbeat_timeout=body.heartbeat_timeout, env=body.env or {})
        if key is not None and params.sandbox_id is None:
            # Fix the id before the first attempt so that a retry can find what the first attempt made.
            params = dataclasses.replace(params, sandbox_id=uuid.uuid4().hex[:12])

        async def create() -> tuple[int, dict[str, Any]]:
            record = await orchestrator.create_sandbox(params)
            return 200, view(record)

        return await orchestrator.idempotent(key, _fingerprint("POST", path, body.model_dump()), create,
                                             resource_id=params.sandbox_id)

    @app.post("/sandboxes", dependencies=auth)
    async def create_sandbox(body: CreateSandboxRequest, request: Request,
                             idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
        return replay(*await do_create(body, request.url.path, idempotency_key))

    @app.get("/sandboxes", dependencies=auth)
    async def list_sandboxes() -> dict[str, Any]:
        records = await orchestrator.store.list_sandboxes()
        return {"sandboxes": [view(r) for r in records]}

    @app.get("/sandboxes/{sandbox_id}", dependencies=auth)
    async def get_sandbox(sandbox_id: str) -> dict[str, Any]:
        return view(await orchestrator.get_sandbox(sandbox_id))

    @app.get("/sandboxes/{sandbox_id}/wait", dependencies=auth)
    async def wait_sandbox(sandbox_id: str, timeout: float = Query(3600, gt=0)) -> dict[str, Any]:
        return view(await orchestrator.wait_sandbox(sandbox_id, timeout))

    async def do_delete(sandbox_id: str, path: str, idempotency_key: str | None) -> tuple[int, Any]:
        async def delete() -> tuple[int, dict[str, Any]]:
            await orchestrator.delete_sandbox(sandbox_id)
            return 200, {"status": "deleted", "sandbox_id": sandbox_id}

        key = _check_idempotency_key(idempotency_key)
        return await orchestrator.idempotent(key, _fingerprint("DELETE", path, {}), delete)

    @app.delete("/sandboxes/{sandbox_id}", dependencies=auth)
    async def delete_sandbox(sandbox_id: str, request: Request,
                             idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
        return replay(*await do_delete(sandbox_id, request.url.path, idempotency_key))

    @app.post("/sandboxes/{sandbox_id}/heartbeat", dependencies=auth)
    async def heartbeat(sandbox_id: str) -> dict[str, Any]:
        record = await orchestrator.heartbeat(sandbox_id)
        return {"status": "ok", "sandbox_id": sandbox_id, "last_heartbeat": record.last_heartbeat}

    @app.get("/sandboxes/{sandbox_id}/resources", dependencies=auth)
    async def sandbox_resources(sandbox_id: str) -> dict[str, Any]:
        res = await orchestrator.sandbox_resources(sandbox_id)
        return {"sandbox_id": sandbox_id, "cpu": res.cpu, "memory_mb": res.memory_mb, "pids": res.pids,
                "disk_bytes": res.disk_bytes}

    async def do_exec(sandbox_id: str, body: ExecRequestBody, path: str, idempotency_key: str | None) -> Any:
        key = _check_idempotency_key(idempotency_key)
        params = ExecParams(command=body.command, timeout_seconds=body.timeout_seconds, cwd=body.cwd,
                            env=body.env or {}, login_shell=body.login_shell, max_output_bytes=body.max_output_bytes,
                            stdin=body.stdin.encode() if body.stdin is not None else None)
        # `wait` is how to answer, not what to run: a retry may change it and still be the same exec.
        fingerprint = _fingerprint("POST", path, body.model_dump(exclude={"wait"}))
        job = await orchestrator.submit_exec(sandbox_id, params, key=key, fingerprint=fingerprint)
        if not body.wait:
            return job_view(job)
        timeout = body.timeout_seconds or orchestrator.default_exec_timeout_s
        return job_view(await orchestrator.wait_job(job.job_id, timeout + 30.0))

    @app.post("/sandboxes/{sandbox_id}/exec", dependencies=auth)
    async def exec_command(sandbox_id: str, body: ExecRequestBody, request: Request,
                           idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> dict[str, Any]:
        return await do_exec(sandbox_id, body, request.url.path, idempotency_key)

    @app.get("/jobs/{job_id}", dependencies=auth)
    async def get_job(job_id: str) -> dict[str, Any]:
        return job_view(await orchestrator.get_job(job_id))

    @app.get("/jobs/{job_id}/wait", dependencies=auth)
    async def wait_job(job_id: str, timeout: float = Query(300, ge=0)) -> dict[str, Any]:
        return job_view(await orchestrator.wait_job(job_id, timeout))

    @app.post("/sandboxes/{sandbox_id}/apply_patch", dependencies=auth)
    async def apply_patch(sandbox_id: str, body: ApplyPatchRequest, request: Request,
                          idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
        async def patch() -> tuple[int, dict[str, Any]]:
            result = await orchestrator.apply_patch(sandbox_id, body.patch, body.timeout_seconds)
            return 200, patch_view(result, body.timeout_seconds)

        key = _check_idempotency_key(idempotency_key)
        fingerprint = _fingerprint(request.method, request.url.path, body.model_dump())
        return replay(*await orchestrator.idempotent(key, fingerprint, patch))

    @app.post("/sandboxes/{sandbox_id}/files", dependencies=auth)
    async def upload_file(sandbox_id: str, body: UploadFileRequest, request: Request,
                          idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
        data = _content_bytes(body.content)

        async def upload() -> tuple[int, dict[str, Any]]:
            size = await orchestrator.write_file(sandbox_id, body.path, data, body.mode)
            return 200, {"success": True, "path": body.path, "size": size}

        key = _check_idempotency_key(idempotency_key)
        fingerprint = _fingerprint(request.method, request.url.path,
                                   {"path": body.path, "mode": body.mode, "sha256": hashlib.sha256(data).hexdigest()})
        return replay(*await orchestrator.idempotent(key, fingerprint, upload))

    @app.post("/sandboxes/{sandbox_id}/files/archive", dependencies=auth)
    async def upload_archive(sandbox_id: str, body: UploadArchiveRequest, request: Request,
                             idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
        data = _content_bytes(body.content)

        async def unpack() -> tuple[int, dict[str, Any]]:
            entries, size = await orchestrator.extract_archive(sandbox_id, body.path, data)
            return 200, {"success": True, "path": body.path, "entries": entries, "size": size}

        key = _check_idempotency_key(idempotency_key)
        fingerprint = _fingerprint(request.method, request.url.path,
                                   {"path": body.path, "sha256": hashlib.sha256(data).hexdigest()})
        return replay(*await orchestrator.idempotent(key, fingerprint, unpack))

    @app.get("/sandboxes/{sandbox_id}/files", dependencies=auth)
    async def download_file(sandbox_id: str, path: str, max_bytes: int | None = Query(None, ge=0)) -> dict[str, Any]:
        data = await orchestrator.read_file(sandbox_id, path, max_bytes)
        return {"path": path, "content": base64.b64encode(data).decode("ascii"), "size": len(data)}

    @app.get("/sandboxes/{sandbox_id}/files/list", dependencies=auth)
    async def list_files(sandbox_id: str, path: str = "/workspace", recursive: bool = False) -> dict[str, Any]:
        infos = await orchestrator.list_files(sandbox_id, path, recursive)
        return {"path": path, "files": [file_view(i) for i in infos]}

    @app.websocket("/sandboxes/{sandbox_id}/exec/pty")
    async def pty(ws: WebSocket, sandbox_id: str) -> None:
        await _serve_pty(ws, sandbox_id, orchestrator, key_ok)

    async def direct(method: str, parts: list[str], headers: dict[bytes, bytes], body: bytes,
                     query: bytes) -> tuple[int, Any, dict[str, str]] | None:
        """The answer to a well-formed, authorised hot call, or None to let FastAPI answer (and refuse)."""
        if not key_ok(headers.get(b"x-api-key", b"").decode("latin-1")):
            return None
        idempotency_key = headers.get(b"idempotency-key")
        key = idempotency_key.decode("latin-1") if idempotency_key is not None else None
        path = "/".join(parts)
        try:
            if method == "GET":
                if len(parts) == 3:
                    return 200, job_view(await orchestrator.get_job(parts[2])), {}
                timeout = _wait_timeout(query)
                if timeout is None:
                    return None
                return 200, job_view(await orchestrator.wait_job(parts[2], timeout)), {}
            if method == "DELETE":
                return (*await do_delete(parts[2], path, key), {})
            if headers.get(b"content-type") != b"application/json":
                return None
            try:
                payload = json.loads(body)
                model = (CreateSandboxRequest if len(parts) == 2 else ExecRequestBody).model_validate(payload)
            except ValueError:  # pydantic's ValidationError is one: FastAPI answers 422 with its details
                return None
            if isinstance(model, CreateSandboxRequest):
                return (*await do_create(model, path, key), {})
            return 200, await do_exec(parts[2], model, path, key), {}
        except SandboxError as exc:
            return exc.status_code or 500, {"detail": exc.detail}, _error_headers(exc)

    app.direct = direct
    return app


_ID_SEGMENT = re.compile(r"[A-Za-z0-9_-]{1,255}")
_WAIT_QUERY = re.compile(rb"timeout=([0-9]{1,12}(?:\.[0-9]{1,12})?)")


def _wait_timeout(query: bytes) -> float | None:
    if not query:
        return 300.0
    match = _WAIT_QUERY.fullmatch(query)
    return float(match.group(1)) if match else None


def _hot_route(method: str, path: str) -> list[str] | None:
    """`path` split at "/" when it is one of the calls every rollout makes many times (create, exec, delete,
    get or wait for a job) with plain ids, else None."""
    parts = path.split("/")
    n = len(parts)
    if n < 2 or parts[0] or parts[1] not in ("sandboxes", "jobs"):
        return None
    if parts[1] == "sandboxes":
        hot = ((method == "POST" and (n == 2 or (n == 4 and parts[3] == "exec")))
               or (method == "DELETE" and n == 3))
    else:
        hot = method == "GET" and (n == 3 or (n == 4 and parts[3] == "wait"))
    if not hot or (n > 2 and not _ID_SEGMENT.fullmatch(parts[2])):
        return None
    return parts


class _ServiceApp(FastAPI):
    """FastAPI, with the hot calls answered directly.

    Each request through FastAPI's middleware stack, router and dependency solver costs about as much CPU as
    the orchestrator's own work for it. A create, exec, delete or job read that is authorised and whose body
    validates (the same pydantic models, validated the way FastAPI validates them) is answered by `direct`
    with the same functions, status codes and JSON bodies; anything else (a missing or wrong key, a body that
    does not validate, an odd path or query) goes through FastAPI unchanged, with the body replayed, so every
    error is FastAPI's own.
    """

    direct: Callable[..., Awaitable[tuple[int, Any, dict[str, str]] | None]] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        parts = None
        if scope["type"] == "http" and self.direct is not None and not scope.get("root_path"):
            parts = _hot_route(scope["method"], scope["path"])
        if parts is None:
            await super().__call__(scope, receive, send)
            return
        messages = []
        chunks = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), value)  # the first of repeated headers, as Starlette reads them
        answer = None
        if messages[-1]["type"] == "http.request":
            answer = await self.direct(scope["method"], parts, headers, b"".join(chunks),
                                       scope.get("query_string", b""))
        if answer is None:
            replayed = iter(messages)

            async def replay() -> Any:
                return next(replayed, None) or await receive()

            await super().__call__(scope, replay, send)
            return
        status, content, extra = answer
        body = _RESPONSE_JSON.encode(content).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json"),
                                *((k.lower().encode(), v.encode()) for k, v in extra.items())]})
        await send({"type": "http.response.body", "body": body})


def _pty_command(init: dict[str, Any]) -> str | None:
    cmd = init.get("cmd")
    if cmd is None:
        command = None
    elif isinstance(cmd, list) and all(isinstance(c, str) for c in cmd) and cmd:
        command = shlex.join(cmd)
    elif isinstance(cmd, str) and cmd:
        command = cmd
    else:
        raise BadRequestError(f"init.cmd must be a non-empty argv list or string, got {cmd!r}")
    env = init.get("env") or {}
    cwd = init.get("cwd")
    if not env and not cwd:
        return command
    prefix = f"cd {shlex.quote(cwd)} && " if cwd else ""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    return f"{prefix}exec env {assignments} {command or 'bash -l'}".replace("  ", " ")


async def _serve_pty(ws: WebSocket, sandbox_id: str, orchestrator: Orchestrator, key_ok: Any) -> None:
    """The PTY protocol (JSON text frames, data base64):
    client -> server: auth {api_key} (only if no header), init {cmd, env, cwd, rows, cols}, stdin {data},
    resize {rows, cols}, signal {sig}, close; server -> client: ready {pid}, stdout {data}, exit {code},
    error {message}."""
    subprotocol = None
    key = ws.headers.get("x-api-key")
    for proto in (p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",")):
        if proto.startswith("api_key."):
            key, subprotocol = key or proto[len("api_key."):], proto
    await ws.accept(subprotocol=subprotocol)

    async def fail(code: int, message: str) -> None:
        with contextlib.suppress(Exception):
            await ws.send_text(json.dumps({"type": "error", "message": message}))
            await ws.close(code=code, reason=message[:120])

    if "api_key" in ws.query_params:
        await fail(4400, "API keys in the URL are refused: send X-API-Key or an auth first message")
        return
    first: dict[str, Any] | None = None
    try:
        if key is None:
            first = json.loads(await asyncio.wait_for(ws.receive_text(), WS_AUTH_TIMEOUT_S))
            key = first.pop("api_key", None) if isinstance(first, dict) else None
            if isinstance(first, dict) and first.get("type") == "auth":
                first = None
        if not key:
            await fail(4401, "Missing API key")
            return
        if not key_ok(key):
            await fail(4403, "Invalid API key")
            return
        if first is None:
            first = json.loads(await asyncio.wait_for(ws.receive_text(), 60.0))
        if not isinstance(first, dict) or first.get("type") != "init":
            await fail(4400, "the first frame after auth must be {\"type\": \"init\", ...}")
            return
        command = _pty_command(first)
        session = await orchestrator.open_pty(sandbox_id, command, cols=int(first.get("cols") or 80),
                                              rows=int(first.get("rows") or 24))
    except (asyncio.TimeoutError, json.JSONDecodeError, WebSocketDisconnect, ValueError, TypeError) as exc:
        await fail(4400, f"bad PTY handshake: {type(exc).__name__}: {exc}")
        return
    except SandboxError as exc:
        await fail(4000 + exc.status_code, str(exc))
        return

    await ws.send_text(json.dumps({"type": "ready", "pid": getattr(session, "pid", None)}))

    async def to_client() -> None:
        async for chunk in session.read():
            await ws.send_text(json.dumps({"type": "stdout", "data": base64.b64encode(chunk).decode("ascii")}))
        code = await _exit_code(session)
        await ws.send_text(json.dumps({"type": "exit", "code": code}))

    async def from_client() -> None:
        while True:
            frame = json.loads(await ws.receive_text())
            kind = frame.get("type")
            if kind == "stdin":
                await session.write(base64.b64decode(frame.get("data", "")))
            elif kind == "resize":
                await session.resize(int(frame.get("cols", 80)), int(frame.get("rows", 24)))
            elif kind == "signal":
                if str(frame.get("sig", "")).upper().removeprefix("SIG") == "INT":
                    await session.write(b"\x03")  # what Ctrl-C does at a terminal
                else:
                    await session.close()
            elif kind == "close":
                await session.close()
                return

    out = asyncio.create_task(to_client())
    inp = asyncio.create_task(from_client())
    try:
        await asyncio.wait({out, inp}, return_when=asyncio.FIRST_COMPLETED)
        if inp.done() and not out.done():  # the client is gone or asked to close: let the output drain briefly
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(out), 2.0)
    finally:
        for task in (out, inp):
            task.cancel()
        await asyncio.gather(out, inp, return_exceptions=True)
        with contextlib.suppress(Exception):
            await session.close()
        with contextlib.suppress(Exception):
            await ws.close()


async def _exit_code(session: Any) -> int:
    for name in ("exit_code", "returncode"):
        value = getattr(session, name, None)
        if callable(value):
            value = value()
        if asyncio.iscoroutine(value):
            value = await value
        if isinstance(value, int):
            return value
    wait = getattr(session, "wait", None)
    if callable(wait):
        with contextlib.suppress(Exception):
            value = await asyncio.wait_for(wait(), 5.0)
            if isinstance(value, int):
                return value
    return -1
