"""The asyncio client of the sandbox service; the same API as `SandboxClient`, awaited.

    async with AsyncSandboxClient() as client:
        async with await client.create() as sb:
            result = await sb.exec("echo hi")
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchard._extras import requires_extra

with requires_extra("env"):
    import httpx

from orchard.env.client._common import (
    COPY_TIMEOUT_S,
    OPEN_SANDBOXES,
    RETRY_STATUSES,
    FileEntry,
    JobResult,
    PatchResult,
    RetryPolicy,
    error_from_parts,
    fork_payload,
    keepalive_interval_s,
    new_idempotency_key,
    parse_retry_after,
    pty_init_frame,
    resolve_settings,
    unreachable_message,
    ws_url,
)
from orchard.env.client.sync import EXEC_GRACE_S
from orchard.env.errors import NotFoundError, SandboxConnectionError, SandboxError, WaitTimeoutError

if TYPE_CHECKING:
    import aiohttp

def _transport_errors() -> tuple[type[BaseException], ...]:
    """What an attempt raises when no answer came (connection refused, reset or dropped, read timeout): retried.
    aiohttp is imported here, on first use, not with `orchard.env` (it costs ~0.1 s to import); HTTP error
    statuses are answers, not exceptions (`raise_for_status=False`)."""
    with requires_extra("env"):
        import aiohttp

    return (httpx.TransportError, aiohttp.ClientError, OSError, asyncio.TimeoutError)


_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def _encode(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def _decode(content: bytes) -> Any:
    return json.loads(content)


def _query_value(value: Any) -> str:
    """A query parameter as httpx writes it: booleans lower case, None empty, everything else `str()`."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    return "" if value is None else str(value)



class AsyncSandboxClient:
    """Asyncio twin of `SandboxClient` (same arguments, same retries and idempotency keys).

    Requests go over one aiohttp session (opened on first use, in the running event loop) holding at most
    `max_connections` (default 1024) keep-alive connections to the service. httpx's async client costs about
    ten times the CPU per request under many concurrent calls (its pool scans every connection for every
    queued request); it is used only when a `transport` (an `httpx.AsyncBaseTransport`, e.g. a mock or an
    ASGI app in tests) is given.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 60.0,
                 retry: RetryPolicy | None = None, auto_cleanup: bool = True,
                 transport: httpx.AsyncBaseTransport | None = None, max_connections: int = 1024) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        self.base_url, self.api_key = resolve_settings(base_url, api_key)
        self.timeout = float(timeout)
        self.retry = retry or RetryPolicy()
        self.auto_cleanup = auto_cleanup
        if not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        self.max_connections = max_connections
        self._headers = {"X-API-Key": self.api_key} if self.api_key else {}
        self._httpx = None if transport is None else httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=self.timeout, transport=transport)
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}
        self._retried = _transport_errors()
        self._owned: dict[str, AsyncSandbox] = {}

    def _aiohttp(self) -> aiohttp.ClientSession:
        session = self._session
        if session is not None and self._session_loop is asyncio.get_running_loop() and not session.closed:
            return session
        return self._new_session()

    def _new_session(self) -> aiohttp.ClientSession:
        # A session belongs to the loop it was made in: a client used again under a new asyncio.run gets a
        # new one (the old loop, and its connections, are gone).
        with requires_extra("env"):
            import aiohttp

        # Idle connections are closed after 4 s, before a server's own keep-alive timeout (uvicorn's default is
        # 5 s) can close one under a request about to be sent on it.
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, keepalive_timeout=4.0)
        # httpx honours HTTP(S)_PROXY / ALL_PROXY / NO_PROXY; aiohttp does with trust_env, at the cost of
        # reading the environment on every request, so only when a proxy is configured at all.
        proxied = any(os.environ.get(name) for name in _PROXY_VARIABLES)
        self._session = aiohttp.ClientSession(headers=self._headers, connector=connector, trust_env=proxied,
                                              raise_for_status=False, auto_decompress=True)
        self._session_loop = asyncio.get_running_loop()
        return self._session

    def _timeout(self, read_timeout: float) -> aiohttp.ClientTimeout:
        # As the httpx path's `httpx.Timeout(read_timeout, connect=10.0)`: 10 s to connect, `read_timeout`
        # between bytes of the answer and for a free connection; no bound on the whole exchange.
        timeout = self._timeouts.get(read_timeout)
        if timeout is None:
            with requires_extra("env"):
                import aiohttp

            timeout = aiohttp.ClientTimeout(total=None, connect=read_timeout, sock_connect=10.0,
                                            sock_read=read_timeout)
            if len(self._timeouts) < 64:
                self._timeouts[read_timeout] = timeout
        return timeout

    async def _send(self, method: str, path: str, body: bytes | None, params: dict[str, Any] | None,
                    headers: dict[str, str], read_timeout: float) -> tuple[int, str | None, bytes]:
        """One attempt: (status, Retry-After header or None, body). Raises one of `_transport_errors()` when no
        answer came."""
        if self._httpx is not None:
            response = await self._httpx.request(method, path, content=body, params=params, headers=headers,
                                                 timeout=httpx.Timeout(read_timeout, connect=10.0))
            return response.status_code, response.headers.get("Retry-After"), response.content
        query = None if params is None else {k: _query_value(v) for k, v in params.items()}
        async with self._aiohttp().request(method, self.base_url + path, data=body, params=query, headers=headers,
                                           timeout=self._timeout(read_timeout)) as response:
            return response.status, response.headers.get("Retry-After"), await response.read()

    async def request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                      timeout: float | None = None) -> Any:
        """One API call with retries (see `SandboxClient.request`)."""
        headers = {"Idempotency-Key": new_idempotency_key()} if method in ("POST", "DELETE", "PUT") else {}
        body = None
        if json is not None:
            body = _encode(json)
            headers["Content-Type"] = "application/json"
        read_timeout = timeout or self.timeout
        retried = self._retried
        last: BaseException | None = None
        for attempt in range(self.retry.max_attempts):
            final = attempt == self.retry.max_attempts - 1
            try:
                status, retry_after, content = await self._send(method, path, body, params, headers, read_timeout)
            except retried as exc:
                last = exc
                if final:
                    break
                await asyncio.sleep(self.retry.delay(attempt))
                continue
            if status in RETRY_STATUSES and not final:
                await asyncio.sleep(self.retry.delay(attempt, parse_retry_after(retry_after)))
                continue
            if status >= 400:
                raise error_from_parts(status, content, retry_after)
            return _decode(content)
        raise SandboxConnectionError(
            unreachable_message(self.base_url, method, path, self.retry.max_attempts, last)) from last

    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "/health")

    async def resources(self) -> dict[str, Any]:
        return await self.request("GET", "/resources")

    async def list_sandboxes(self) -> list[dict[str, Any]]:
        return (await self.request("GET", "/sandboxes"))["sandboxes"]

    async def create(self, image: str = "host", *, block_network: bool = True, sandbox_id: str | None = None,
                     cpu: str | None = None, memory: str | None = None, timeout: int | None = None,
                     ttl_seconds: float | None = None, heartbeat_timeout: float | None = None,
                     env: dict[str, str] | None = None, wait_ready: bool = True,
                     keepalive_s: float | None = None) -> AsyncSandbox:
        """Create a sandbox; see `SandboxClient.create`. `async with await client.create() as sb:`."""
        payload: dict[str, Any] = {"image": image, "block_network": block_network}
        for name, value in (("sandbox_id", sandbox_id), ("cpu", cpu), ("memory", memory), ("timeout", timeout),
                            ("ttl_seconds", ttl_seconds), ("heartbeat_timeout", heartbeat_timeout), ("env", env)):
            if value is not None:
                payload[name] = value
        info = await self.request("POST", "/sandboxes", json=payload)
        sandbox = AsyncSandbox(self, info["sandbox_id"], info, owned=True)
        if wait_ready and not info.get("ready", info.get("status") == "ready"):
            wait_s = float(timeout or 3600)
            sandbox.info = await self.request("GET", f"/sandboxes/{sandbox.sandbox_id}/wait",
                                              params={"timeout": wait_s}, timeout=wait_s + 30)
        if keepalive_s is not None:
            sandbox.start_heartbeat(keepalive_s)
        return sandbox

    create_sandbox = create

    async def sandbox(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self, sandbox_id, await self.request("GET", f"/sandboxes/{sandbox_id}"), owned=False)

    async def get_job(self, job_id: str) -> JobResult:
        return JobResult.from_dict(await self.request("GET", f"/jobs/{job_id}"))

    async def wait_job(self, job_id: str, timeout: float = 300.0) -> JobResult:
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            job = JobResult.from_dict(await self.request(
                "GET", f"/jobs/{job_id}/wait", params={"timeout": min(left, 300.0)}, timeout=min(left, 300) + 30))
            if job.done:
                return job
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"job {job_id} still {job.status} after {timeout}s", status_code=0)

    # snapshots and forks
    async def list_snapshots(self) -> list[dict[str, Any]]:
        return (await self.request("GET", "/snapshots"))["snapshots"]

    async def get_snapshot(self, snapshot_id: str) -> AsyncSnapshot:
        """Attach to an existing snapshot (`NotFoundError` if there is none)."""
        return AsyncSnapshot(self, await self.request("GET", f"/snapshots/{snapshot_id}"))

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot; its forks are not affected. Idempotent: a gone snapshot is not an error."""
        with contextlib.suppress(NotFoundError):
            await self.request("DELETE", f"/snapshots/{snapshot_id}")

    async def _fork(self, path: str, *, sandbox_id: str | None, timeout: int | None, ttl_seconds: float | None,
                    heartbeat_timeout: float | None, keepalive_s: float | None) -> AsyncSandbox:
        payload = fork_payload(sandbox_id=sandbox_id, timeout=timeout, ttl_seconds=ttl_seconds,
                               heartbeat_timeout=heartbeat_timeout)
        info = await self.request("POST", path, json=payload, timeout=max(self.timeout, COPY_TIMEOUT_S))
        sandbox = AsyncSandbox(self, info["sandbox_id"], info, owned=True)
        if keepalive_s is not None:
            sandbox.start_heartbeat(keepalive_s)
        return sandbox

    def _own(self, sandbox: AsyncSandbox) -> None:
        self._owned[sandbox.sandbox_id] = sandbox
        if self.auto_cleanup:
            OPEN_SANDBOXES.add(self.base_url, sandbox.sandbox_id, self.api_key)

    def _disown(self, sandbox_id: str) -> None:
        self._owned.pop(sandbox_id, None)
        OPEN_SANDBOXES.discard(self.base_url, sandbox_id)

    async def aclose(self) -> None:
        if self.auto_cleanup:
            results = await asyncio.gather(*(s.delete() for s in list(self._owned.values())),
                                           return_exceptions=True)
            del results  # best effort: what failed stays in the at-exit registry
        if self._httpx is not None:
            await self._httpx.aclose()
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncSandbox:
    """One sandbox; `async with` deletes it on exit (cancellation and Ctrl-C included)."""

    def __init__(self, client: AsyncSandboxClient, sandbox_id: str, info: dict[str, Any], *, owned: bool) -> None:
        self.client = client
        self.sandbox_id = sandbox_id
        self.info = info
        self.deleted = False
        self._keepalive: asyncio.Task[None] | None = None
        if owned:
            client._own(self)

    def _path(self, suffix: str = "") -> str:
        return f"/sandboxes/{self.sandbox_id}{suffix}"

    async def refresh(self) -> dict[str, Any]:
        self.info = await self.client.request("GET", self._path())
        return self.info

    async def exec(self, command: str | list[str], *, timeout: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, login_shell: bool = False, wait: bool = True,
                   max_output_bytes: int | None = None, stdin: str | None = None) -> JobResult:
        """See `Sandbox.exec`."""
        if self.deleted:
            raise NotFoundError(f"sandbox {self.sandbox_id} was deleted")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        body: dict[str, Any] = {"command": command, "timeout_seconds": timeout, "cwd": cwd, "env": env,
                                "login_shell": login_shell, "wait": wait}
        if max_output_bytes is not None:
            body["max_output_bytes"] = max_output_bytes
        if stdin is not None:
            body["stdin"] = stdin
        exec_s = float(timeout or 300.0)
        data = await self.client.request("POST", self._path("/exec"), json=body, timeout=exec_s + EXEC_GRACE_S)
        job = JobResult.from_dict({"sandbox_id": self.sandbox_id, **data})
        if not wait or job.done:
            return job
        return await self.client.wait_job(job.job_id, timeout=exec_s + EXEC_GRACE_S)

    async def get_job(self, job_id: str) -> JobResult:
        return await self.client.get_job(job_id)

    async def wait_job(self, job_id: str, timeout: float = 300.0) -> JobResult:
        return await self.client.wait_job(job_id, timeout)

    async def upload(self, remote_path: str, data: bytes | str, *, mode: int | None = None) -> int:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        body: dict[str, Any] = {"path": remote_path, "content": base64.b64encode(raw).decode("ascii")}
        if mode is not None:
            body["mode"] = mode
        return int((await self.client.request("POST", self._path("/files"), json=body))["size"])

    async def upload_archive(self, remote_path: str, archive: bytes) -> int:
        """See `Sandbox.upload_archive`."""
        body = {"path": remote_path, "content": base64.b64encode(bytes(archive)).decode("ascii")}
        return int((await self.client.request("POST", self._path("/files/archive"), json=body))["size"])

    async def upload_file(self, local_path: str | Path, remote_path: str) -> int:
        path = Path(local_path)
        return await self.upload(remote_path, path.read_bytes(), mode=path.stat().st_mode & 0o777)

    async def download(self, remote_path: str, *, max_bytes: int | None = None) -> bytes:
        params: dict[str, Any] = {"path": remote_path}
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        data = await self.client.request("GET", self._path("/files"), params=params)
        return base64.b64decode(data["content"])

    async def download_file(self, remote_path: str, local_path: str | Path) -> int:
        data = await self.download(remote_path)
        Path(local_path).write_bytes(data)
        return len(data)

    async def list_files(self, path: str = "/workspace", *, recursive: bool = False) -> list[FileEntry]:
        data = await self.client.request("GET", self._path("/files/list"),
                                         params={"path": path, "recursive": recursive})
        return [FileEntry.from_dict(f) for f in data["files"]]

    async def apply_patch(self, patch: str, *, timeout: float = 30.0) -> PatchResult:
        data = await self.client.request("POST", self._path("/apply_patch"),
                                         json={"patch": patch, "timeout_seconds": timeout}, timeout=timeout + 30)
        return PatchResult.from_dict(data)

    async def resources(self) -> dict[str, Any]:
        return await self.client.request("GET", self._path("/resources"))

    async def heartbeat(self) -> None:
        await self.client.request("POST", self._path("/heartbeat"))

    def start_heartbeat(self, interval_s: float = 60.0) -> None:
        """Send a heartbeat every `interval_s` seconds from a background task until `stop_heartbeat`/delete."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        if self._keepalive is not None and not self._keepalive.done():
            return

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval_s)
                with contextlib.suppress(SandboxError):
                    await self.heartbeat()

        self._keepalive = asyncio.create_task(beat())

    def keep_alive(self) -> None:
        """Heartbeat the sandbox every third of its heartbeat timeout (its info's, else the service's default, 600 s)
        until `stop_heartbeat` or `delete`; a no-op where a heartbeat runs already. What holds a sandbox through a
        long wait that touches it not at all (a slow model call, an episode a program reaches later) calls this,
        so the reaper never takes a sandbox in use; one its holder abandons (a killed process) is reaped as ever."""
        self.start_heartbeat(keepalive_interval_s(self.info))

    async def stop_heartbeat(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None

    async def pty(self, cmd: str | list[str] | None = None, *, env: dict[str, str] | None = None,
                  cwd: str | None = None, rows: int = 24, cols: int = 80,
                  connect_timeout: float = 10.0) -> AsyncPtyProcess:
        return await AsyncPtyProcess.connect(ws_url(self.client.base_url, self.sandbox_id), self.client.api_key,
                                             pty_init_frame(cmd, env=env, cwd=cwd, rows=rows, cols=cols),
                                             connect_timeout)

    async def snapshot(self, snapshot_id: str | None = None) -> AsyncSnapshot:
        """Copy this sandbox's workspace into a snapshot; see `Sandbox.snapshot`."""
        payload = {"snapshot_id": snapshot_id} if snapshot_id is not None else {}
        info = await self.client.request("POST", self._path("/snapshots"), json=payload,
                                         timeout=max(self.client.timeout, COPY_TIMEOUT_S))
        return AsyncSnapshot(self.client, info)

    async def fork(self, *, sandbox_id: str | None = None, timeout: int | None = None,
                   ttl_seconds: float | None = None, heartbeat_timeout: float | None = None,
                   keepalive_s: float | None = None) -> AsyncSandbox:
        """A new sandbox whose workspace starts as a copy of this one's; see `Sandbox.fork`."""
        return await self.client._fork(self._path("/fork"), sandbox_id=sandbox_id, timeout=timeout,
                                       ttl_seconds=ttl_seconds, heartbeat_timeout=heartbeat_timeout,
                                       keepalive_s=keepalive_s)

    async def delete(self) -> None:
        if self.deleted:
            return
        await self.stop_heartbeat()
        with contextlib.suppress(NotFoundError):
            await self.client.request("DELETE", self._path())
        self.deleted = True
        self.client._disown(self.sandbox_id)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Shielded so that a cancelled task (Ctrl-C under asyncio.run) still deletes its sandbox.
        await asyncio.shield(self.delete())

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.sandbox_id!r}, deleted={self.deleted})"


class AsyncSnapshot:
    """A snapshot of a sandbox's workspace; see `Snapshot`. `async with await sb.snapshot() as snap:`."""

    def __init__(self, client: AsyncSandboxClient, info: dict[str, Any]) -> None:
        self.client = client
        self.info = info
        self.snapshot_id: str = info["snapshot_id"]
        self.deleted = False

    async def fork(self, *, sandbox_id: str | None = None, timeout: int | None = None,
                   ttl_seconds: float | None = None, heartbeat_timeout: float | None = None,
                   keepalive_s: float | None = None) -> AsyncSandbox:
        """A new sandbox whose workspace starts as a copy of this snapshot; see `Snapshot.fork`."""
        return await self.client._fork(f"/snapshots/{self.snapshot_id}/fork", sandbox_id=sandbox_id,
                                       timeout=timeout, ttl_seconds=ttl_seconds,
                                       heartbeat_timeout=heartbeat_timeout, keepalive_s=keepalive_s)

    async def delete(self) -> None:
        if not self.deleted:
            await self.client.delete_snapshot(self.snapshot_id)
            self.deleted = True

    async def __aenter__(self) -> AsyncSnapshot:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.shield(self.delete())

    def __repr__(self) -> str:
        return f"AsyncSnapshot({self.snapshot_id!r} of {self.info.get('sandbox_id')!r}, deleted={self.deleted})"


class AsyncPtyProcess:
    """Asyncio twin of `PtyProcess`."""

    def __init__(self) -> None:
        self._ws: Any = None
        self._out: asyncio.Queue[bytes] = asyncio.Queue()
        self._exited = asyncio.Event()
        self._ready = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self.returncode: int | None = None
        self.error: str | None = None
        self.pid: int | None = None

    @classmethod
    async def connect(cls, url: str, api_key: str | None, init: dict[str, Any],
                      connect_timeout: float) -> AsyncPtyProcess:
        with requires_extra("env"):
            from websockets.asyncio.client import connect

        self = cls()
        headers = {"X-API-Key": api_key} if api_key else {}
        self._ws = await connect(url, additional_headers=headers, open_timeout=connect_timeout, max_size=1 << 24)
        await self._ws.send(json.dumps(init))
        self._reader = asyncio.create_task(self._read_loop())
        try:
            await asyncio.wait_for(self._ready.wait(), connect_timeout)
        except asyncio.TimeoutError:
            self.error = "no ready frame"
        if self.error:
            await self.close()
            raise SandboxError(f"PTY did not start: {self.error}")
        return self

    async def _read_loop(self) -> None:
        try:
            async for message in self._ws:
                frame = json.loads(message)
                kind = frame.get("type")
                if kind == "stdout":
                    self._out.put_nowait(base64.b64decode(frame.get("data", "")))
                elif kind == "ready":
                    self.pid = frame.get("pid")
                    self._ready.set()
                elif kind == "exit":
                    self.returncode = int(frame.get("code", -1))
                    break
                elif kind == "error":
                    self.error = str(frame.get("message"))
                    break
        except Exception as exc:
            self.error = self.error or f"{type(exc).__name__}: {exc}"
        finally:
            self._exited.set()
            self._ready.set()
            self._out.put_nowait(b"")

    async def write(self, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        await self._ws.send(json.dumps({"type": "stdin", "data": base64.b64encode(raw).decode("ascii")}))

    async def read(self, timeout: float | None = None) -> bytes:
        try:
            chunk = await asyncio.wait_for(self._out.get(), timeout)
        except asyncio.TimeoutError:
            raise WaitTimeoutError(f"no PTY output within {timeout}s", status_code=0) from None
        if not chunk:
            self._out.put_nowait(b"")
        return chunk

    async def read_until(self, marker: bytes, timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        buffer = b""
        while marker not in buffer:
            chunk = await self.read(max(0.0, deadline - time.monotonic()))
            if not chunk:
                raise WaitTimeoutError(f"PTY exited before {marker!r}; got {buffer[-200:]!r}", status_code=0)
            buffer += chunk
        return buffer

    async def resize(self, rows: int, cols: int) -> None:
        await self._ws.send(json.dumps({"type": "resize", "rows": int(rows), "cols": int(cols)}))

    async def kill(self, sig: str = "TERM") -> None:
        await self._ws.send(json.dumps({"type": "signal", "sig": sig}))

    async def wait(self, timeout: float | None = None) -> int:
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
        except asyncio.TimeoutError:
            raise WaitTimeoutError(f"PTY process still running after {timeout}s", status_code=0) from None
        return self.returncode if self.returncode is not None else -1

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._ws.send(json.dumps({"type": "close"}))
        with contextlib.suppress(Exception):
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader

    async def __aenter__(self) -> AsyncPtyProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
