"""The exec agent as it runs inside a sandbox pod: the standard library only, so any image with Python works.

The orchestrator's own agent front (`orchard.env.agent.server`) needs FastAPI and uvicorn, which a sandbox's
image (``python:3.12-slim``, a SWE task's repository image) does not have. This front serves the same routes
with the same JSON over `http.server`, on top of the same `SandboxAgent` (commands, files, patches), so the
Kubernetes backend talks to a pod exactly as it would to `python -m orchard.env.agent`. The PTY WebSocket is
not served here (the Kubernetes backend does not offer terminals).

It is not run from the installed package: `orchard.env.backends.kubernetes.inject` packs it with the agent's
modules into a zipapp that the pod's init container copies into a shared volume; the sandbox's container then
runs ``python3 /orchard-agent/agent.pyz --root /workspace ...``. Requirement on the image: a ``python3`` of
version 3.10 or later on its PATH, and ``bash`` (string commands run under ``bash -lc``, as everywhere).

Routes (see `orchard.env.agent.server` for the bodies): GET /health (no auth), POST /exec, PUT /files,
PUT /files/archive, GET /files, GET /files/list, POST /apply_patch, GET /resources. POST /exec and POST /apply_patch
take an optional `request_id` in their body: the orchestrator retries a request whose connection broke with the
same id, and a request whose id the agent has seen runs nothing: it gets the first one's answer (waiting for it if
the first is still running), so a command runs once however often its request arrives. Every route but /health needs
``Authorization: Bearer <token>``, the token read from the environment variable named by ``--token-env``
(the pod gets it from its own Kubernetes Secret); without that variable the agent refuses to start.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import concurrent.futures
import hmac
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from orchard.env.agent.core import SandboxAgent
from orchard.env.agent.files import Workspace
from orchard.env.agent.isolation import PROCESS_GROUP, Isolation, Limits
from orchard.env.backends.base import ExecRequest, ExecResult, PathEscapeError

_MAX_BODY = 1 << 30
KEEP_ANSWERS = 16
"""Answers of finished requests kept for retries of their `request_id` (execs of a sandbox run one at a time,
and a retry comes within seconds, before the next one: a few suffice; each holds up to twice the output cap)."""
_NOT_INHERITED = frozenset({"HOSTNAME", "HOME", "PWD", "SHLVL", "OLDPWD", "_"})
"""Variables of the agent's own process that describe it, not the sandbox (the rest: the image's ENV and
the sandbox's env, which every command starts with)."""


def result_json(r: ExecResult) -> dict[str, Any]:
    """An ExecResult as the agent's JSON (as `orchard.env.agent.server.result_json`)."""
    return {
        "exit_code": r.exit_code,
        "stdout_b64": base64.b64encode(r.stdout).decode(),
        "stderr_b64": base64.b64encode(r.stderr).decode(),
        "stdout_truncated": r.stdout_truncated,
        "stderr_truncated": r.stderr_truncated,
        "timed_out": r.timed_out,
        "duration_s": r.duration_s,
    }


def exec_request(body: dict[str, Any]) -> ExecRequest:
    """The ExecRequest a POST /exec body describes (ValueError naming a malformed field)."""
    if not isinstance(body, dict) or "command" not in body:
        raise ValueError("body must be a JSON object with a 'command'")
    stdin_b64 = body.get("stdin_b64")
    try:
        stdin = base64.b64decode(stdin_b64, validate=True) if stdin_b64 is not None else None
    except (binascii.Error, TypeError) as e:
        raise ValueError(f"stdin_b64 is not valid base64: {e}") from e
    return ExecRequest(
        command=body["command"],
        cwd=body.get("cwd"),
        env=body.get("env") or {},
        timeout_s=body.get("timeout_s", 600.0),
        stdin=stdin,
        max_output_bytes=body.get("max_output_bytes", 1 << 20),
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the orchestrator reuses its connection to the pod
    server: _AgentServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the pod's log

    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if not 0 <= n <= _MAX_BODY:
            raise ValueError(f"Content-Length must be in [0, {_MAX_BODY}], got {n}")
        return self.rfile.read(n)

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if url.path == "/health" and method == "GET":
                agent = self.server.agent
                self._json(200, {"status": "ok", "isolation": agent.isolation.mode, "workdir": agent.workspace.mount})
                return
            given = (self.headers.get("Authorization") or "").removeprefix("Bearer ").encode()
            if not hmac.compare_digest(given, self.server.token.encode()):
                self._body()
                self._json(401, {"detail": "missing or wrong bearer token"})
                return
            route = self.server.routes.get((method, url.path))
            if route is None:
                self._body()
                self._json(404, {"detail": f"no route {method} {url.path}"})
                return
            route(self, query)
        except PathEscapeError as e:
            self._json(400, {"detail": str(e), "error": "path_escape"})
        except FileNotFoundError as e:
            self._json(404, {"detail": str(e), "error": "not_found"})
        except (ValueError, IsADirectoryError, NotADirectoryError, KeyError, TypeError) as e:
            self._json(400, {"detail": str(e)})
        except Exception as e:  # the agent must answer, whatever broke; the orchestrator reports it
            self._json(500, {"detail": f"{type(e).__name__}: {e}"})

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")


def _request_id(body: Any) -> str | None:
    request_id = body.get("request_id") if isinstance(body, dict) else None
    if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= 128):
        raise ValueError(f"request_id must be a string of 1 to 128 characters, got {request_id!r}")
    return request_id


def _exec(h: _Handler, query: dict[str, str]) -> None:
    body = json.loads(h._body() or b"null")
    request = exec_request(body)
    h._json(200, h.server.once(_request_id(body), lambda: result_json(h.server.run(h.server.agent.exec(request)))))


def _put_file(h: _Handler, query: dict[str, str]) -> None:
    data = h._body()
    mode = query.get("mode")
    try:
        mode_int = int(mode, 8) if mode is not None else None
    except ValueError as e:
        raise ValueError(f"mode must be octal digits, got {mode!r}") from e
    h.server.run(h.server.agent.write_file(query["path"], data, mode_int))
    h._send(204)


def _put_archive(h: _Handler, query: dict[str, str]) -> None:
    data = h._body()
    h._json(200, asdict(h.server.run(h.server.agent.extract_archive(query["path"], data))))


def _get_file(h: _Handler, query: dict[str, str]) -> None:
    h._body()
    max_bytes = int(query["max_bytes"]) if "max_bytes" in query else None
    data = h.server.run(h.server.agent.read_file(query["path"], max_bytes))
    h._send(200, data, "application/octet-stream")


def _list_files(h: _Handler, query: dict[str, str]) -> None:
    h._body()
    recursive = query.get("recursive", "false").lower() in ("1", "true", "yes")
    files = h.server.run(h.server.agent.list_files(query.get("path", "."), recursive))
    h._json(200, {"files": [asdict(f) for f in files]})


def _apply_patch(h: _Handler, query: dict[str, str]) -> None:
    body = json.loads(h._body() or b"null")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object with a 'patch'")
    patch = body["patch"]
    h._json(200, h.server.once(_request_id(body), lambda: result_json(h.server.run(h.server.agent.apply_patch(patch)))))


def _resources(h: _Handler, query: dict[str, str]) -> None:
    h._body()
    h._json(200, asdict(h.server.run(h.server.agent.resources())))


class _AgentServer(ThreadingHTTPServer):
    """One thread per connection; the agent's coroutines run on one event loop in a thread of its own."""

    daemon_threads = True
    routes = {
        ("POST", "/exec"): _exec,
        ("PUT", "/files"): _put_file,
        ("PUT", "/files/archive"): _put_archive,
        ("GET", "/files"): _get_file,
        ("GET", "/files/list"): _list_files,
        ("POST", "/apply_patch"): _apply_patch,
        ("GET", "/resources"): _resources,
    }

    def __init__(self, address: tuple[str, int], agent: SandboxAgent, token: str) -> None:
        super().__init__(address, _Handler)
        self.agent = agent
        self.token = token
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True).start()
        self._answers: dict[str, concurrent.futures.Future[Any]] = {}
        self._answers_lock = threading.Lock()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def once(self, request_id: str | None, answer: Callable[[], Any]) -> Any:
        """`answer()`, computed once per `request_id` (None: every time): a repeat of an id gets the first
        call's result or exception, waiting for it while the first call runs."""
        if request_id is None:
            return answer()
        with self._answers_lock:
            future = self._answers.get(request_id)
            first = future is None
            if first:
                future = self._answers[request_id] = concurrent.futures.Future()
        assert future is not None
        if first:
            try:
                future.set_result(answer())
            except BaseException as e:  # a repeat gets the same error (a 400 stays a 400)
                future.set_exception(e)
            with self._answers_lock:
                done = [k for k, f in self._answers.items() if f.done()]
                for k in done[:max(0, len(done) - KEEP_ANSWERS)]:  # oldest first: dicts keep insertion order
                    del self._answers[k]
        return future.result()


def build_server(root: str, *, host: str, port: int, token: str, mount: str | None = None,
                 env: dict[str, str] | None = None, aliases: tuple[str, ...] = ()) -> _AgentServer:
    """The agent's HTTP server for the workspace `root`. The pod is the isolation boundary: commands run as
    process groups of the pod's own user, with no per-command limits (Kubernetes enforces the pod's CPU and
    memory with cgroups; more would only double them). `mount` is where commands see `root` (default `root`
    itself); `env` is what every command starts with (the container's environment: the image's and the
    sandbox's variables); `aliases` are more absolute paths the file API and `cwd` take as the workspace."""
    if not token:
        raise ValueError("token must be a non-empty string")
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    workspace = Workspace(root, mount=mount or root, aliases=tuple(dict.fromkeys((root, os.path.realpath(root), *aliases))))
    iso = Isolation(workspace, mode=PROCESS_GROUP, network=True, limits=Limits(pids=None, memory_mb=None))
    return _AgentServer((host, port), SandboxAgent(iso, env=env), token)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="agent.pyz", description="orchard's exec agent inside a sandbox pod")
    p.add_argument("--root", required=True, help="the workspace directory")
    p.add_argument("--mount", default=None, help="where commands see the workspace (default: --root)")
    p.add_argument("--alias", action="append", default=[],
                   help="another path that names the workspace (a test harness that cannot mount it at --mount)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (the pod's network namespace)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--token-env", default="ORCHARD_AGENT_TOKEN", help="env variable holding the bearer token")
    args = p.parse_args(argv)
    token = os.environ.pop(args.token_env, "")  # popped: the sandbox's commands must not inherit it
    if not token:
        print(f"agent: ${args.token_env} is empty; refusing to serve without a token", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    server = build_server(args.root, host=args.host, port=args.port, token=token, mount=args.mount, env=env,
                          aliases=tuple(args.alias))
    print(f"orchard pod agent on {args.host}:{args.port} (workspace {args.root})", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
