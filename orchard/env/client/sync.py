"""The synchronous client of the sandbox service.

    from orchard.env import SandboxClient
    with SandboxClient() as client:                      # SANDBOX_BASE_URL / SANDBOX_API_KEY
        with client.create() as sb:                      # deleted on exit, on Ctrl-C, at interpreter exit
            result = sb.exec("python -c 'print(1 + 1)'")
            assert result.exit_code == 0 and result.stdout == "2\\n"
"""

from __future__ import annotations

import base64
import contextlib
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

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
    error_from_response,
    fork_payload,
    keepalive_interval_s,
    new_idempotency_key,
    pty_init_frame,
    resolve_settings,
    retry_after_of,
    unreachable_message,
    ws_url,
)
from orchard.env.errors import (
    NotFoundError,
    SandboxConnectionError,
    SandboxError,
    WaitTimeoutError,
)

EXEC_GRACE_S = 60.0
"""Extra seconds a client waits beyond an exec's own timeout before it gives up on the answer."""


class SandboxClient:
    """Client of an Orchard-Env-compatible sandbox service.

    Args:
        base_url: the service; default `$SANDBOX_BASE_URL`, else http://localhost:8000.
        api_key: default `$SANDBOX_API_KEY`.
        timeout: seconds for a request without a longer natural wait. Default 60.
        retry: backoff policy for connection errors and 502/503/504 (503's Retry-After is honoured).
            Every mutating request carries one `Idempotency-Key` across its retries, so a retry never runs
            an operation twice.
        auto_cleanup: delete sandboxes this client created when it closes and at interpreter exit.
        transport: an httpx transport (tests).
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 60.0,
                 retry: RetryPolicy | None = None, auto_cleanup: bool = True,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        self.base_url, self.api_key = resolve_settings(base_url, api_key)
        self.timeout = float(timeout)
        self.retry = retry or RetryPolicy()
        self.auto_cleanup = auto_cleanup
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=self.timeout,
                                  transport=transport, limits=httpx.Limits(max_connections=256))
        self._owned: dict[str, Sandbox] = {}
        self._owned_lock = threading.Lock()

    # plumbing
    def request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                timeout: float | None = None) -> Any:
        """One API call with retries; returns the decoded JSON body or raises a typed `SandboxError`.
        POST and DELETE get an `Idempotency-Key`, the same on every retry."""
        headers = {"Idempotency-Key": new_idempotency_key()} if method in ("POST", "DELETE", "PUT") else {}
        read_timeout = timeout or self.timeout
        last: BaseException | None = None
        for attempt in range(self.retry.max_attempts):
            final = attempt == self.retry.max_attempts - 1
            try:
                response = self._http.request(method, path, json=json, params=params, headers=headers,
                                              timeout=httpx.Timeout(read_timeout, connect=10.0))
            except httpx.TransportError as exc:
                last = exc
                if final:
                    break
                time.sleep(self.retry.delay(attempt))
                continue
            if response.status_code in RETRY_STATUSES and not final:
                time.sleep(self.retry.delay(attempt, retry_after_of(response)))
                continue
            if response.status_code >= 400:
                raise error_from_response(response)
            return response.json()
        raise SandboxConnectionError(
            unreachable_message(self.base_url, method, path, self.retry.max_attempts, last)) from last

    # service
    def health(self) -> dict[str, Any]:
        return self.request("GET", "/health")

    def resources(self) -> dict[str, Any]:
        return self.request("GET", "/resources")

    def list_sandboxes(self) -> list[dict[str, Any]]:
        return self.request("GET", "/sandboxes")["sandboxes"]

    def create(self, image: str = "host", *, block_network: bool = True, sandbox_id: str | None = None,
               cpu: str | None = None, memory: str | None = None, timeout: int | None = None,
               ttl_seconds: float | None = None, heartbeat_timeout: float | None = None,
               env: dict[str, str] | None = None, wait_ready: bool = True,
               keepalive_s: float | None = None) -> Sandbox:
        """Create a sandbox (use it as a context manager to delete it on exit).

        Args:
            image: root file system name ("host" = the host's, read-only).
            block_network: deny egress (default).
            sandbox_id: custom id; `ConflictError` if taken.
            cpu, memory: Kubernetes quantities ("2", "500m"; "512Mi", "2Gi").
            timeout: seconds to wait until it is ready (default 3600).
            ttl_seconds: hard lifetime after which the service deletes it.
            heartbeat_timeout: idle seconds after which the service deletes it.
            env: environment of every command.
            wait_ready: block until the sandbox is ready.
            keepalive_s: if set, a background thread sends a heartbeat every `keepalive_s` seconds.
        """
        payload: dict[str, Any] = {"image": image, "block_network": block_network}
        for name, value in (("sandbox_id", sandbox_id), ("cpu", cpu), ("memory", memory), ("timeout", timeout),
                            ("ttl_seconds", ttl_seconds), ("heartbeat_timeout", heartbeat_timeout), ("env", env)):
            if value is not None:
                payload[name] = value
        info = self.request("POST", "/sandboxes", json=payload)
        sandbox = Sandbox(self, info["sandbox_id"], info, owned=True)
        if wait_ready and not info.get("ready", info.get("status") == "ready"):
            wait_s = float(timeout or 3600)
            sandbox.info = self.request("GET", f"/sandboxes/{sandbox.sandbox_id}/wait",
                                        params={"timeout": wait_s}, timeout=wait_s + 30)
        if keepalive_s is not None:
            sandbox.start_heartbeat(keepalive_s)
        return sandbox

    create_sandbox = create

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """Attach to an existing sandbox (not deleted when this client closes)."""
        return Sandbox(self, sandbox_id, self.request("GET", f"/sandboxes/{sandbox_id}"), owned=False)

    def get_job(self, job_id: str) -> JobResult:
        return JobResult.from_dict(self.request("GET", f"/jobs/{job_id}"))

    def wait_job(self, job_id: str, timeout: float = 300.0) -> JobResult:
        """The job once done; `WaitTimeoutError` if it is still running after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            job = JobResult.from_dict(self.request("GET", f"/jobs/{job_id}/wait",
                                                   params={"timeout": min(left, 300.0)}, timeout=min(left, 300) + 30))
            if job.done:
                return job
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"job {job_id} still {job.status} after {timeout}s", status_code=0)

    # snapshots and forks
    def list_snapshots(self) -> list[dict[str, Any]]:
        return self.request("GET", "/snapshots")["snapshots"]

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        """Attach to an existing snapshot (`NotFoundError` if there is none)."""
        return Snapshot(self, self.request("GET", f"/snapshots/{snapshot_id}"))

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot; its forks are not affected. Idempotent: a gone snapshot is not an error."""
        with contextlib.suppress(NotFoundError):
            self.request("DELETE", f"/snapshots/{snapshot_id}")

    def _fork(self, path: str, *, sandbox_id: str | None, timeout: int | None, ttl_seconds: float | None,
              heartbeat_timeout: float | None, keepalive_s: float | None) -> Sandbox:
        payload = fork_payload(sandbox_id=sandbox_id, timeout=timeout, ttl_seconds=ttl_seconds,
                               heartbeat_timeout=heartbeat_timeout)
        info = self.request("POST", path, json=payload, timeout=max(self.timeout, COPY_TIMEOUT_S))
        sandbox = Sandbox(self, info["sandbox_id"], info, owned=True)
        if keepalive_s is not None:
            sandbox.start_heartbeat(keepalive_s)
        return sandbox

    # ownership
    def _own(self, sandbox: Sandbox) -> None:
        with self._owned_lock:
            self._owned[sandbox.sandbox_id] = sandbox
        if self.auto_cleanup:
            OPEN_SANDBOXES.add(self.base_url, sandbox.sandbox_id, self.api_key)

    def _disown(self, sandbox_id: str) -> None:
        with self._owned_lock:
            self._owned.pop(sandbox_id, None)
        OPEN_SANDBOXES.discard(self.base_url, sandbox_id)

    def close(self) -> None:
        """Delete the sandboxes this client created and still holds (if auto_cleanup), then close."""
        if self.auto_cleanup:
            with self._owned_lock:
                owned = list(self._owned.values())
            for sandbox in owned:
                try:
                    sandbox.delete()
                except SandboxError:
                    pass
        self._http.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sandbox:
    """One sandbox. A context manager: `with client.create() as sb:` deletes it on exit, Ctrl-C included."""

    def __init__(self, client: SandboxClient, sandbox_id: str, info: dict[str, Any], *, owned: bool) -> None:
        self.client = client
        self.sandbox_id = sandbox_id
        self.info = info
        self.deleted = False
        self._keepalive: threading.Thread | None = None
        self._keepalive_stop = threading.Event()
        if owned:
            client._own(self)

    def _path(self, suffix: str = "") -> str:
        return f"/sandboxes/{self.sandbox_id}{suffix}"

    def refresh(self) -> dict[str, Any]:
        self.info = self.client.request("GET", self._path())
        return self.info

    def exec(self, command: str | list[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, login_shell: bool = False, wait: bool = True,
             max_output_bytes: int | None = None, stdin: str | None = None) -> JobResult:
        """Run a command: a shell string (`bash -c`, or `bash -lc` with login_shell) or an argv list.

        With `wait` (default) returns the finished job: `exit_code`, `stdout`, `stderr`, `*_truncated`,
        `timed_out` (then exit_code 124). Without, returns the queued job; `wait_job(job.job_id)` later.
        """
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
        data = self.client.request("POST", self._path("/exec"), json=body, timeout=exec_s + EXEC_GRACE_S)
        job = JobResult.from_dict({"sandbox_id": self.sandbox_id, **data})
        if not wait or job.done:
            return job
        return self.client.wait_job(job.job_id, timeout=exec_s + EXEC_GRACE_S)

    def get_job(self, job_id: str) -> JobResult:
        return self.client.get_job(job_id)

    def wait_job(self, job_id: str, timeout: float = 300.0) -> JobResult:
        return self.client.wait_job(job_id, timeout)

    def upload(self, remote_path: str, data: bytes | str, *, mode: int | None = None) -> int:
        """Write `data` (str is UTF-8 encoded) to `remote_path`; returns the size written."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        body: dict[str, Any] = {"path": remote_path, "content": base64.b64encode(raw).decode("ascii")}
        if mode is not None:
            body["mode"] = mode
        return int(self.client.request("POST", self._path("/files"), json=body)["size"])

    def upload_archive(self, remote_path: str, archive: bytes) -> int:
        """Unpack a tar archive (gzipped or not) into the directory `remote_path` (made if missing) with no process
        in the sandbox: the service writes its directories, files (modes and times kept) and links as the
        sandbox's user. A member that would land or point outside `remote_path` (an absolute name, `..`, a link
        leaving it, a device file) is refused with `PathError` and nothing is written; the unpacked tar is
        capped at 1 GiB. Returns the bytes of files written."""
        body = {"path": remote_path, "content": base64.b64encode(bytes(archive)).decode("ascii")}
        return int((self.client.request("POST", self._path("/files/archive"), json=body))["size"])

    def upload_file(self, local_path: str | Path, remote_path: str) -> int:
        path = Path(local_path)
        return self.upload(remote_path, path.read_bytes(), mode=path.stat().st_mode & 0o777)

    def download(self, remote_path: str, *, max_bytes: int | None = None) -> bytes:
        params: dict[str, Any] = {"path": remote_path}
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        return base64.b64decode(self.client.request("GET", self._path("/files"), params=params)["content"])

    def download_file(self, remote_path: str, local_path: str | Path) -> int:
        data = self.download(remote_path)
        Path(local_path).write_bytes(data)
        return len(data)

    def list_files(self, path: str = "/workspace", *, recursive: bool = False) -> list[FileEntry]:
        data = self.client.request("GET", self._path("/files/list"), params={"path": path, "recursive": recursive})
        return [FileEntry.from_dict(f) for f in data["files"]]

    def apply_patch(self, patch: str, *, timeout: float = 30.0) -> PatchResult:
        """`git apply` a unified diff in the workspace (the patch travels as data, never through a shell)."""
        data = self.client.request("POST", self._path("/apply_patch"),
                                   json={"patch": patch, "timeout_seconds": timeout}, timeout=timeout + 30)
        return PatchResult.from_dict(data)

    def resources(self) -> dict[str, Any]:
        return self.client.request("GET", self._path("/resources"))

    def heartbeat(self) -> None:
        self.client.request("POST", self._path("/heartbeat"))

    def start_heartbeat(self, interval_s: float = 60.0) -> None:
        """Send a heartbeat every `interval_s` seconds from a daemon thread until `stop_heartbeat`/delete."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        if self._keepalive is not None and self._keepalive.is_alive():
            return
        self._keepalive_stop.clear()

        def beat() -> None:
            while not self._keepalive_stop.wait(interval_s):
                try:
                    self.heartbeat()
                except SandboxError:
                    pass  # best effort; a missed beat only matters after heartbeat_timeout

        self._keepalive = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{self.sandbox_id}")
        self._keepalive.start()

    def keep_alive(self) -> None:
        """Heartbeat the sandbox every third of its heartbeat timeout (its info's, else the service's default, 600 s)
        from a background thread until `stop_heartbeat` or `delete` (`AsyncSandbox.keep_alive`)."""
        self.start_heartbeat(keepalive_interval_s(self.info))

    def stop_heartbeat(self) -> None:
        self._keepalive_stop.set()
        if self._keepalive is not None:
            self._keepalive.join(timeout=5)
            self._keepalive = None

    def pty(self, cmd: str | list[str] | None = None, *, env: dict[str, str] | None = None,
            cwd: str | None = None, rows: int = 24, cols: int = 80, connect_timeout: float = 10.0) -> PtyProcess:
        """Open an interactive terminal running `cmd` (default: a login shell)."""
        return PtyProcess(ws_url(self.client.base_url, self.sandbox_id), self.client.api_key,
                          pty_init_frame(cmd, env=env, cwd=cwd, rows=rows, cols=cols), connect_timeout)

    def snapshot(self, snapshot_id: str | None = None) -> Snapshot:
        """Copy this sandbox's workspace into a snapshot (files only: running processes are not carried).
        `ConflictError` (`detail["error"] == "sandbox_busy"`) while one of its commands runs; a
        `BackendRefusedError` (`"quota_exceeded"`) beyond the service's `max_snapshots`."""
        payload = {"snapshot_id": snapshot_id} if snapshot_id is not None else {}
        info = self.client.request("POST", self._path("/snapshots"), json=payload,
                                   timeout=max(self.client.timeout, COPY_TIMEOUT_S))
        return Snapshot(self.client, info)

    def fork(self, *, sandbox_id: str | None = None, timeout: int | None = None, ttl_seconds: float | None = None,
             heartbeat_timeout: float | None = None, keepalive_s: float | None = None) -> Sandbox:
        """A new sandbox (ready, owned by this client) whose workspace starts as a copy of this one's, with this
        one's image, network, limits and environment; no process of this one runs in it. Errors as `snapshot`."""
        return self.client._fork(self._path("/fork"), sandbox_id=sandbox_id, timeout=timeout,
                                 ttl_seconds=ttl_seconds, heartbeat_timeout=heartbeat_timeout,
                                 keepalive_s=keepalive_s)

    def delete(self) -> None:
        """Delete the sandbox (idempotent: deleting a gone sandbox is not an error)."""
        if self.deleted:
            return
        self.stop_heartbeat()
        try:
            self.client.request("DELETE", self._path())
        except NotFoundError:
            pass
        self.deleted = True
        self.client._disown(self.sandbox_id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id!r}, deleted={self.deleted})"


class Snapshot:
    """A snapshot of a sandbox's workspace (no processes). A context manager: `with sb.snapshot() as snap:`
    deletes it on exit. It is not deleted when the client closes: a snapshot is meant to outlive its sandbox."""

    def __init__(self, client: SandboxClient, info: dict[str, Any]) -> None:
        self.client = client
        self.info = info
        self.snapshot_id: str = info["snapshot_id"]
        self.deleted = False

    def fork(self, *, sandbox_id: str | None = None, timeout: int | None = None, ttl_seconds: float | None = None,
             heartbeat_timeout: float | None = None, keepalive_s: float | None = None) -> Sandbox:
        """A new sandbox (ready, owned by the client) whose workspace starts as a copy of this snapshot, with
        the snapshotted sandbox's image, network, limits and environment."""
        return self.client._fork(f"/snapshots/{self.snapshot_id}/fork", sandbox_id=sandbox_id, timeout=timeout,
                                 ttl_seconds=ttl_seconds, heartbeat_timeout=heartbeat_timeout,
                                 keepalive_s=keepalive_s)

    def delete(self) -> None:
        if not self.deleted:
            self.client.delete_snapshot(self.snapshot_id)
            self.deleted = True

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"Snapshot({self.snapshot_id!r} of {self.info.get('sandbox_id')!r}, deleted={self.deleted})"


class PtyProcess:
    """A terminal in a sandbox over the service's WebSocket (the API key travels in a header)."""

    def __init__(self, url: str, api_key: str | None, init: dict[str, Any], connect_timeout: float) -> None:
        with requires_extra("env"):
            from websockets.sync.client import connect

        headers = {"X-API-Key": api_key} if api_key else {}
        self._ws = connect(url, additional_headers=headers, open_timeout=connect_timeout, max_size=1 << 24,
                           legacy=True)  # a long-lived handle, closed by close(), not a with-block
        self._ws.send(json.dumps(init))
        self._out: queue.Queue[bytes] = queue.Queue()
        self._exited = threading.Event()
        self._ready = threading.Event()
        self.returncode: int | None = None
        self.error: str | None = None
        self.pid: int | None = None
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="pty-reader")
        self._reader.start()
        if not self._ready.wait(connect_timeout) or self.error:
            self.close()
            raise SandboxError(f"PTY did not start: {self.error or 'no ready frame'}")

    def _read_loop(self) -> None:
        try:
            for message in self._ws:
                frame = json.loads(message)
                kind = frame.get("type")
                if kind == "stdout":
                    self._out.put(base64.b64decode(frame.get("data", "")))
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
            self._out.put(b"")

    def write(self, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        self._ws.send(json.dumps({"type": "stdin", "data": base64.b64encode(raw).decode("ascii")}))

    def read(self, timeout: float | None = None) -> bytes:
        """The next output chunk; b"" once the process has exited and all output is read."""
        try:
            chunk = self._out.get(timeout=timeout)
        except queue.Empty:
            raise WaitTimeoutError(f"no PTY output within {timeout}s", status_code=0) from None
        if not chunk:
            self._out.put(b"")  # keep the end marker for later readers
        return chunk

    def read_until(self, marker: bytes, timeout: float = 10.0) -> bytes:
        """Output up to and including the first `marker`; `WaitTimeoutError` if it does not come in time."""
        deadline = time.monotonic() + timeout
        buffer = b""
        while marker not in buffer:
            chunk = self.read(max(0.0, deadline - time.monotonic()))
            if not chunk:
                raise WaitTimeoutError(f"PTY exited before {marker!r}; got {buffer[-200:]!r}", status_code=0)
            buffer += chunk
        return buffer

    def resize(self, rows: int, cols: int) -> None:
        self._ws.send(json.dumps({"type": "resize", "rows": int(rows), "cols": int(cols)}))

    def kill(self, sig: str = "TERM") -> None:
        self._ws.send(json.dumps({"type": "signal", "sig": sig}))

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise WaitTimeoutError(f"PTY process still running after {timeout}s", status_code=0)
        return self.returncode if self.returncode is not None else -1

    def close(self) -> None:
        try:
            self._ws.send(json.dumps({"type": "close"}))
        except Exception:
            pass
        self._ws.close()
        self._reader.join(timeout=5)

    def __enter__(self) -> PtyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
