"""The service's connection to a pod's agent (issue 15): the cause of the execs that failed with "its agent did
not answer: ReadError" under load, and why an exec can neither fail from a broken connection nor run twice.

The cause, as the failing pods' logs and the exception chain showed it: the agent received an exec's headers and
then the end of the stream, no body ("body must be a JSON object", then a broken pipe on its answer); the
service saw ReadError <- ClosedResourceError: the stream was closed by its own side. httpcore's pool (1.0.9)
hands an idle keep-alive connection to a request in one pass and closes it, as expired, in another pass that
runs before that request has marked it active (the second pass closes several expired connections, yielding
between them; meanwhile the first request starts on the one it was given). Under load the event loop lags, so a
connection whose keep-alive (5 s) ends just as the next exec of its sandbox arrives meets this often.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpcore._async.http11 as httpcore_http11
import httpx
import pytest
from kubernetes import client as k8s

from orchard.env.backends.base import ExecRequest
from orchard.env.backends.kubernetes import pod_agent
from orchard.env.backends.kubernetes.backend import KubernetesBackend
from orchard.env.backends.kubernetes.manifests import SANDBOX, KubernetesConfig, object_name

TOKEN = "agent-token"


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def echo_servers():
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Echo) for _ in range(7)]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


class _LateClock:
    """httpcore's clock for keep-alive expiry: `late` seconds ahead once set (time passing under load)."""

    late = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.late


async def _race(urls: list[str], headers: dict[str, str]) -> list[object]:
    """An exec (R1) is given an idle keep-alive connection; before it starts on it, a request to another agent
    (R2) runs a pass in which that connection and five others have expired (keep-alive 5 s; the clock jumps 10 s,
    as an overloaded event loop lets it). Both requests' outcomes."""
    target, elsewhere, others = urls[0], urls[1], urls[2:]
    clock = _LateClock()
    async with httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=5.0)) as client:
        for url in [*others, target]:  # idle connections, the exec's last: the pass closes the others first
            await client.post(url, content=b"earlier", headers=headers)

        async def other_request() -> httpx.Response:
            clock.late = 10.0  # runs once R1's pass gave it its connection (R1 then waits for its turn)
            return await client.post(elsewhere, content=b"other", headers=headers)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(httpcore_http11, "time", clock)
            return await asyncio.gather(client.post(target, content=b"exec", headers=headers), other_request(),
                                        return_exceptions=True)


async def test_a_pooled_keep_alive_connection_is_closed_under_the_request_it_was_given(echo_servers):
    exec_outcome, other = await _race(echo_servers, {})
    assert isinstance(other, httpx.Response) and other.content == b"other"
    # what the benchmark saw: ReadError <- ClosedResourceError (our own side closed the stream mid-request)
    assert isinstance(exec_outcome, httpx.ReadError), exec_outcome
    causes, cause = [], exec_outcome.__cause__
    while cause is not None:
        causes.append(type(cause).__name__)
        cause = cause.__cause__ or cause.__context__
    assert "ClosedResourceError" in causes, causes


async def test_a_connection_per_request_as_the_backend_sends_them_is_never_handed_over(echo_servers):
    # `Connection: close` (what KubernetesBackend sends to agents): no connection is idle in the pool, so no
    # pass can close one under a request; the same schedule goes through
    exec_outcome, other = await _race(echo_servers, {"Connection": "close"})
    assert [r.content for r in (exec_outcome, other)] == [b"exec", b"other"]  # type: ignore[union-attr]


# -- retries, and the agent's once-per-request_id --------------------------------------------------------------


@pytest.fixture
def agent(tmp_path):
    """The pod agent's HTTP server on 127.0.0.1 (as a pod runs it, but in this process), and its workspace."""
    server = pod_agent.build_server(str(tmp_path / "workspace"), host="127.0.0.1", port=0, token=TOKEN,
                                    env={"PATH": os.environ["PATH"]})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SimpleNamespace(server=server, port=server.server_address[1], workspace=tmp_path / "workspace")
    server.shutdown()
    server.server_close()


def _post_and_hang_up(port: int, body: dict) -> None:
    """POST /exec, whole, then close the connection without reading the answer (a connection that breaks after
    the agent received the request)."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /exec HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)


def _exec(port: int, body: dict) -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/exec", json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_agent_runs_a_request_id_once_and_answers_its_repeats(agent):
    count = agent.workspace / "count"
    slow = {"command": "echo ran >> count; sleep 0.5; echo done", "request_id": "exec-1", "timeout_s": 30}
    _post_and_hang_up(agent.port, slow)
    _wait_for(count.exists, "the first request's command to start")
    # the retry arrives while the first still runs: it waits for that run's answer instead of running again
    first = _exec(agent.port, slow)
    assert (first["exit_code"], count.read_text()) == (0, "ran\n")
    # ...and after it finished: the same answer, from memory (its stdout "done\n" is base64 "ZG9uZQo=")
    assert _exec(agent.port, slow) == first and first["stdout_b64"] == "ZG9uZQo="
    assert count.read_text() == "ran\n"
    # the id, not the command, decides: another id (or none) runs it again
    _exec(agent.port, {**slow, "request_id": "exec-2", "command": "echo ran >> count"})
    _exec(agent.port, {"command": "echo ran >> count"})
    assert count.read_text() == "ran\nran\nran\n"


def test_the_agent_keeps_a_bounded_number_of_answers(agent):
    for i in range(pod_agent.KEEP_ANSWERS + 5):
        _exec(agent.port, {"command": "true", "request_id": f"id-{i}"})
    kept = agent.server._answers
    # 16 + 5 finished: the 5 oldest are forgotten, the last 16 kept
    assert list(kept) == [f"id-{i}" for i in range(5, pod_agent.KEEP_ANSWERS + 5)]


def test_the_agent_refuses_a_malformed_request_id(agent):
    r = httpx.post(f"http://127.0.0.1:{agent.port}/exec", json={"command": "true", "request_id": 7},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 400 and "request_id" in r.json()["detail"]


class _BreakFirstExec(httpx.AsyncBaseTransport):
    """Delivers the first POST /exec to the agent, then fails it with ReadError once the agent has started the
    command (its answer is lost, as on a connection that broke); every other request goes through."""

    def __init__(self, started: os.PathLike[str]) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.started = started
        self.exec_bodies: list[dict] = []
        self.connection_headers: set[str | None] = set()
        self.background: list[asyncio.Task[httpx.Response]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.connection_headers.add(request.headers.get("Connection"))
        if request.url.path == "/exec":
            self.exec_bodies.append(json.loads(request.content))
            if len(self.exec_bodies) == 1:
                self.background.append(asyncio.create_task(self.inner.handle_async_request(request)))
                while not os.path.exists(self.started):
                    await asyncio.sleep(0.02)
                raise httpx.ReadError("injected: the connection broke after the agent got the request")
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        for task in self.background:
            await (await task).aclose()
        await self.inner.aclose()


async def test_an_exec_whose_connection_broke_is_retried_and_runs_once(agent):
    backend = KubernetesBackend(KubernetesConfig(agent_port=agent.port), api_client=k8s.ApiClient())
    name = object_name("s")
    pod = {"metadata": {"name": name, "labels": {SANDBOX: "s"}},
           "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
    synced = threading.Event()
    synced.set()
    backend._watcher = SimpleNamespace(synced=synced, pods={name: pod}, stop=lambda: None)  # type: ignore[assignment]
    backend._tokens["s"] = TOKEN
    transport = _BreakFirstExec(agent.workspace / "count")
    backend._http = httpx.AsyncClient(transport=transport)
    try:
        result = await backend.exec("s", ExecRequest(command="echo ran >> count; sleep 0.3; echo done", cwd=None,
                                                     env={}, timeout_s=30))
    finally:
        await backend.close()
    assert (result.exit_code, result.stdout) == (0, b"done\n")  # before the fix: BackendError ... ReadError
    assert (agent.workspace / "count").read_text() == "ran\n"  # ran once: the retry got the first run's answer
    first, retry = transport.exec_bodies
    assert first == retry and len(first["request_id"]) == 32  # the same request, the same id
    assert transport.connection_headers == {"close"}  # a connection per request (the module docstring)
